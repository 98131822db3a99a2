"""Build a model from a command-line MODEL spec, on the meta device: no weights, any size.

A spec is one of: `package.module:callable` returning an nn.Module; a local Hugging Face
model folder or its `config.json`; a model id already in the local Hugging Face cache
(offline); or a transformers model type (`llama`, `gpt2`) built from its default config.
`--set key=value` overrides config fields. Start at `build_model`.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import TpplanError, did_you_mean

__all__ = ["ModelSpecError", "build_model", "parse_overrides"]


class ModelSpecError(TpplanError, ValueError):
    """A MODEL argument that names no model tpplan can build, or a bad --set."""


def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """`["num_hidden_layers=2", "hidden_act=gelu"]` -> {"num_hidden_layers": 2, ...}."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ModelSpecError(
                f"--set takes key=value, got '{pair}' (e.g. --set num_hidden_layers=2)."
            )
        try:
            value: Any = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            # true/false as JSON and YAML write them; any other bare word (gelu) is a string
            value = {"true": True, "false": False}.get(raw.strip().lower(), raw)
        out[key.strip()] = value
    return out


def _hub_cache() -> Path:
    """The Hugging Face hub cache folder, read from the environment now: huggingface_hub reads
    it once at import, so HF_HUB_CACHE or HF_HOME set later (by a test, a notebook) would
    otherwise be missed. Same precedence as huggingface_hub."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def _cache_folder(model_id: str) -> str:
    """The hub cache's folder name for a model id: org/name -> models--org--name."""
    return "models--" + model_id.replace("/", "--")


def _config(spec: str) -> Any:
    from transformers import CONFIG_MAPPING, AutoConfig

    path = Path(spec)
    if path.is_file() and path.name.endswith(".json"):
        return AutoConfig.from_pretrained(
            str(path.parent) if path.name == "config.json" else str(path)
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSpecError(
                f"the folder '{spec}' has no config.json; point MODEL at a Hugging Face model folder."
            )
        return AutoConfig.from_pretrained(str(path))
    if spec in CONFIG_MAPPING:
        return AutoConfig.for_model(spec)
    cache = _hub_cache()
    # An id without an owner ("bert-base-uncased") is tried only when it is cached, so that a
    # misspelt model type still gets its "did you mean".
    if "/" in spec or (cache / _cache_folder(spec)).is_dir():
        try:
            return AutoConfig.from_pretrained(spec, cache_dir=str(cache), local_files_only=True)
        except OSError:
            where = (
                f"in the local Hugging Face cache ({cache}) without its config.json"
                if (cache / _cache_folder(spec)).is_dir()
                else f"not in the local Hugging Face cache ({cache})"
            )
            raise ModelSpecError(
                f"'{spec}' is {where}, and tpplan never downloads. Download it first "
                f"(hf download {spec} config.json), or pass a local folder."
            ) from None
    raise ModelSpecError(
        f"'{spec}' is not a model tpplan can build.{did_you_mean(spec, list(CONFIG_MAPPING))} MODEL is a "
        "transformers model type (llama, gpt2, ...), a local model folder or config.json, a model id in "
        "the local Hugging Face cache, or package.module:callable."
    )


def _is_model_type(spec: str) -> bool:
    from transformers import CONFIG_MAPPING

    path = Path(spec)
    return not path.is_file() and not path.is_dir() and spec in CONFIG_MAPPING


def _from_config(config: Any) -> Any:
    import transformers

    kinds = ["AutoModelForCausalLM", "AutoModel"]
    if getattr(config, "is_encoder_decoder", False):
        kinds = ["AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq", *kinds]
    for kind in kinds:
        try:
            return getattr(transformers, kind).from_config(config)
        except ValueError:
            continue  # this auto class has no model for the config; try the next
    raise ModelSpecError(f"transformers has no model class for config {type(config).__name__}.")


def _callable(spec: str) -> Any:
    mod_name, _, attr = spec.partition(":")
    # like `python -m`, a module of the folder tpplan runs in imports without installing it
    here = os.getcwd()
    added = "" not in sys.path and here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ModelSpecError(f"cannot import '{mod_name}' for MODEL '{spec}': {e}.") from None
    finally:
        if added:
            sys.path.remove(here)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelSpecError(f"'{mod_name}' has no callable '{attr}' (MODEL '{spec}').")
    return fn()


def build_model(spec: str, overrides: dict[str, Any] | None = None, *, device: str = "meta") -> Any:
    """The nn.Module a spec names, built on `device` (meta by default: no memory used)."""
    import torch
    from torch import nn

    overrides = overrides or {}
    with torch.device(device):
        if ":" in spec and not Path(spec).exists():
            if overrides:
                raise ModelSpecError(
                    "--set applies to Hugging Face configs, not to package.module:callable models."
                )
            model = _callable(spec)
        else:
            config = _config(spec)
            for key in overrides:
                # A field the config class does not declare is kept, as in a config.json
                # (Qwen3-MoE reads `getattr(config, "head_dim", ...)`), unless it looks like
                # a misspelt declared one.
                hint = did_you_mean(key, list(config.to_dict()))
                if not hasattr(config, key) and hint:
                    raise ModelSpecError(
                        f"--set {key}: {type(config).__name__} has no field '{key}'.{hint}"
                    )
            if _is_model_type(spec):
                # Built again with the overrides as arguments, so that fields derived from
                # them (a per-layer list sized by num_hidden_layers) follow.
                try:
                    config = type(config)(**overrides)
                except (TypeError, ValueError) as e:
                    raise ModelSpecError(
                        f"--set: {type(config).__name__} refuses {overrides}: {e}"
                    ) from None
            else:
                for key, value in overrides.items():
                    setattr(config, key, value)
            model = _from_config(config)
    if not isinstance(model, nn.Module):
        raise ModelSpecError(
            f"MODEL '{spec}' gave a {type(model).__name__}, not a torch nn.Module."
        )
    return model.eval()
