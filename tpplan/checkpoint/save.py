"""Saving a sharded model: gathered whole (safetensors) or each rank its own shards (DCP).

Start at `save_checkpoint`. `full_state_dict` is tpplan/_runtime/gather.py's, exported
here too: apply/saving.py gathers with the same module. A safetensors save (`sharded=False`) is
what the unsharded world reads, for a Hugging Face model a folder `from_pretrained` loads:
rank 0 writes it tensor by tensor while every rank takes part in gathering each tensor, so
no rank holds the whole model. A DCP save (`sharded=True`) is tpplan/checkpoint/dcp.py.

Both are written whole to a staging folder inside the target, then replace only the files a
save writes (tpplan/checkpoint/folder.py): a crash mid-save leaves a complete checkpoint, and
the folder's other files (tokenizer, README) are never touched. Every step that can fail on
one rank is followed by `agree_on_failure` (tpplan/_runtime/ranks.py), so all ranks raise
together and none hangs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from torch import nn

from .._runtime.gather import full_state_dict, whole_tensor
from .._runtime.local import outside_simulation
from .._runtime.ranks import agree_on_failure, barrier, cause, rank, simulated
from .dcp import save_dcp
from .folder import (
    STAGE,
    check_replaceable,
    discard_stage,
    holds_checkpoint,
    make_stage,
    readable_folder,
    replace_files,
)
from .safetensors_io import INDEX_NAME, CheckpointError, StreamingWriter

__all__ = ["DEFAULT_MAX_FILE_BYTES", "full_state_dict", "save_checkpoint", "split_into_files"]

DEFAULT_MAX_FILE_BYTES = (
    5 * 2**30
)  # 5 GiB (huggingface_hub's default is 5 GB, save_pretrained's 50 GB)

Entries = list[tuple[str, torch.dtype, tuple[int, ...]]]
"""Tensors of a file to write, in order: (name, dtype, shape)."""


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
    if sharded and simulated():
        raise CheckpointError(
            "sharded=True writes with torch.distributed.checkpoint, which needs real processes; "
            "under simulated ranks save with sharded=False, or run under torchrun."
        )
    check_replaceable(path)  # on every rank: a refusal must not leave the others waiting
    created = not path.exists()
    # Every step that can fail on one rank is followed by agree_on_failure, so all ranks
    # raise together and none waits in a collective that another rank never reaches.
    failure: BaseException | None = None
    if rank() == 0:
        try:
            make_stage(path)
        except Exception as e:
            failure = e
    failure = agree_on_failure(failure)
    stage = path / STAGE
    if failure is None:
        try:
            if sharded:
                save_dcp(model, stage)
            else:
                failure = _save_safetensors(model, stage, max_file_bytes=max_file_bytes)
            if failure is None and rank() == 0:
                _save_config(model, stage)
        except BaseException as e:  # DCP's CheckpointException is not an Exception
            failure = e
        failure = agree_on_failure(failure)
        if rank() == 0 and failure is None:
            try:
                replace_files(path)
            except Exception as e:
                failure = e
        failure = agree_on_failure(failure)
    if rank() == 0 and failure is not None:
        discard_stage(path, created=created)
    # all_gather_object's last send may still be in flight when a rank returns; a process
    # that then tears down its group aborts gloo, so end on a barrier
    barrier()
    if isinstance(failure, (KeyboardInterrupt, SystemExit)):
        raise failure
    if failure is not None:
        raise CheckpointError(
            f"saving to {path} failed ({cause(failure)}); "
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
    files = split_into_files([(n, t.dtype, tuple(t.shape)) for n, t in sd.items()], max_file_bytes)
    writing = rank() == 0
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
            whole = whole_tensor(sd[name])
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


def split_into_files(entries: Entries, max_file_bytes: int) -> list[tuple[str, Entries]]:
    """Entries split into files of at most `max_file_bytes` (a bigger tensor gets its own),
    in order, named as Hugging Face names them: huggingface_hub's own splitter, given sizes
    from dtypes and shapes, since no tensor of a sharded model is whole on one rank."""
    by_name = {entry[0]: entry for entry in entries}
    split = split_state_dict_into_shards_factory(
        by_name,
        get_storage_size=lambda e: e[1].itemsize * math.prod(e[2]),
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_file_bytes,
    )
    return [(f, [by_name[n] for n in names]) for f, names in split.filename_to_tensors.items()]


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
