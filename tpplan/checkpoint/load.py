"""Loading a checkpoint into a model sharded at any tp size (or not sharded at all).

Start at `load_checkpoint`. A safetensors folder is read here: each rank reads only the
region of each tensor its DTensor placement gives it (tpplan/checkpoint/safetensors_io.py
does the file work), including tensors a Hugging Face checkpoint stores in another layout
(per-expert tensors: tpplan/checkpoint/converted.py). A DCP folder is tpplan/checkpoint/dcp.py.
Either way every key, shape and file is checked before the first byte is copied, so a bad
checkpoint is refused with the model untouched (tpplan/checkpoint/keys.py), and the buffers
no checkpoint holds are recomputed (tpplan/checkpoint/buffers.py). Under
`tpplan._runtime.local.simulated_ranks` (every rank in one process) safetensors loads work
per rank; DCP needs real processes.
"""

from __future__ import annotations

import gc
import itertools
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._runtime.ranks import each_rank, simulated
from .._runtime.torch_compat import StridedShard
from ..compile.shard import retie, tied_holders
from ..compile.strided import local_runs
from .buffers import recompute_buffers
from .converted import Unsupported, read_slices, shape_of, virtual_tensors
from .dcp import load_dcp
from .folder import readable_folder
from .keys import match_keys
from .progress import Progress
from .safetensors_io import (
    CheckpointError,
    index_folder,
    open_files,
    read_slices_into,
    safetensors_files,
)

__all__ = ["load_checkpoint"]


def load_checkpoint(
    model: nn.Module,
    path: str | Path,
    *,
    rebuild_buffers: bool = True,
    device: str | torch.device | None = None,
) -> None:
    """Load a checkpoint folder into `model`, sharded by apply_plan at any tp size, or not.

    `path` is a torch.distributed.checkpoint folder or a safetensors model folder (one
    written by save_checkpoint(sharded=False) or save_pretrained). Call on every rank. The
    intended use is a model built on the meta device and sharded: load_checkpoint then
    materializes it itself (empty, on `device`, by default the device of the mesh it was
    sharded over, or the CPU for a model no plan was applied to), ties its tied weights
    again, and fills it: from safetensors each rank reads only its own regions; DCP
    reshards by itself. Every key, shape and file is checked first; on a mismatch a
    CheckpointError names the keys (or the file) and nothing is loaded.

    Non-persistent buffers (rotary `inv_freq` and the like) are in no checkpoint, and after
    materializing they hold garbage; with `rebuild_buffers` they are recomputed (see
    tpplan/checkpoint/buffers.py).

    A folder whose save was killed while replacing its files is read from the complete new
    checkpoint staged inside it, with a warning.
    """
    path = _readable(Path(path))
    sd = _materialized(model, device)
    if (path / ".metadata").is_file():
        if simulated():
            raise CheckpointError(
                f"{path} is a torch.distributed.checkpoint folder; loading one needs real "
                "processes (torchrun). Under simulated ranks load a safetensors folder."
            )
        loader = load_dcp(model, sd, path)
    else:
        loader = _load_safetensors(model, sd, path)
    with torch.no_grad():
        next(loader)  # everything checked; nothing copied yet
        if rebuild_buffers:
            recompute_buffers(model)
        for _ in loader:
            pass


def _readable(path: Path) -> Path:
    found = readable_folder(path) if path.is_dir() else path
    if found != path:
        warnings.warn(
            f"a save to {path} was killed while replacing its files; loading the complete new "
            f"checkpoint from {found}. The next save_checkpoint to {path} puts it in place.",
            stacklevel=3,
        )
    return found


def _materialized(model: nn.Module, device: str | torch.device | None) -> dict[str, torch.Tensor]:
    """The model's state dict, once the model is off the meta device: a model on it is
    made empty on `device` (default: its mesh's device), its tied weights tied again
    (`to_empty` makes one tensor per holder)."""
    sd = model.state_dict(keep_vars=True)
    if not any(t.device.type == "meta" for t in sd.values()):
        return sd
    tied = tied_holders(model)
    # to_empty swaps tensor-subclass parameters (LocalTensors under simulated ranks) in
    # place, which torch refuses while a weak reference to one lives; the plan check's
    # trace leaves such references in reference cycles until a collection
    gc.collect()
    model.to_empty(device=device if device is not None else _mesh_device(sd))
    retie(tied)
    return model.state_dict(keep_vars=True)


def _mesh_device(sd: dict[str, torch.Tensor]) -> torch.device:
    """The device of the mesh the model was sharded over (this rank's current GPU for
    CUDA), the CPU for a model no plan was applied to."""
    mesh = next((t.device_mesh for t in sd.values() if isinstance(t, DTensor)), None)
    if mesh is None or mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def _load_safetensors(model: nn.Module, sd: dict[str, torch.Tensor], path: Path) -> Iterator[None]:
    """As load_dcp: the first step checks everything and copies nothing; each later step
    copies one tensor, each rank reading only its own regions of it."""
    files = [path] if path.is_file() and path.suffix == ".safetensors" else []
    if not files and path.is_dir():
        files = safetensors_files(path)
    if not files:
        raise CheckpointError(
            f"{path} is neither a torch.distributed.checkpoint folder (no .metadata) nor a "
            "safetensors model folder (no *.safetensors); fix: pass the folder that "
            "save_checkpoint or save_pretrained wrote."
        )
    with open_files(files) as fds:
        index = index_folder(fds)
        shapes = {k: e.shape for k, e in index.items()}
        virtual = _virtual(model, sd, shapes, path)
        stored = set().union(*(_leaves(n) for n in virtual.values())) if virtual else set()
        listed = {k: v for k, v in shapes.items() if k not in stored}
        listed.update({k: shape_of(n, shapes) or () for k, n in virtual.items()})
        source = match_keys(model, sd, listed, path)
        yield
        total = sum(t.dtype.itemsize * t.numel() for t in sd.values())

        def read(key: str, region: tuple[slice, ...], out: torch.Tensor) -> None:
            read_slices_into(fds[index[key].file], index[key], region, out)

        with Progress(total, f"loading {path.name}") as progress:
            for key, target in sd.items():
                node = virtual.get(source[key], source[key])
                fill = partial(read_slices, node, read=read, shapes=shapes)
                _copy_from_file(key, target, fill, listed[source[key]])
                progress.advance(target.dtype.itemsize * target.numel())
                yield


def _virtual(
    model: nn.Module, sd: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], path: Path
) -> dict[str, Any]:
    """Model keys stored in another layout (per-expert tensors of a mixture of experts),
    found with transformers' conversion list for the model when some key is not stored as
    it is; a conversion tpplan cannot read piecewise is refused by name."""
    if all(k in shapes for k in sd):
        return {}
    found = virtual_tensors(model, list(shapes))
    odd = [(k, n) for k, n in found.items() if k in sd and k not in shapes]
    refused = [(k, n) for k, n in odd if isinstance(n, Unsupported)]
    if refused:
        key, node = refused[0]
        raise CheckpointError(
            f"{path}: {key} is stored as {len(node.sources)} tensors ({node.sources[0]}, ...) "
            f"that transformers combines with {node.operations} while loading, which tpplan "
            f"cannot read slice by slice ({len(refused)} such keys). Fix: load it once with "
            "from_pretrained and save it with tpplan.save_checkpoint(model, path, sharded=False), "
            "which stores the model's own layout."
        )
    return {k: n for k, n in odd if shape_of(n, shapes) is not None}


def _leaves(node: Any) -> set[str]:
    return {node} if isinstance(node, str) else set().union(*(_leaves(p) for p in node.parts))


def _copy_from_file(
    key: str,
    target: torch.Tensor,
    fill_region: Callable[[tuple[slice, ...], torch.Tensor], None],
    shape: tuple[int, ...],
) -> None:
    """Each rank reads the regions its placement gives it, straight into its local tensor
    (one region, or one per fused part: tpplan/compile/strided.py)."""
    if not isinstance(target, DTensor):
        whole = tuple(slice(0, n) for n in shape)
        each_rank(target.data, lambda rank, local: fill_region(whole, local))
        return
    mesh, placements = target.device_mesh, target.placements
    odd = [p for p in placements if not isinstance(p, (Shard, StridedShard, Replicate))]
    if odd:
        raise CheckpointError(
            f"{key} has placement {odd[0]}; only Shard and Replicate parameters can be read "
            "from a full tensor. Fix: keep parameters out of Partial layouts in the plan."
        )

    def fill(rank: int, local: torch.Tensor) -> None:
        coordinate = [int(c) for c in (mesh.mesh == rank).nonzero()[0]]
        per_dim = local_runs(shape, placements, mesh, coordinate)
        for box in itertools.product(*per_dim):
            region = tuple(slice(start, start + n) for _, start, n in box)
            view = local
            for d, (at, _, n) in enumerate(box):
                view = view.narrow(d, at, n)
            fill_region(region, view)

    each_rank(target.to_local(), fill)
