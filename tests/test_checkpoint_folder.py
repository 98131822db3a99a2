"""The folder a checkpoint is saved into, on its own: staging, the journal, the swap.

No model and no tensors: the files are a few bytes each, named as a save names them
(tpplan/checkpoint/folder.py says which names are tpplan's). What a kill at each step of a
real save leaves is tested in tests/test_checkpoint.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tpplan.checkpoint.folder import (
    STAGE,
    check_replaceable,
    discard_stage,
    holds_checkpoint,
    make_stage,
    readable_folder,
    replace_files,
)
from tpplan.checkpoint.safetensors_io import CheckpointError

pytestmark = pytest.mark.unit

JOURNAL = ".tpplan-swap.json"


def _files(folder: Path, **files: str) -> Path:
    """`folder`, made if needed, holding one small text file per name given."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def _listing(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize(
    ("names", "holds"),
    [
        ([], False),
        (["config.json"], False),  # a config alone is no checkpoint
        (["README.md", "tokenizer.json"], False),
        (["model.safetensors"], True),
        (["model-00001-of-00002.safetensors"], True),
        ([".metadata", "__0_0.distcp"], True),
        ([JOURNAL], True),  # a swap cut short by a kill
    ],
)
def test_holds_checkpoint(tmp_path: Path, names: list[str], holds: bool) -> None:
    _files(tmp_path, **dict.fromkeys(names, "x"))
    assert holds_checkpoint(tmp_path) is holds


def test_a_missing_folder_holds_no_checkpoint(tmp_path: Path) -> None:
    assert holds_checkpoint(tmp_path / "nothing") is False


def test_a_new_folder_and_a_checkpoint_folder_are_replaceable(tmp_path: Path) -> None:
    check_replaceable(tmp_path / "new")
    check_replaceable(_files(tmp_path / "old", **{"model.safetensors": "w", "config.json": "c"}))


def test_a_file_is_not_replaceable(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("x")
    with pytest.raises(CheckpointError) as e:
        check_replaceable(path)
    assert str(e.value) == (
        f"{path} exists and is a file, not a checkpoint folder; fix: pass a folder path."
    )


def test_a_config_that_belongs_to_no_checkpoint_is_not_replaced(tmp_path: Path) -> None:
    _files(tmp_path, **{"config.json": "{}", "generation_config.json": "{}"})
    with pytest.raises(CheckpointError) as e:
        check_replaceable(tmp_path)
    assert str(e.value) == (
        f"{tmp_path} holds config.json and generation_config.json but no checkpoint weights; "
        "saving there would replace it. Fix: pass a new folder, or one that holds a checkpoint."
    )


def test_make_stage_creates_the_folder_and_an_empty_stage(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b"
    stage = make_stage(path)
    assert stage == path / STAGE and stage.is_dir() and not any(stage.iterdir())


def test_make_stage_clears_what_a_killed_save_left(tmp_path: Path) -> None:
    _files(tmp_path, **{"model.safetensors": "old", ".tpplan-link-x.part": "leftover"})
    _files(tmp_path / STAGE, **{"model.safetensors": "half"})
    make_stage(tmp_path)
    assert _listing(tmp_path) == {"model.safetensors": "old"}
    assert not any((tmp_path / STAGE).iterdir())


def test_replace_files_swaps_only_the_checkpoints_files(tmp_path: Path) -> None:
    _files(
        tmp_path,
        **{
            "model-00001-of-00002.safetensors": "old1",
            "model-00002-of-00002.safetensors": "old2",
            "model.safetensors.index.json": "old index",
            "config.json": "old config",
            "tokenizer.json": "mine",
        },
    )
    stage = make_stage(tmp_path)
    _files(stage, **{"model.safetensors": "new", "config.json": "new config"})
    replace_files(tmp_path)
    assert _listing(tmp_path) == {
        "config.json": "new config",
        "model.safetensors": "new",
        "tokenizer.json": "mine",
    }
    assert not (tmp_path / STAGE).exists() and not (tmp_path / JOURNAL).exists()


def test_a_folder_is_readable_in_place_without_a_journal(tmp_path: Path) -> None:
    assert readable_folder(tmp_path) == tmp_path


def test_a_journal_points_readers_at_the_stage(tmp_path: Path) -> None:
    _files(tmp_path, **{"model.safetensors": "old"})
    _files(tmp_path / STAGE, **{"model.safetensors": "new"})
    (tmp_path / JOURNAL).write_text(json.dumps({"files": ["model.safetensors"]}))
    assert readable_folder(tmp_path) == tmp_path / STAGE


def test_the_next_save_finishes_a_swap_a_kill_cut_short(tmp_path: Path) -> None:
    _files(tmp_path, **{"model.safetensors": "old", "config.json": "old"})
    _files(tmp_path / STAGE, **{"model.safetensors": "new"})
    (tmp_path / JOURNAL).write_text(json.dumps({"files": ["model.safetensors"]}))
    make_stage(tmp_path)
    assert _listing(tmp_path) == {"model.safetensors": "new"}  # the staged set, whole


@pytest.mark.parametrize(
    ("journal", "problem"),
    [
        ("not json", "cannot be read (JSONDecodeError: "),
        ('{"names": []}', "cannot be read (KeyError: 'files')"),
        ('{"files": "model.safetensors"}', "cannot be read (TypeError: 'files' is not a list"),
        ('{"files": ["model.safetensors"]}', "names files missing from "),
    ],
    ids=["not json", "no files key", "files not a list", "a file missing"],
)
def test_a_journal_that_cannot_be_trusted_is_named(
    tmp_path: Path, journal: str, problem: str
) -> None:
    (tmp_path / STAGE).mkdir()
    (tmp_path / JOURNAL).write_text(journal)
    with pytest.raises(CheckpointError) as e:
        readable_folder(tmp_path)
    message = str(e.value)
    assert message.startswith(
        f"{tmp_path / JOURNAL}, left by a save that was killed while replacing the "
        f"checkpoint's files, {problem}"
    )
    assert message.endswith(
        f"the folder may hold a mix of two checkpoints. Fix: delete {tmp_path / JOURNAL} and "
        f"{tmp_path / STAGE}, then save the checkpoint again."
    )


def test_discard_stage_removes_the_stage_and_a_folder_it_created(tmp_path: Path) -> None:
    path = tmp_path / "new"
    make_stage(path)
    discard_stage(path, created=True)
    assert not path.exists()


def test_discard_stage_keeps_a_folder_that_was_there(tmp_path: Path) -> None:
    _files(tmp_path, **{"model.safetensors": "old"})
    make_stage(tmp_path)
    discard_stage(tmp_path, created=False)
    assert _listing(tmp_path) == {"model.safetensors": "old"}
    assert not (tmp_path / STAGE).exists()


def test_discard_stage_keeps_a_stage_a_journal_names(tmp_path: Path) -> None:
    """Once the journal exists the staged folder is the checkpoint; only a save removes it."""
    stage = make_stage(tmp_path)
    (stage / "model.safetensors").write_text("new")
    (tmp_path / JOURNAL).write_text(json.dumps({"files": ["model.safetensors"]}))
    discard_stage(tmp_path, created=True)
    assert (stage / "model.safetensors").read_text() == "new"
