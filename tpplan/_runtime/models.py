"""Build a model from a command-line MODEL spec, on the meta device: no weights, any size.

A spec is one of: `package.module:callable` returning an nn.Module; a local Hugging Face
model folder or its `config.json`; a model id already in the local Hugging Face cache
(offline); or a transformers model type (`llama`, `gpt2`) built from its default config.
`--set key=value` overrides config fields. Start at `build_model`.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import TpplanError, did_you_mean

__all__ = [
    "ModelSpecError",
    "build_model",
    "hub_cache",
    "hub_folder",
    "model_from_config",
    "parse_overrides",
]


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


def hub_cache() -> Path:
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


def hub_folder(model_id: str) -> Path:
    """The hub cache's folder of a model id: org/name -> HUB_CACHE/models--org--name."""
    return hub_cache() / ("models--" + model_id.replace("/", "--"))


# a Hugging Face model id: NAME or ORG/NAME (anything else is a path or a typo)
_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_KINDS = (
    "MODEL is a transformers model type (llama, gpt2, ...), a local model folder or config.json, "
    "a model id in the local Hugging Face cache, or package.module:callable."
)


def _config(spec: str) -> Any:
    from transformers import CONFIG_MAPPING, AutoConfig

    path = Path(spec)
    if path.is_file() and path.name.endswith(".json"):
        return _local_config(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSpecError(
                f"the folder '{spec}' has no config.json; point MODEL at a Hugging Face model folder."
            )
        return _local_config(path / "config.json")
    if spec in CONFIG_MAPPING:
        return AutoConfig.for_model(spec)
    if not _MODEL_ID.fullmatch(spec) or spec.endswith(".json"):
        raise ModelSpecError(f"'{spec}' is no file or folder. {_KINDS}")
    cache = hub_cache()
    try:
        return AutoConfig.from_pretrained(spec, cache_dir=str(cache), local_files_only=True)
    except (OSError, ValueError) as e:  # ValueError: huggingface_hub's refusal of an id
        cause = _one_line(e)
    hint = did_you_mean(spec, list(CONFIG_MAPPING))
    if hub_folder(spec).is_dir():
        where = f"in the local Hugging Face cache ({cache}) but gives no config ({cause})"
    elif hint:  # most likely a misspelt model type ("lama"); the id is the second guess
        raise ModelSpecError(
            f"'{spec}' is not a model tpplan can build.{hint} (As a model id it is not in the "
            f"local Hugging Face cache, {cache}: hf download {spec} config.json puts it there.)"
        )
    else:
        where = f"not in the local Hugging Face cache ({cache})"
    raise ModelSpecError(
        f"'{spec}' is {where}, and tpplan never downloads. Download it first "
        f"(hf download {spec} config.json), or pass a local folder."
    )


def _local_config(file: Path) -> Any:
    """The config a local config.json (or another .json config file) holds; a file that is
    not JSON, or not a transformers config, is named."""
    from transformers import AutoConfig

    try:
        json.loads(file.read_bytes())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
        what = (
            f"line {e.lineno}, column {e.colno}: {e.msg}"
            if isinstance(e, json.JSONDecodeError)
            else _one_line(e)
        )
        raise ModelSpecError(
            f"{file} is not valid JSON ({what}). Fix: repair it, or download the model's "
            "config.json again."
        ) from None
    try:
        return AutoConfig.from_pretrained(
            str(file.parent) if file.name == "config.json" else str(file)
        )
    except (OSError, ValueError) as e:
        raise ModelSpecError(
            f"{file} is not a transformers config ({_one_line(e)}). Fix: point MODEL at a Hugging "
            "Face model folder, whose config.json names its model_type."
        ) from None


def _one_line(e: BaseException) -> str:
    """An exception's text on one line (transformers' and huggingface_hub's span several)."""
    return " ".join(str(e).split())


def _is_model_type(spec: str) -> bool:
    from transformers import CONFIG_MAPPING

    path = Path(spec)
    return not path.is_file() and not path.is_dir() and spec in CONFIG_MAPPING


def model_from_config(config: Any, **kwargs: Any) -> Any:
    """The model transformers' auto classes build for `config` (a causal LM first, then a
    seq2seq model for encoder-decoder configs, then the base model); `kwargs` (dtype) go to
    `from_config`."""
    import transformers

    kinds = ["AutoModelForCausalLM", "AutoModel"]
    if getattr(config, "is_encoder_decoder", False):
        kinds = ["AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq", *kinds]
    for kind in kinds:
        try:
            return getattr(transformers, kind).from_config(config, **kwargs)
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


def _overridden(config: Any, overrides: dict[str, Any], *, rebuild: bool) -> Any:
    """`config` with the --set values; a value the config refuses (a word for a count, heads
    that do not divide the width) is named with the field's current value as an example."""
    from huggingface_hub.errors import StrictDataclassError

    defaults = {key: getattr(config, key, None) for key in overrides}
    try:
        if rebuild:
            # Built again with the overrides as arguments, so that fields derived from them
            # (a per-layer list sized by num_hidden_layers) follow.
            return type(config)(**overrides)
        for key, value in overrides.items():
            setattr(config, key, value)
        return config
    except (TypeError, ValueError, StrictDataclassError) as e:
        cause = e.__cause__ if isinstance(e, StrictDataclassError) and e.__cause__ else e
        why = _one_line(cause).rstrip(".")
        named = re.search(r"field '(\w+)'", str(e))
        field = named.group(1) if named and named.group(1) in overrides else None
        name = type(config).__name__
        if field is None:
            given = " ".join(f"{k}={v!r}" for k, v in overrides.items())
            raise ModelSpecError(
                f"--set {given}: {name} refuses them ({why}). Fix: choose values that fit "
                "together, or leave some out."
            ) from None
        example = f", e.g. --set {field}={defaults[field]}" if defaults[field] is not None else ""
        raise ModelSpecError(
            f"--set {field}={overrides[field]!r}: {name} refuses it ({why}). Fix: give {field} a "
            f"value of its type and range{example}."
        ) from None


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
            config = _overridden(config, overrides, rebuild=_is_model_type(spec))
            model = model_from_config(config)
    if not isinstance(model, nn.Module):
        raise ModelSpecError(
            f"MODEL '{spec}' gave a {type(model).__name__}, not a torch nn.Module."
        )
    return model.eval()
