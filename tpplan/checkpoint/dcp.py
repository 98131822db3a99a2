"""Sharded checkpoints with torch.distributed.checkpoint (DCP): each rank writes its own
shards, and DCP reshards on load, so a checkpoint saved at tp 2 loads at tp 4 or tp 1.

Start at `save_dcp` and `load_dcp`. What tpplan adds to DCP: the state it saves is the
model's own, every parameter in the unsharded model's layout (`dcp_state`); shards are
stored in small chunks so a load at another tp size holds little beside its own share
(`_small_chunks_planner`); fused layers that earlier tpplan versions stored per piece are
still read; and every key, shape and data file is checked before the first byte is loaded.
DCP needs real processes: under simulated ranks the callers refuse it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .._runtime.ranks import cause
from .._runtime.torch_compat import StridedShard
from .._runtime.tree import local_bytes
from ..compile.strided import teach_checkpoint_chunks
from .keys import match_keys
from .progress import Progress
from .safetensors_io import CheckpointError

__all__ = ["CHUNK_BYTES", "dcp_state", "load_dcp", "save_dcp"]

CHUNK_BYTES = (2**20, 64 * 2**20)  # bounds on the bytes of one stored chunk


# --- saving ---------------------------------------------------------------------------------


def save_dcp(model: nn.Module, folder: Path) -> None:
    """Write `model`'s state to `folder` as DCP, each rank its own shards; call on every rank."""
    import torch.distributed.checkpoint as dcp

    teach_checkpoint_chunks()  # a fused layer's rank holds one chunk per piece
    state = dcp_state(model)
    # DCP reads each stored chunk whole before cutting a rank's region out of it, so the
    # biggest chunk is what a load holds beside the rank's share: chunks of 1/128 of a
    # share (within bounds) keep that under 1%. The same on every rank (from global sizes).
    world = dist.get_world_size() if dist.is_initialized() else 1
    share = sum(t.dtype.itemsize * t.numel() for t in state.values()) // world
    chunk = min(max(share // 128, CHUNK_BYTES[0]), CHUNK_BYTES[1])
    with _single_process_is_meant():
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(folder),
            planner=_small_chunks_planner(chunk),
            no_dist=not dist.is_initialized(),
        )


def _small_chunks_planner(max_bytes: int) -> Any:
    """DCP's default save planner, with each tensor shard cut along dim 0 into chunks of at
    most `max_bytes` (a loader at any tp reads the chunks its region overlaps)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItemType

    class Planner(DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            # -> (the item the cut chunk belongs to, first row in that chunk, rows)
            self.cuts: dict[MetadataIndex, tuple[Any, int, int]] = {}
            items = []
            for item in plan.items:
                data = item.tensor_data
                if item.type == WriteItemType.BYTE_IO or data is None or not data.chunk.sizes:
                    items.append(item)
                    continue
                sizes, offsets = list(data.chunk.sizes), list(data.chunk.offsets)
                row = math.prod(sizes[1:]) * data.properties.dtype.itemsize
                step = max(1, max_bytes // max(row, 1))
                if sizes[0] <= step:
                    items.append(item)
                    continue
                for start in range(0, sizes[0], step):
                    n = min(step, sizes[0] - start)
                    at = [offsets[0] + start, *offsets[1:]]
                    index = MetadataIndex(item.index.fqn, at)
                    chunk = ChunkStorageMetadata(torch.Size(at), torch.Size([n, *sizes[1:]]))
                    self.cuts[index] = (item, start, n)
                    # a whole tensor cut so is stored as shards of itself (one entry with
                    # several chunks, which a tensor item cannot be)
                    items.append(
                        dataclasses.replace(
                            item,
                            index=index,
                            type=WriteItemType.SHARD,
                            tensor_data=dataclasses.replace(data, chunk=chunk),
                        )
                    )
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def resolve_data(self, write_item: Any) -> Any:
            cut = self.cuts.get(write_item.index)
            if cut is None:
                return super().resolve_data(write_item)
            whole, start, n = cut
            data = super().resolve_data(whole)
            assert isinstance(data, torch.Tensor)  # only tensor items are cut
            return data.narrow(0, start, n)

    return Planner()


# --- the state DCP sees ---------------------------------------------------------------------

# How tpplan stored fused layers in DCP before their parameters were `_StridedShard`s: one
# tensor per piece, `NAME.tpplan_part0`, ... Still read, never written.
_PART = ".tpplan_part"


def dcp_state(model: nn.Module, stored: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """The state dict DCP saves and loads: the model's own, every parameter in the unsharded
    model's layout (what torch's `get_model_state_dict` gives too). Loading, `stored` (the
    checkpoint's keys and shapes) may name a fused layer by pieces (`_PART`); those are read
    into views of the parameter's slices of each piece."""
    state: dict[str, Any] = dict(model.state_dict())
    if stored is None:
        return state
    for name in list(state):
        if name in stored or f"{name}{_PART}0" not in stored:
            continue
        t = state[name]
        strided = isinstance(t, DTensor) and isinstance(t.placements[-1], StridedShard)
        if not strided or t.device_mesh.ndim != 1:
            raise CheckpointError(
                f"{name} is stored by pieces ({name}{_PART}0, ...), as earlier tpplan versions "
                "wrote fused layers, but this model does not split it into equal pieces on a "
                "1-D mesh. "
                "Fix: load that checkpoint with the plan it was saved with and save it again "
                "(sharded=False writes the unsharded layout)."
            )
        placement = t.placements[0]
        assert isinstance(placement, StridedShard)  # checked above
        dim, pieces = placement.dim, int(placement.split_factor)
        local, mesh = t.to_local(), t.device_mesh
        step = local.shape[dim] // pieces
        shape = list(t.shape)
        shape[dim] //= pieces
        stride = torch.empty(shape, device="meta").stride()
        del state[name]
        for i in range(pieces):
            state[f"{name}{_PART}{i}"] = DTensor.from_local(
                local.narrow(dim, i * step, step),
                mesh,
                [Shard(dim)],
                run_check=False,
                shape=torch.Size(shape),
                stride=stride,
            )
    return state


@contextmanager
def _single_process_is_meant() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists, even when told
    so with no_dist=True; an unsharded model at tp 1 is exactly that case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


# --- loading --------------------------------------------------------------------------------


def load_dcp(model: nn.Module, sd: dict[str, torch.Tensor], path: Path) -> Iterator[None]:
    """Load the DCP folder `path` into `model` (whose state dict is `sd`), as a generator:
    the first step checks every key, shape and data file and copies nothing; each later
    step loads one batch of tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"{path / '.metadata'} is truncated or corrupt ({type(e).__name__}: {e}); nothing "
            "was loaded. Fix: save or copy that checkpoint again."
        ) from None
    shapes = {
        k: tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    teach_checkpoint_chunks()
    state = dcp_state(model, shapes)
    match_keys(model, state, shapes, path)
    _check_dcp_files(path, metadata)
    yield
    no_dist = not dist.is_initialized()
    total = sum(t.dtype.itemsize * t.numel() for t in state.values())
    local = sum(local_bytes(t) for t in state.values())
    with Progress(total, f"loading {path.name}") as progress:
        # DCP reads every stored chunk a batch needs whole before cutting out this rank's
        # region: small batches keep that transient a small part of the rank's share
        for batch in _batches(state, local // 64 + 1):
            try:
                with _single_process_is_meant():
                    dcp.load(batch, storage_reader=dcp.FileSystemReader(path), no_dist=no_dist)
            except BaseException as e:  # DCP's CheckpointException is not an Exception
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                raise CheckpointError(
                    f"reading {path} failed after the checks passed ({cause(e)}); "
                    "the model is partly loaded. Fix: check the disk and load again."
                ) from None
            progress.advance(sum(t.dtype.itemsize * t.numel() for t in batch.values()))
            yield


def _check_dcp_files(path: Path, metadata: Any) -> None:
    """Every data file must exist and reach the end of every item stored in it; DCP itself
    would find a short file only halfway through loading."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for name, end in sorted(need.items()):
        f = path / name
        size = f.stat().st_size if f.is_file() else -1
        if size < end:
            what = "is missing" if size < 0 else f"is truncated ({size} bytes, needs {end})"
            raise CheckpointError(
                f"{f} {what}; nothing was loaded. Fix: save or copy that checkpoint again."
            )


def _batches(state: dict[str, torch.Tensor], nbytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of about `nbytes` of this rank's own bytes each."""
    batch: dict[str, torch.Tensor] = {}
    size = 0
    for k, t in state.items():
        batch[k] = t
        size += local_bytes(t)
        if size >= nbytes:
            yield batch
            batch, size = {}, 0
    if batch:
        yield batch
