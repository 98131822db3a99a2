"""Checkpoints of a sharded model: gather it whole, save it (whole or per rank), load it at any tp size.

Start at `load_checkpoint`, then `save_checkpoint` and `full_state_dict`. Two formats:

- a safetensors model folder (`sharded=False`): what the unsharded world reads, for a
  Hugging Face model a folder `from_pretrained` loads. Rank 0 writes it tensor by tensor
  while every rank takes part in gathering each tensor, so no rank holds the whole model.
  Loading one, each rank reads only the region of each tensor its DTensor placement gives
  it (tpplan/checkpoint/safetensors_io.py does the file work);
- torch.distributed.checkpoint (`sharded=True`): each rank writes its own shards; DCP
  reshards on load, so a checkpoint saved at tp 2 loads at tp 4 or tp 1.

Both are written whole to a staging folder inside the target, then replace only the files a
save writes (tpplan/checkpoint/folder.py): a crash mid-save leaves a complete checkpoint, and
the folder's other files (tokenizer, README) are never touched. Loading checks every key and
shape (and that every file is whole) before the first byte is copied, so a bad checkpoint is
refused with the model untouched. Under `tpplan._runtime.local.simulated_ranks` (every rank in one process)
the safetensors paths work per rank; DCP needs real processes.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .._runtime.local import outside_simulation, rank_values
from .._runtime.tree import local_bytes
from ..compile.strided import local_runs, teach_checkpoint_chunks
from .converted import Unsupported, read_region, shape_of, virtual_tensors
from .folder import (
    STAGE,
    check_replaceable,
    discard_stage,
    holds_checkpoint,
    make_stage,
    readable_folder,
    replace_files,
)
from .safetensors_io import (
    INDEX_NAME,
    CheckpointError,
    StreamingWriter,
    index_folder,
    open_files,
    read_region_into,
    safetensors_files,
)

__all__ = ["CheckpointError", "full_state_dict", "load_checkpoint", "save_checkpoint"]

DEFAULT_MAX_FILE_BYTES = 5 * 2**30  # Hugging Face's own default shard size
_MAX_LISTED = 8  # keys named per kind of mismatch; the count says how many more


# --- gathering ------------------------------------------------------------------------------


def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The state dict the unsharded model would have: original names, full shapes, plain tensors.

    Call it on every rank: each sharded tensor is gathered with one collective, in the same
    order everywhere. With `rank0_only`, ranks other than 0 drop each gathered tensor at
    once and get an empty dict, so only rank 0 ends up holding the whole model.
    """
    keep = not rank0_only or _rank() == 0
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        whole = _gather(t)
        if keep:
            out[name] = whole
    return out


def _gather(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor as a plain tensor (a collective for a DTensor). Under simulated ranks
    every rank's copy is equal after the gather; rank 0's stands for them."""
    return rank_values(t)[0].detach()


# --- saving ---------------------------------------------------------------------------------


def save_checkpoint(
    model: nn.Module,
    path: str | Path,
    *,
    sharded: bool,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> Path:
    """Save `model` (sharded by apply_plan, or not) to the folder `path`; call on every rank.

    sharded=False: a safetensors folder (model.safetensors, or several files and
    model.safetensors.index.json past `max_file_bytes`), plus config.json for a Hugging Face
    model, so `from_pretrained(path)` loads it. Only rank 0 writes.
    sharded=True: a torch.distributed.checkpoint folder, each rank writing its own shards
    (on more than one node, `path` must be on a filesystem every rank sees).

    The save replaces only the files it writes (and removes the previous checkpoint's files
    of those kinds that it does not write, such as a third weight file of a save that needed
    three, or a DCP .metadata when saving safetensors); every other file in the folder is
    left alone. The new checkpoint is written whole into `path/.tpplan-save` first. A crash
    at any moment leaves a complete checkpoint, the previous one or the new one, that
    load_checkpoint reads; the next save to `path` finishes or removes what a killed save
    left there. A folder that holds a config.json but no weights is refused: its config
    may be someone's own.
    """
    path = Path(path)
    if sharded and _simulated():
        raise CheckpointError(
            "sharded=True writes with torch.distributed.checkpoint, which needs real processes; "
            "under simulated ranks save with sharded=False, or run under torchrun."
        )
    check_replaceable(path)  # on every rank: a refusal must not leave the others waiting
    created = not path.exists()
    # Every step that can fail on one rank is followed by _agree_on_failure, so all ranks
    # raise together and none waits in a collective that another rank never reaches.
    failure: BaseException | None = None
    if _rank() == 0:
        try:
            make_stage(path)
        except Exception as e:
            failure = e
    failure = _agree_on_failure(failure)
    stage = path / STAGE
    if failure is None:
        try:
            if sharded:
                _save_dcp(model, stage)
            else:
                failure = _save_safetensors(model, stage, max_file_bytes=max_file_bytes)
            if failure is None and _rank() == 0:
                _save_config(model, stage)
        except BaseException as e:  # DCP's CheckpointException is not an Exception
            failure = e
        failure = _agree_on_failure(failure)
        if _rank() == 0 and failure is None:
            try:
                replace_files(path)
            except Exception as e:
                failure = e
        failure = _agree_on_failure(failure)
    if _rank() == 0 and failure is not None:
        discard_stage(path, created=created)
    # all_gather_object's last send may still be in flight when a rank returns; a process
    # that then tears down its group aborts gloo, so end on a barrier
    _barrier()
    if isinstance(failure, (KeyboardInterrupt, SystemExit)):
        raise failure
    if failure is not None:
        raise CheckpointError(
            f"saving to {path} failed ({_cause(failure)}); "
            + _left_behind(path)
            + "Fix: see the cause above (disk space, permissions), then save again."
        ) from failure
    return path


def _left_behind(path: Path) -> str:
    """What a failed save left at `path`, for its error message."""
    try:
        staged = readable_folder(path) != path
    except CheckpointError as e:  # a journal from an earlier killed save that is unreadable
        return f"{e} "
    if staged:
        return (
            f"the new checkpoint is complete in {path / STAGE}, which load_checkpoint reads "
            f"until the next save to {path} puts its files in place. "
        )
    return "the previous checkpoint there is unchanged. " if holds_checkpoint(path) else ""


def _save_safetensors(
    model: nn.Module, folder: Path, *, max_file_bytes: int
) -> BaseException | None:
    """Gather tensor by tensor on every rank; rank 0 appends each to its file and drops it.

    A failure on rank 0 must not leave the others waiting in a gather, so rank 0 records the
    first error, keeps taking part in the gathers without writing, and returns it.
    """
    sd = model.state_dict(keep_vars=True)
    files = _plan_files([(n, t.dtype, tuple(t.shape)) for n, t in sd.items()], max_file_bytes)
    writing = _rank() == 0
    failure: BaseException | None = None
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    weight_map: dict[str, str] = {}
    for file_name, entries in files:
        writer = None
        if writing and failure is None:
            try:
                writer = StreamingWriter(folder / file_name, entries, metadata=metadata)
            except Exception as e:
                failure = e
        for name, _, _ in entries:
            whole = _gather(sd[name])
            if writer is None:
                continue
            try:
                with outside_simulation():  # file work once, not once per simulated rank
                    writer.write(name, whole)
                weight_map[name] = file_name
            except Exception as e:
                writer.abort()
                failure, writer = e, None
            del whole
        if writer is not None:
            try:
                writer.close()
            except Exception as e:
                failure = e
    if writing and failure is None and len(files) > 1:
        total = sum(t.dtype.itemsize * t.numel() for t in sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return failure


def _plan_files(
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]], max_file_bytes: int
) -> list[tuple[str, list[tuple[str, torch.dtype, tuple[int, ...]]]]]:
    """Entries split into files of at most `max_file_bytes` (a bigger tensor gets its own),
    named as Hugging Face names them."""
    groups: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for entry in entries:
        n = entry[1].itemsize * _numel(entry[2])
        if groups[-1] and size + n > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += n
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    k = len(groups)
    return [(f"model-{i + 1:05d}-of-{k:05d}.safetensors", g) for i, g in enumerate(groups)]


def _save_dcp(model: nn.Module, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    teach_checkpoint_chunks()  # a fused layer's rank holds one chunk per piece
    state = _dcp_state(model)
    # DCP reads each stored chunk whole before cutting a rank's region out of it, so the
    # biggest chunk is what a load holds beside the rank's share: chunks of 1/128 of a
    # share (within bounds) keep that under 1%. The same on every rank (from global sizes).
    world = dist.get_world_size() if dist.is_initialized() else 1
    share = sum(t.dtype.itemsize * t.numel() for t in state.values()) // world
    chunk = min(max(share // 128, _DCP_CHUNK_BYTES[0]), _DCP_CHUNK_BYTES[1])
    with _single_process_is_meant():
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(folder),
            planner=_small_chunks_planner(chunk),
            no_dist=not dist.is_initialized(),
        )


_DCP_CHUNK_BYTES = (2**20, 64 * 2**20)  # bounds on the bytes of one stored chunk


def _small_chunks_planner(max_bytes: int) -> Any:
    """DCP's default save planner, with each tensor shard cut along dim 0 into chunks of at
    most `max_bytes` (a loader at any tp reads the chunks its region overlaps)."""
    import dataclasses

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


# How tpplan stored fused layers in DCP before their parameters were `_StridedShard`s: one
# tensor per piece, `NAME.tpplan_part0`, ... Still read, never written.
_PART = ".tpplan_part"


def _dcp_state(
    model: nn.Module, stored: dict[str, tuple[int, ...]] | None = None
) -> dict[str, Any]:
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
        strided = isinstance(t, DTensor) and isinstance(t.placements[-1], _StridedShard)
        if not strided or t.device_mesh.ndim != 1:
            raise CheckpointError(
                f"{name} is stored by pieces ({name}{_PART}0, ...), as earlier tpplan versions "
                "wrote fused layers, but this model does not split it into equal pieces on a "
                "1-D mesh. "
                "Fix: load that checkpoint with the plan it was saved with and save it again "
                "(sharded=False writes the unsharded layout)."
            )
        placement = t.placements[0]
        assert isinstance(placement, _StridedShard)  # checked above
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


def _save_config(model: nn.Module, folder: Path) -> None:
    """config.json (and generation_config.json) for Hugging Face models: from_pretrained
    needs the config to build the model before it reads a single weight."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate():
        generation.save_pretrained(folder)


def _agree_on_failure(failure: BaseException | None) -> BaseException | None:
    """Every rank learns whether any rank failed, so all of them raise (none hangs)."""
    if not dist.is_initialized() or _simulated() or dist.get_world_size() == 1:
        return failure
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, None if failure is None else _cause(failure))
    if failure is not None:
        return failure
    for rank, text in enumerate(flags):
        if text is not None:
            return CheckpointError(f"saving failed on rank {rank}: {text}")
    return None


# --- loading --------------------------------------------------------------------------------


def load_checkpoint(model: nn.Module, path: str | Path, *, rebuild_buffers: bool = True) -> None:
    """Load a checkpoint folder into `model`, sharded by apply_plan at any tp size, or not.

    `path` is a torch.distributed.checkpoint folder or a safetensors model folder (one
    written by save_checkpoint(sharded=False) or save_pretrained). Call on every rank. The
    intended use is a model built on the meta device, sharded, then materialized with
    `model.to_empty(device=...)`: from safetensors each rank reads only its own regions;
    DCP reshards by itself. Every key, shape and file is checked first; on a mismatch a
    CheckpointError names the keys (or the file) and nothing is loaded.

    Non-persistent buffers (rotary `inv_freq` and the like) are in no checkpoint, and after
    `to_empty` they hold garbage; with `rebuild_buffers` they are recomputed (see
    `_rebuild_buffers`).

    A folder whose save was killed while replacing its files is read from the complete new
    checkpoint staged inside it, with a warning.
    """
    path = _readable(Path(path))
    sd = model.state_dict(keep_vars=True)
    _check_materialized(sd)
    if (path / ".metadata").is_file():
        if _simulated():
            raise CheckpointError(
                f"{path} is a torch.distributed.checkpoint folder; loading one needs real "
                "processes (torchrun). Under simulated ranks load a safetensors folder."
            )
        loader = _load_dcp(model, sd, path)
    else:
        loader = _load_safetensors(model, sd, path)
    with torch.no_grad():
        next(loader)  # everything checked; nothing copied yet
        if rebuild_buffers:
            _rebuild_buffers(model)
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


def _check_materialized(sd: dict[str, torch.Tensor]) -> None:
    on_meta = [n for n, t in sd.items() if t.device.type == "meta"]
    if on_meta:
        raise CheckpointError(
            f"the model is still on the meta device ({_names(on_meta)}), so there is nowhere to "
            "load into; fix: call model.to_empty(device='cpu') (or 'cuda') after apply_plan "
            "and before load_checkpoint."
        )


def _aliases(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """{key: other keys holding the same tensor}: tied weights are saved once by
    save_pretrained, so any one of them satisfies the others."""
    by_id: dict[int, list[str]] = {}
    for n, t in sd.items():
        by_id.setdefault(id(t), []).append(n)
    out = {n: [m for m in by_id[id(t)] if m != n] for n, t in sd.items()}
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # transformers: {tied: source}
    for target, source in dict(tied).items():
        if target in out and source in sd:
            out[target].append(source)
    return out


def _ignored_unexpected(model: nn.Module) -> list[re.Pattern[str]]:
    """Keys a Hugging Face model says old checkpoints may carry and it does not need."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    return [re.compile(p) for p in patterns]


def _match_keys(
    model: nn.Module, sd: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], path: Path
) -> dict[str, str]:
    """{model key: checkpoint key}, or a CheckpointError naming every mismatch at once."""
    aliases = _aliases(model, sd)
    source: dict[str, str] = {}
    missing = []
    for key in sd:
        found = next((k for k in [key, *aliases[key]] if k in shapes), None)
        if found is None:
            missing.append(key)
        else:
            source[key] = found
    ignored = _ignored_unexpected(model)
    unexpected = [k for k in shapes if k not in sd and not any(p.search(k) for p in ignored)]
    mismatched = [
        f"{k} is {_shape(shapes[src])} in the checkpoint but {_shape(tuple(sd[k].shape))} in "
        "the model"
        for k, src in source.items()
        if shapes[src] != tuple(sd[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"{_count(missing, 'key')} missing from the checkpoint: {_names(missing)}")
    if unexpected:
        problems.append(
            f"{_count(unexpected, 'key')} in the checkpoint but not in the model: "
            f"{_names(unexpected)}"
        )
    if mismatched:
        problems.append(f"{_count(mismatched, 'shape')} differ: {_names(mismatched)}")
    if problems:
        raise CheckpointError(
            f"{path} does not fit this {type(model).__name__}: "
            + "; ".join(problems)
            + ". Nothing was loaded. Fix: load a checkpoint saved from a model with the same "
            "config (layer count, widths, vocab), or build the model from the checkpoint's "
            "config.json."
        )
    return source


def _load_safetensors(model: nn.Module, sd: dict[str, torch.Tensor], path: Path) -> Iterator[None]:
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
        source = _match_keys(model, sd, listed, path)
        yield
        total = sum(t.dtype.itemsize * t.numel() for t in sd.values())

        def read(key: str, region: tuple[slice, ...], out: torch.Tensor) -> None:
            read_region_into(fds[index[key].file], index[key], region, out)

        with _Progress(total, f"loading {path.name}") as progress:
            for key, target in sd.items():
                node = virtual.get(source[key], source[key])
                fill = partial(read_region, node, read=read, shapes=shapes)
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
        _each_rank(target.data, lambda rank, local: fill_region(whole, local))
        return
    mesh, placements = target.device_mesh, target.placements
    odd = [p for p in placements if not isinstance(p, (Shard, _StridedShard, Replicate))]
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

    _each_rank(target.to_local(), fill)


def _load_dcp(model: nn.Module, sd: dict[str, torch.Tensor], path: Path) -> Iterator[None]:
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
    state = _dcp_state(model, shapes)
    _match_keys(model, state, shapes, path)
    _check_dcp_files(path, metadata)
    yield
    no_dist = not dist.is_initialized()
    total = sum(t.dtype.itemsize * t.numel() for t in state.values())
    local = sum(local_bytes(t) for t in state.values())
    with _Progress(total, f"loading {path.name}") as progress:
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
                    f"reading {path} failed after the checks passed ({_cause(e)}); "
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


# --- non-persistent buffers -----------------------------------------------------------------


def _rebuild_buffers(model: nn.Module) -> None:
    """Recompute every non-persistent buffer, which no checkpoint holds.

    The choice: ask the model. A Hugging Face model's `_init_weights(module)` is how
    transformers itself fills these buffers after building on the meta device (rotary
    embeddings recompute `inv_freq` from the config), so it is called on each module that
    owns such a buffer, by the nearest enclosing model that has it. Each buffer is first
    replaced by NaNs, so one the model did not recompute is caught rather than left
    holding whatever `to_empty` found in memory. Those modules are small and replicated
    (parallelize_module shards parameters, never buffers), so this runs as plain tensors on
    every rank. A model with no such method gets an error naming the buffers.
    """
    modules = dict(model.named_modules())
    owners = []
    for name, module in modules.items():
        owned = sorted(b for b in module._non_persistent_buffers_set if b in module._buffers)
        owned = [b for b in owned if module._buffers[b] is not None]
        if owned:
            owners.append((name, module, owned, _init_owner(modules, name)))
    orphans = [f"{n}.{b}" if n else b for n, _, owned, o in owners if o is None for b in owned]
    if orphans:
        raise CheckpointError(
            f"non-persistent buffers {_names(orphans)} are in no checkpoint and the model has "
            "no _init_weights to recompute them; nothing was loaded. Fix: pass "
            "rebuild_buffers=False and set them after load_checkpoint (or build that module "
            "off the meta device)."
        )
    not_rebuilt: list[str] = []
    with outside_simulation():
        for name, module, owned, owner in owners:
            old = {b: module.get_buffer(b) for b in owned}
            for b, t in old.items():
                fill = float("nan") if t.is_floating_point() else 0
                module._buffers[b] = torch.full(
                    tuple(t.shape), fill, dtype=t.dtype, device=t.device
                )
            owner._init_weights(module)
            missed = [
                b
                for b in owned
                if (t := module.get_buffer(b)).is_floating_point() and t.isnan().any()
            ]
            if missed:
                module._buffers.update(old)  # leave them as they were
                not_rebuilt += [f"{name}.{b}" if name else b for b in missed]
    if not_rebuilt:
        raise CheckpointError(
            f"non-persistent buffers {_names(not_rebuilt)} are in no checkpoint and the model's "
            "_init_weights did not recompute them; nothing was loaded. Fix: pass "
            "rebuild_buffers=False and set them after load_checkpoint."
        )


def _init_owner(modules: dict[str, nn.Module], name: str) -> Any:
    """The innermost enclosing module (itself included) with Hugging Face's `_init_weights`."""
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        candidate = modules.get(".".join(parts[:i]))
        if candidate is not None and callable(getattr(candidate, "_init_weights", None)):
            return candidate
    return None


# --- ranks: real processes and simulated ones -----------------------------------------------
# The simulation is torch's private LocalTensorMode (see tpplan/_runtime/local.py); these three
# helpers are the only code here that knows about it.


def _simulated() -> bool:
    from torch.distributed._local_tensor import local_tensor_mode

    return local_tensor_mode() is not None


def _each_rank(local: torch.Tensor, fill: Callable[[int, torch.Tensor], None]) -> None:
    """fill(rank, that rank's local tensor) for this process's rank, or for every simulated
    rank when `local` holds one value per rank."""
    from torch.distributed._local_tensor import LocalTensor, local_tensor_mode

    mode = local_tensor_mode()
    if mode is not None and isinstance(local, LocalTensor):
        with mode.disable():
            for rank, value in sorted(local._local_tensors.items()):
                fill(rank, value)
        return
    with outside_simulation():
        fill(_rank(), local)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and not _simulated() and dist.get_world_size() > 1:
        dist.barrier()


# --- small things ---------------------------------------------------------------------------


class _Progress:
    """A one-line progress bar on stderr, from rank 0, only when stderr is a terminal."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = max(total, 1), label, 0
        self.on = _rank() == 0 and sys.stderr.isatty()
        self._last = 0.0

    def __enter__(self) -> _Progress:
        return self

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.on and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            sys.stderr.write(
                f"\r{self.label} [{bar:<30}] {frac:4.0%} "
                f"{self.done / 2**20:,.0f}/{self.total / 2**20:,.0f} MiB"
            )
            sys.stderr.flush()

    def __exit__(self, *exc: object) -> None:
        if self.on:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _cause(e: BaseException) -> str:
    """One line for an error; DCP's CheckpointException carries each rank's error with its
    whole traceback, of which the first error itself is what a reader needs."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _) = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(e).__name__}: {e}"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _count(items: list[str], noun: str) -> str:
    return f"{len(items)} {noun}{'s' if len(items) != 1 else ''}"


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return shown + (f" (and {more} more)" if more > 0 else "")
