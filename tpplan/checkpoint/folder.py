"""The folder a checkpoint is saved into: tpplan replaces its own files there, and no others.

Used by tpplan/checkpoint/save.py; start at `replace_files`. A save writes the whole new
checkpoint into a staging folder inside the target (`.tpplan-save`), then replaces the
files of tpplan's kinds (`_OURS`: safetensors weights and index, config.json and
generation_config.json, DCP's .metadata and .distcp files) with the new ones and removes
the ones of those kinds the new save did not write. Anything else in the folder (tokenizer
files, a README, train_state.pt, subfolders) is never touched.

A kill at any moment leaves one complete checkpoint that `load_checkpoint` reads (a test in
tests/test_checkpoint.py kills a save at each of its steps in turn):

1. until the staged checkpoint is complete and flushed to disk, the folder's own files
   are the previous checkpoint, unchanged;
2. then a journal (`.tpplan-swap.json`, written whole by one rename) says that the staged
   folder is the checkpoint. While it exists, load_checkpoint reads the staged folder,
   and each of its files is put in place by a hard link plus a rename (a copy where the
   filesystem has no hard links), so the staged folder stays complete while the folder's
   own files are a mix of old and new;
3. removing the journal (one unlink) makes the folder's own files, by then all new, the
   checkpoint again.

The next save to the folder finishes a swap that a kill cut short (its files are the newest
complete checkpoint there) and removes everything else left under a `.tpplan-` name.
Readers other than tpplan see old and new files mixed during step 2 only; the files that
make a set loadable (the index, DCP's .metadata) are put in place last.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

from .safetensors_io import INDEX_NAME, CheckpointError

__all__ = [
    "STAGE",
    "check_replaceable",
    "discard_stage",
    "holds_checkpoint",
    "make_stage",
    "readable_folder",
    "replace_files",
]

_PREFIX = ".tpplan-"  # every name a save leaves behind while it runs starts with this
STAGE = _PREFIX + "save"  # the new checkpoint, written here in full before anything else moves
_JOURNAL = _PREFIX + "swap.json"  # present while the folder's files are being replaced
_JOURNAL_PART = _PREFIX + "swap.part"
# a staged file linked beside its final name, then renamed over it; the suffix keeps a
# leftover out of a loader's glob of *.safetensors
_LINK = _PREFIX + "link-{}.part"

# The names tpplan's saves write (and Hugging Face's save_pretrained, for the same files):
# the only names a save replaces or removes.
_OURS = re.compile(
    r"model\.safetensors|model-\d+-of-\d+\.safetensors|model\.safetensors\.index\.json"
    r"|config\.json|generation_config\.json"
    r"|\.metadata|__\d+_\d+\.distcp|__\d+\.metadata"
)
_CONFIGS = frozenset({"config.json", "generation_config.json"})
_LOADED_BY = frozenset({INDEX_NAME, ".metadata"})  # what makes a set of data files loadable


def _ours(folder: Path) -> set[str]:
    """The files in `folder` with the names tpplan's saves write."""
    return {p.name for p in folder.iterdir() if _OURS.fullmatch(p.name) and p.is_file()}


def holds_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds weights a save wrote (or a swap cut short by a kill)."""
    return folder.is_dir() and (bool(_ours(folder) - _CONFIGS) or (folder / _JOURNAL).is_file())


def check_replaceable(path: Path) -> None:
    """Refuse a path a save must not write into: a file, or a folder whose config.json
    belongs to no checkpoint (a project folder, a typo), which a save would overwrite."""
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointError(
            f"{path} exists and is a file, not a checkpoint folder; fix: pass a folder path."
        )
    configs = sorted(_ours(path) & _CONFIGS)
    if configs and not holds_checkpoint(path):
        raise CheckpointError(
            f"{path} holds {' and '.join(configs)} but no checkpoint weights; saving there "
            "would replace it. Fix: pass a new folder, or one that holds a checkpoint."
        )


def make_stage(path: Path) -> Path:
    """Create `path` if needed, clear what a killed save left there, and return an empty
    staging folder inside it. Run by one rank."""
    path.mkdir(parents=True, exist_ok=True)
    if (path / _JOURNAL).is_file():
        _finish_swap(path)  # a complete checkpoint, newer than the folder's own files
    for entry in path.iterdir():
        if entry.name.startswith(_PREFIX):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    stage = path / STAGE
    stage.mkdir()
    return stage


def discard_stage(path: Path, *, created: bool) -> None:
    """Remove a save's staging folder after a failure (the folder's own files are still the
    previous checkpoint), and `path` itself when this save created it and it is empty."""
    if (path / _JOURNAL).is_file():
        return  # the staged folder is the checkpoint now; the next save finishes the swap
    shutil.rmtree(path / STAGE, ignore_errors=True)
    if created:
        with contextlib.suppress(OSError):  # not empty: someone put files there meanwhile
            path.rmdir()


def replace_files(path: Path) -> None:
    """Put the complete checkpoint staged in `path/.tpplan-save` in place of the folder's
    own checkpoint files, leaving every other file alone (see the module docstring)."""
    stage = path / STAGE
    names = sorted(p.name for p in stage.iterdir())
    for name in names:
        _fsync(stage / name)
    _fsync(stage)
    part = path / _JOURNAL_PART
    part.write_text(json.dumps({"files": names}) + "\n")
    _fsync(part)
    os.replace(part, path / _JOURNAL)  # from here on the staged folder is the checkpoint
    _fsync(path)
    _finish_swap(path)


def readable_folder(path: Path) -> Path:
    """Where the checkpoint saved to `path` is complete: `path`, or its staging folder while a
    save replaces the folder's files (or was killed doing so)."""
    if not (path / _JOURNAL).is_file():
        return path
    _journal_files(path)  # the staged files must all be there
    return path / STAGE


def _finish_swap(path: Path) -> None:
    stage = path / STAGE
    names = _journal_files(path)
    for name in sorted(names, key=lambda n: n in _LOADED_BY):  # the index, .metadata last
        _link_over(stage / name, path / name)
    for name in sorted(_ours(path) - set(names)):  # the previous checkpoint's other files
        (path / name).unlink()
    _fsync(path)
    (path / _JOURNAL).unlink()  # from here on the folder's own files are the checkpoint
    shutil.rmtree(stage)


def _journal_files(path: Path) -> list[str]:
    journal, stage = path / _JOURNAL, path / STAGE
    try:
        names = json.loads(journal.read_text())["files"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise TypeError("'files' is not a list of file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"cannot be read ({type(e).__name__}: {e})"
    else:
        missing = [n for n in names if not (stage / n).is_file()]
        if not missing:
            return names
        problem = f"names files missing from {stage}: {', '.join(missing)}"
    raise CheckpointError(
        f"{journal}, left by a save that was killed while replacing the checkpoint's files, "
        f"{problem}; the folder may hold a mix of two checkpoints. Fix: delete {journal} and "
        f"{stage}, then save the checkpoint again."
    )


def _link_over(src: Path, dst: Path) -> None:
    """Replace `dst` by `src` in one rename, leaving `src` in place."""
    if dst.is_file() and os.path.samefile(src, dst):
        return  # put in place already, before a kill
    tmp = dst.with_name(_LINK.format(dst.name))
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)  # no hard links here (FAT, some network filesystems)
        _fsync(tmp)
    os.replace(tmp, dst)


def _fsync(path: Path) -> None:
    """Flush a file, or a folder's entries, to disk: a rename is only as durable as both."""
    if os.name != "posix":
        return  # a folder cannot be opened for fsync on Windows
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
