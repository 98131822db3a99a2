"""from_pretrained: one call from a model folder (or a model id in the local Hugging Face
cache) to a model sharded over the tp ranks, each rank holding only its own slices.

It is the five steps a big model needs, in order: build the model on the meta device from
its config, take the plan (a file, a shipped plan's name, or inferred), apply it over the
mesh, materialize, and read each rank's regions of the checkpoint (load.py). Start at
`from_pretrained`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..apply import apply_plan
from ..errors import MeshError, TpplanError
from ..plan.schema import Plan
from .load import load_checkpoint

__all__ = ["PretrainedError", "from_pretrained"]


class PretrainedError(TpplanError, ValueError):
    """A model folder or id from_pretrained cannot build a model from."""


def from_pretrained(
    path_or_cached_id: str | Path,
    mesh: DeviceMesh | None = None,
    *,
    plan: Plan | str | Path | None = None,
    dtype: torch.dtype | str | None = None,
    model_class: Any = None,
    device: str | torch.device | None = None,
    local_shards: bool = True,
    check_inputs: bool | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Build, shard and load a Hugging Face model in one call; call it on every rank.

    Args:
        path_or_cached_id: a model folder (one written by `save_pretrained` or by
            `save_checkpoint`, safetensors or DCP), or a model id already in the local
            Hugging Face cache (`hf download ID` puts it there; tpplan never downloads).
        mesh: the 1-D tensor-parallel DeviceMesh. Default: one tp axis over every rank of
            the initialised process group (torchrun, `tpplan.launch`); under torchrun with
            no process group yet, it is initialised here, as transformers does.

    Keyword Args:
        plan: a Plan, a plan file, a shipped plan's name ("llama"), or None to infer one
            from the model.
        dtype: the parameters' dtype; None or "auto" takes the config's (as transformers'
            from_pretrained does), float32 where the config names none.
        model_class: a transformers model class (`LlamaForCausalLM`) or auto class
            (`AutoModelForSequenceClassification`); default the config's `architectures`.
        device: where the shards live; default the mesh's device (this rank's GPU on CUDA).
        local_shards: as for `apply_plan`.
        check_inputs: as for `apply_plan`.
        trust_remote_code: passed to transformers for models whose code is in the folder.

    Returns:
        The sharded model, loaded and in eval mode (call `.train()` to train), with the
        folder's generation config when it has one.

    Peak memory per rank is a rank's own shards plus what `load_checkpoint` reads at once:
    no rank ever holds the whole model.

    Example::

        >>> model = tpplan.from_pretrained("meta-llama/Llama-3.2-1B")  # under torchrun
    """
    folder = _folder(path_or_cached_id)
    config = _config(folder, trust_remote_code)
    with torch.device("meta"):
        model = _build(config, model_class, _dtype(dtype, config), trust_remote_code)
    apply_plan(
        model,
        mesh if mesh is not None else default_mesh(),
        plan,
        check_inputs=check_inputs,
        local_shards=local_shards,
    )
    load_checkpoint(model, folder, device=device)
    _generation_config(model, folder)
    return model.eval()


def default_mesh() -> DeviceMesh:
    """One tp axis over every rank of the process group, initialising it from torchrun's
    environment when no one has yet."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
            raise MeshError(
                "from_pretrained shards over the ranks of the process group, and none is "
                "initialised. Fix: run the script under torchrun (torchrun --nproc-per-node N "
                "script.py) or tpplan.launch, or pass a mesh."
            )
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group()
    device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("tp",))


def _folder(spec: str | Path) -> Path:
    """The local folder of a path or of a model id in the hub cache."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PretrainedError(
                f"{path} has no config.json, which from_pretrained builds the model from. Fix: "
                "point it at a folder written by save_pretrained or save_checkpoint (both "
                "write the config of a transformers model)."
            )
        return path
    from huggingface_hub import snapshot_download

    from .._runtime.models import hub_cache

    try:
        return Path(snapshot_download(str(spec), cache_dir=hub_cache(), local_files_only=True))
    except Exception:  # huggingface_hub raises several kinds for a missing or malformed id
        raise PretrainedError(
            f"'{spec}' is no folder, and no model of that id is in the local Hugging Face "
            f"cache ({hub_cache()}); tpplan never downloads. Fix: pass a model folder, or "
            f"download it first (hf download {spec})."
        ) from None


def _config(folder: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise PretrainedError(
            f"{folder / 'config.json'} is not a transformers config ({' '.join(str(e).split())}). "
            "Fix: save the model with save_pretrained or save_checkpoint."
        ) from None


def _dtype(given: torch.dtype | str | None, config: Any) -> torch.dtype:
    """The dtype asked for; None or "auto" the config's (float32 where it names none)."""
    dtype = given
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise PretrainedError(
            f"dtype {given!r} is not a floating-point torch dtype. Fix: pass one such as "
            "torch.bfloat16 or 'bfloat16', or 'auto' for the config's."
        )
    return dtype


def _build(config: Any, model_class: Any, dtype: torch.dtype, trust_remote_code: bool) -> nn.Module:
    """The model on the meta device: the given class, else the config's architecture, else
    the auto classes tpplan builds models with."""
    import transformers

    if model_class is None:
        names = getattr(config, "architectures", None) or []
        model_class = next(
            (getattr(transformers, n) for n in names if hasattr(transformers, n)), None
        )
    if model_class is None:
        from .._runtime.models import model_from_config

        return model_from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    if hasattr(model_class, "from_config"):  # an auto class
        return model_class.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    if hasattr(model_class, "_from_config"):
        return model_class._from_config(config, dtype=dtype)
    raise PretrainedError(
        f"model_class {model_class!r} is not a transformers model class or auto class. Fix: "
        "pass one such as transformers.AutoModelForCausalLM, or leave it out."
    )


def _generation_config(model: nn.Module, folder: Path) -> None:
    if not (folder / "generation_config.json").is_file() or not hasattr(model, "generation_config"):
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(folder)  # type: ignore[assignment]
