"""Checkpoints: gather, save whole or sharded, load at another tp size, refuse bad files.

Most tests run every rank in this process (simulated_ranks, LocalTensorMode), where each
rank's reads from safetensors happen one rank at a time. DCP needs real processes, so the
save-at-tp-2 / load-at-tp-4 round trip of both formats runs under torchrun (marked slow);
tp 1 needs no process group at all and runs here.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from support.infer_models import qwen3_moe
from support.models import tiny_llama, token_batch
from transformers import LlamaForCausalLM

import tpplan
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan.checkpoint import CheckpointError, full_state_dict, load_checkpoint, save_checkpoint
from tpplan.checkpoint.safetensors_io import StreamingWriter

HERE = Path(__file__).parent
LLAMA_PLAN = HERE / "plans" / "llama.yaml"
# fp32 logits of a 2-layer model: sharded matmuls sum in another order, which moves the last
# bits (observed ~2e-7); 1e-5 is the bar the issue sets.
TOL = 1e-5
SENTINEL = 7.0  # what the model holds before a load that must be refused


def _shard(model: LlamaForCausalLM, tp_mesh) -> LlamaForCausalLM:  # type: ignore[no-untyped-def]
    """Shard by the hand-written plan; a model on meta is then materialized, empty.

    Build the model before entering simulated_ranks: built inside, its parameters are
    LocalTensors, and to_empty must then swap them, which torch refuses once the plan
    check has taken a weak reference to them.
    """
    tpplan.apply_plan(model, tp_mesh, LLAMA_PLAN)
    if model.lm_head.weight.device.type == "meta":
        model.to_empty(device="cpu")
    return model


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    """tests/checkpoint_ranks.py on `nproc` gloo ranks (about 10 s per start)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", str(HERE / "checkpoint_ranks.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _empty_llama() -> LlamaForCausalLM:
    """tp 1: no mesh, built on meta and materialized, as a loader would."""
    model = tiny_llama(device="meta")
    model.to_empty(device="cpu")
    return model


def _worst(got: torch.Tensor, want: torch.Tensor) -> float:
    return max((v - want).abs().max().item() for v in rank_values(got))


@pytest.fixture(scope="module")
def saved_at_tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A safetensors folder written by 2 simulated ranks from the seeded tiny Llama."""
    folder = tmp_path_factory.mktemp("tp2") / "ckpt"
    model = tiny_llama()
    with simulated_ranks(2) as mesh:
        save_checkpoint(_shard(model, mesh), folder, sharded=False)
    return folder


# --- gathering and saving ------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_full_state_dict_is_the_unsharded_state_dict(tp: int) -> None:
    want = tiny_llama().state_dict()
    model = tiny_llama()
    with simulated_ranks(tp) as mesh:
        got = full_state_dict(_shard(model, mesh))
    assert list(got) == list(want)
    for name, t in want.items():
        assert type(got[name]) is torch.Tensor, name
        assert got[name].shape == t.shape and torch.equal(got[name], t), name


def test_a_whole_save_loads_with_plain_from_pretrained(saved_at_tp2: Path) -> None:
    assert sorted(p.name for p in saved_at_tp2.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    x = token_batch()
    loaded = LlamaForCausalLM.from_pretrained(saved_at_tp2)
    # the gathered weights are the original bits, so the outputs are identical, not close
    assert torch.equal(loaded(x).logits, tiny_llama()(x).logits)


def test_a_large_model_is_split_into_files_with_an_index(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    model = tiny_llama()
    with simulated_ranks(2) as mesh:
        save_checkpoint(_shard(model, mesh), folder, sharded=False, max_file_bytes=100_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    x = token_batch()
    want = tiny_llama()(x).logits
    assert torch.equal(LlamaForCausalLM.from_pretrained(folder)(x).logits, want)
    model = _empty_llama()
    load_checkpoint(model, folder)
    assert torch.equal(model(x).logits, want)


def test_sharded_saves_need_real_processes(tmp_path: Path) -> None:
    model = tiny_llama()
    with simulated_ranks(2) as mesh, pytest.raises(CheckpointError, match="needs real processes"):
        save_checkpoint(_shard(model, mesh), tmp_path / "ckpt", sharded=True)
    assert list(tmp_path.iterdir()) == []


# --- loading at another tp size ------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_tp2_safetensors_save_loads_at_any_tp(saved_at_tp2: Path, tp: int) -> None:
    x = token_batch()
    want = tiny_llama()(x).logits
    if tp == 1:
        model = _empty_llama()
        load_checkpoint(model, saved_at_tp2)
        assert _worst(model(x).logits, want) <= TOL
        return
    meta = tiny_llama(device="meta")
    with simulated_ranks(tp) as mesh:
        model = _shard(meta, mesh)
        load_checkpoint(model, saved_at_tp2)
        assert _worst(model(x).logits, want) <= TOL


def _saved_tied(folder: Path) -> tuple[LlamaForCausalLM, torch.Tensor, torch.Tensor]:
    """A tied model saved by save_pretrained to `folder`: (the same model on meta, input
    ids, the saved model's logits for them)."""
    ref = tiny_llama(tied=True)
    ref.save_pretrained(folder)
    x = token_batch()
    return tiny_llama(tied=True, device="meta"), x, ref(x).logits


@pytest.mark.parametrize("tp", [1, 2])
def test_a_model_on_meta_is_materialized_by_the_load_its_ties_kept(tmp_path: Path, tp: int) -> None:
    """Build on meta, apply the plan, load: load_checkpoint makes the model empty on the
    mesh's device itself (no to_empty), ties the embedding and the head again, fills both,
    and rebuilds the rotary buffers; the logits match the model saved."""
    meta, x, want = _saved_tied(tmp_path / "ckpt")
    if tp == 1:
        load_checkpoint(meta, tmp_path / "ckpt")
        assert meta.lm_head.weight is meta.model.embed_tokens.weight
        assert meta.lm_head.weight.device.type == "cpu"
        assert torch.equal(meta(x).logits, want)
        return
    with simulated_ranks(tp) as mesh:
        tpplan.apply_plan(meta, mesh, LLAMA_PLAN)
        load_checkpoint(meta, tmp_path / "ckpt")
        assert meta.lm_head.weight is meta.model.embed_tokens.weight
        assert _worst(meta(x).logits, want) <= TOL


@pytest.mark.parametrize("tp", [1, 2])
def test_tied_weights_saved_once_by_save_pretrained_load(tmp_path: Path, tp: int) -> None:
    """save_pretrained drops lm_head.weight of a tied model; sharding unties the two, so
    the head is filled from the embedding it was tied to."""
    meta, x, want = _saved_tied(tmp_path / "ckpt")
    if tp == 1:
        meta.to_empty(device="cpu")
        load_checkpoint(meta, tmp_path / "ckpt")
        assert torch.equal(meta(x).logits, want)
        return
    with simulated_ranks(tp) as mesh:
        model = _shard(meta, mesh)
        load_checkpoint(model, tmp_path / "ckpt")
        assert _worst(model(x).logits, want) <= TOL


def test_each_rank_holds_only_its_own_slices(saved_at_tp2: Path) -> None:
    want = tiny_llama().model.layers[0]
    meta = tiny_llama(device="meta")
    with simulated_ranks(4) as mesh:
        model = _shard(meta, mesh)
        load_checkpoint(model, saved_at_tp2)
        layer = model.model.layers[0]
        q = rank_values(layer.self_attn.q_proj.weight.to_local())
        o = rank_values(layer.self_attn.o_proj.weight.to_local())
    # colwise is Shard(0), rowwise Shard(1): rank r holds chunk r of that dim
    assert [v.shape for v in q] == [torch.Size([16, 64])] * 4
    assert torch.equal(torch.cat(q, 0), want.self_attn.q_proj.weight)
    assert torch.equal(torch.cat(o, 1), want.self_attn.o_proj.weight)


def test_rotary_buffers_of_a_meta_model_are_rebuilt(saved_at_tp2: Path) -> None:
    ref = tiny_llama()
    meta = tiny_llama(device="meta")
    with simulated_ranks(2) as mesh:
        model = _shard(meta, mesh)
        rotary = model.model.rotary_emb
        rotary.inv_freq.fill_(float("nan"))  # what to_empty may leave: any bits at all
        load_checkpoint(model, saved_at_tp2)
        assert torch.equal(rotary.inv_freq, ref.model.rotary_emb.inv_freq)
        assert torch.equal(rotary.original_inv_freq, ref.model.rotary_emb.original_inv_freq)


def test_a_model_left_on_meta_is_materialized_on_the_cpu(saved_at_tp2: Path) -> None:
    """An unsharded model on meta (no mesh to take a device from) is made on the CPU and
    gets what a model materialized by hand gets."""
    model = tiny_llama(device="meta")
    load_checkpoint(model, saved_at_tp2)
    by_hand = _empty_llama()
    load_checkpoint(by_hand, saved_at_tp2)
    want = by_hand.state_dict()
    for name, got in model.state_dict().items():
        assert got.device.type == "cpu", name
        assert torch.equal(got, want[name]), name


def test_progress_is_shown_on_a_terminal_only(
    saved_at_tp2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr("sys.stderr", stream)
        load_checkpoint(_empty_llama(), saved_at_tp2)
        assert ("loading ckpt:" in stream.getvalue()) is shown
        assert not shown or "100%" in stream.getvalue()


@pytest.mark.slow
def test_real_ranks_save_at_tp2_and_load_at_tp4_and_tp1(tmp_path: Path) -> None:
    """Both formats: gloo ranks save at tp 2 and load at tp 4 (meta-built, and again by
    from_pretrained, which builds from the config the save wrote), then tp 1 here."""
    for mode, nproc in (("save", 2), ("load", 4)):
        run = _torchrun(nproc, mode, str(tmp_path))
        assert run.returncode == 0, run.stdout + run.stderr
        # ranks print concurrently, so their lines may share a line of stdout
        assert run.stdout.count(f"/{nproc} {mode} worst") == nproc, run.stdout
    assert (tmp_path / "dcp" / ".metadata").is_file()
    assert len(list((tmp_path / "dcp").glob("*.distcp"))) == 2  # one file per saving rank
    # stored in chunks of at most 1 KiB (set by checkpoint_ranks.py), read back across them
    chunks = _stored_chunks(tmp_path / "dcp")
    assert chunks["model.embed_tokens.weight"] == 128 * 64 * 4 // 1024
    x = token_batch()
    want = tiny_llama()(x).logits
    for fmt in ("dcp", "safetensors"):
        model = _empty_llama()
        load_checkpoint(model, tmp_path / fmt)
        assert _worst(model(x).logits, want) <= TOL, fmt


# --- saving atomically ---------------------------------------------------------------------


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_new_save_replaces_the_previous_one(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_checkpoint(tiny_llama(seed=1), folder, sharded=False)
    save_checkpoint(tiny_llama(seed=2), folder, sharded=False)
    model = _empty_llama()
    load_checkpoint(model, folder)
    assert torch.equal(model.lm_head.weight, tiny_llama(seed=2).lm_head.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("sharded", [False, True])
def test_a_crash_mid_save_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharded: bool
) -> None:
    folder = tmp_path / "ckpt"
    save_checkpoint(tiny_llama(seed=1), folder, sharded=sharded)
    before = _file_bytes(folder)
    calls = 0

    def crash(*args: object, **kwargs: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:  # some tensors already written
            raise OSError("disk full (simulated)")
        return write(*args, **kwargs)  # type: ignore[no-any-return]

    if sharded:
        import torch.distributed.checkpoint.filesystem as fs

        write = fs._write_item
        monkeypatch.setattr(fs, "_write_item", crash)
    else:
        write = StreamingWriter.write  # type: ignore[assignment]
        monkeypatch.setattr(StreamingWriter, "write", crash)
    with pytest.raises(
        CheckpointError,
        match=r"ckpt failed \(.*disk full \(simulated\)\); the previous checkpoint there is unchanged",
    ):
        save_checkpoint(tiny_llama(seed=2), folder, sharded=sharded)
    assert calls >= 3
    assert _file_bytes(folder) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary folder left


def test_a_failed_save_to_a_new_folder_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(StreamingWriter, "write", full)
    with pytest.raises(CheckpointError, match=r"ckpt failed \(OSError: .*No space left.*\); Fix"):
        save_checkpoint(tiny_llama(), tmp_path / "ckpt", sharded=False)
    assert list(tmp_path.iterdir()) == []


# files a user keeps beside a checkpoint, which no save may touch
_USER_FILES = {
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b"{}",
    "README.md": b"# my model\n",
    "train_state.pt": b"\x00step 1200",
    "notes/run.txt": b"lr 3e-4",
}


def _add_user_files(folder: Path) -> None:
    for name, data in _USER_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def _assert_user_files(folder: Path) -> None:
    assert {n: (folder / n).read_bytes() for n in _USER_FILES} == _USER_FILES
    assert sorted(p.name for p in (folder / "notes").iterdir()) == ["run.txt"]


def _loads_seed(folder: Path) -> int:
    """Which of the seeded tiny Llamas (1, 2 or 3) the checkpoint in `folder` holds."""
    model = _empty_llama()
    load_checkpoint(model, folder)
    got = model.state_dict()
    for seed in (1, 2, 3):
        want = tiny_llama(seed=seed).state_dict()
        if all(torch.equal(got[k], t) for k, t in want.items()):
            return seed
    raise AssertionError("the checkpoint holds none of the seeded models (a mix of two?)")


_SAFETENSORS_ONE = ["config.json", "generation_config.json", "model.safetensors"]
_USER_TOP = sorted(
    ["README.md", "notes", "tokenizer.json", "tokenizer_config.json", "train_state.pt"]
)


def _checkpoint_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in _USER_TOP)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_save_leaves_every_file_it_did_not_write(tmp_path: Path, sharded: bool) -> None:
    folder = tmp_path / "ckpt"
    save_checkpoint(tiny_llama(seed=1), folder, sharded=sharded)
    _add_user_files(folder)
    save_checkpoint(tiny_llama(seed=2), folder, sharded=sharded)
    _assert_user_files(folder)
    assert _loads_seed(folder) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize(
    ("before", "after", "names"),
    [
        # a save in fewer files leaves no third file and no index behind
        ({"max_file_bytes": 60_000}, {}, _SAFETENSORS_ONE),
        ({}, {"max_file_bytes": 100_000}, None),
        # one format over the other: a stale .metadata would be loaded instead of the weights
        ({"sharded": True}, {}, _SAFETENSORS_ONE),
        ({}, {"sharded": True}, None),
    ],
    ids=["files-to-one", "one-to-files", "dcp-to-safetensors", "safetensors-to-dcp"],
)
def test_a_save_removes_the_previous_checkpoints_other_files(
    tmp_path: Path, before: dict[str, Any], after: dict[str, Any], names: list[str] | None
) -> None:
    folder, fresh = tmp_path / "ckpt", tmp_path / "fresh"
    save_checkpoint(tiny_llama(seed=1), folder, **{"sharded": False, **before})
    if "max_file_bytes" in before:
        assert len(list(folder.glob("model-*-of-*.safetensors"))) >= 3
    _add_user_files(folder)
    save_checkpoint(tiny_llama(seed=2), folder, **{"sharded": False, **after})
    save_checkpoint(tiny_llama(seed=2), fresh, **{"sharded": False, **after})
    assert _checkpoint_names(folder) == (names or _checkpoint_names(fresh))
    _assert_user_files(folder)
    assert _loads_seed(folder) == 2


@pytest.mark.parametrize("where", [".", "ckpt", "./ckpt/"])
def test_a_save_to_a_relative_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path if where != "." else tmp_path / "ckpt")
    for seed in (1, 2):  # a new folder, then one that holds a checkpoint
        assert save_checkpoint(tiny_llama(seed=seed), where, sharded=False) == Path(where)
    assert _checkpoint_names(tmp_path / "ckpt") == _SAFETENSORS_ONE
    assert _loads_seed(Path(where)) == 2


def test_leftovers_of_a_killed_save_are_removed_by_the_next_save(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_checkpoint(tiny_llama(seed=1), folder, sharded=False)
    (folder / ".tpplan-save").mkdir()  # a stage killed while it was being written
    (folder / ".tpplan-save" / "model.safetensors").write_bytes(b"half a file")
    (folder / ".tpplan-swap.part").write_text('{"files": [')  # a journal killed mid-write
    (folder / ".tpplan-link-model.safetensors.part").write_bytes(b"x")
    assert _loads_seed(folder) == 1  # none of them is the checkpoint
    save_checkpoint(tiny_llama(seed=2), folder, sharded=False)
    assert _checkpoint_names(folder) == _SAFETENSORS_ONE
    assert _loads_seed(folder) == 2


def test_a_folder_with_other_files_gets_the_checkpoint_beside_them(tmp_path: Path) -> None:
    _add_user_files(tmp_path)
    save_checkpoint(tiny_llama(seed=1), tmp_path, sharded=False)
    _assert_user_files(tmp_path)
    assert _checkpoint_names(tmp_path) == _SAFETENSORS_ONE


def test_a_folder_whose_config_belongs_to_no_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"mine": true}')
    with pytest.raises(
        CheckpointError, match=r"holds config\.json but no checkpoint weights.*Fix: pass a new"
    ):
        save_checkpoint(tiny_llama(), tmp_path, sharded=False)
    assert _file_bytes(tmp_path) == {"config.json": b'{"mine": true}'}


def test_a_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"ckpt exists and is a file.*pass a folder path"):
        save_checkpoint(tiny_llama(), tmp_path / "ckpt", sharded=False)
    assert _file_bytes(tmp_path) == {"ckpt": b"mine"}


def test_a_filesystem_without_hard_links_gets_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ckpt"
    save_checkpoint(tiny_llama(seed=1), folder, sharded=False)
    _add_user_files(folder)

    def no_links(*args: object, **kwargs: object) -> None:
        raise PermissionError(1, "Operation not permitted (simulated: no hard links)")

    monkeypatch.setattr(os, "link", no_links)
    save_checkpoint(tiny_llama(seed=2), folder, sharded=False)
    assert _checkpoint_names(folder) == _SAFETENSORS_ONE
    _assert_user_files(folder)
    assert _loads_seed(folder) == 2


def test_a_journal_naming_missing_files_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_checkpoint(tiny_llama(seed=1), folder, sharded=False)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / ".tpplan-save").mkdir()
    (folder / ".tpplan-swap.json").write_text('{"files": ["model.safetensors"]}')
    message = r"tpplan-swap\.json, left by a save that was killed .* names files missing from"
    with pytest.raises(CheckpointError, match=message + r".*Fix: delete"):
        load_checkpoint(_empty_llama(), folder)
    with pytest.raises(CheckpointError, match=message):
        save_checkpoint(tiny_llama(seed=2), folder, sharded=False)
    assert (folder / "model.safetensors").read_bytes() == weights  # not rolled forward


class _Killed(BaseException):
    """The process died: raised by every change to the filesystem from the kill on."""


# The calls through which a save changes which files the folders hold (file contents are
# written only inside the stage, which is no checkpoint until its journal is renamed in).
_FS_CHANGES = ("mkdir", "rmdir", "link", "unlink", "remove", "rename", "replace")


@contextmanager
def _killed_at(step: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process dies at the `step`-th change to the filesystem: none succeeds from it on."""
    calls = 0

    def dying(real: Callable[..., Any]) -> Callable[..., Any]:
        def change(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls >= step:
                raise _Killed
            return real(*args, **kwargs)

        return change

    with monkeypatch.context() as m:
        for name in _FS_CHANGES:
            m.setattr(os, name, dying(getattr(os, name)))
        yield


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"max_file_bytes": 60_000}, {}),
        ({}, {"sharded": True}),
        ({"sharded": True}, {"max_file_bytes": 60_000}),
    ],
    ids=["files-to-one", "safetensors-to-dcp", "dcp-to-files"],
)
def test_a_save_killed_at_any_step_leaves_a_loadable_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: dict[str, Any], after: dict[str, Any]
) -> None:
    seen = set()
    kill_at = 0
    finished = False
    while not finished:
        kill_at += 1
        folder = tmp_path / str(kill_at)
        save_checkpoint(tiny_llama(seed=1), folder, **{"sharded": False, **before})
        _add_user_files(folder)
        try:
            with _killed_at(kill_at, monkeypatch):
                save_checkpoint(tiny_llama(seed=2), folder, **{"sharded": False, **after})
            finished = True
        except (_Killed, CheckpointError):  # CheckpointError: a kill inside the writing
            pass
        _assert_user_files(folder)
        if (folder / ".tpplan-swap.json").exists():
            with pytest.warns(UserWarning, match=r"was killed while replacing its files"):
                seen.add(_loads_seed(folder))
        else:
            seen.add(_loads_seed(folder))
        # the next save finishes or removes whatever the killed one left
        save_checkpoint(tiny_llama(seed=3), folder, **{"sharded": False, **after})
        assert [p.name for p in folder.iterdir() if p.name.startswith(".tpplan-")] == []
        _assert_user_files(folder)
        assert _loads_seed(folder) == 3
    assert seen == {1, 2}, seen  # kills before and after the new checkpoint took over
    assert kill_at > 10  # the kills reached every step, the swap's included


# --- bad checkpoints -----------------------------------------------------------------------


def _write_folder(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _untouched(model: torch.nn.Module) -> bool:
    return all(
        bool((v == SENTINEL).all()) for p in model.parameters() for v in rank_values(p.detach())
    )


def _fill_sentinel(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(SENTINEL)
    return model


def _bad_load(folder: Path, message: str, *, tp: int = 1) -> None:
    """The load is refused with `message` and the model keeps every value it had."""
    if tp == 1:
        model = _fill_sentinel(_empty_llama())
        with pytest.raises(CheckpointError, match=message) as e:
            load_checkpoint(model, folder)
        assert _untouched(model)
    else:
        meta = tiny_llama(device="meta")
        with simulated_ranks(tp) as mesh:
            model = _fill_sentinel(_shard(meta, mesh))
            with pytest.raises(CheckpointError, match=message) as e:
                load_checkpoint(model, folder)
            assert _untouched(model)
    assert isinstance(e.value, tpplan.TpplanError)
    assert "Nothing was loaded" in str(e.value) or "nothing was loaded" in str(e.value)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_missing_key_is_named(tmp_path: Path, tp: int) -> None:
    sd = tiny_llama().state_dict()
    del sd["model.layers.1.mlp.down_proj.weight"]
    folder = _write_folder(tmp_path / "ckpt", sd)
    _bad_load(
        folder,
        r"1 key missing from the checkpoint: model\.layers\.1\.mlp\.down_proj\.weight\b",
        tp=tp,
    )


def test_an_unexpected_key_is_named(tmp_path: Path) -> None:
    sd = tiny_llama().state_dict()
    sd["model.layers.2.mlp.up_proj.weight"] = torch.zeros(3)
    folder = _write_folder(tmp_path / "ckpt", sd)
    _bad_load(
        folder,
        r"1 key in the checkpoint but not in the model: model\.layers\.2\.mlp\.up_proj\.weight",
    )


def test_a_shape_mismatch_is_named(tmp_path: Path) -> None:
    sd = tiny_llama().state_dict()
    sd["model.embed_tokens.weight"] = torch.zeros(100, 64)
    folder = _write_folder(tmp_path / "ckpt", sd)
    _bad_load(
        folder,
        r"model\.embed_tokens\.weight is \(100, 64\) in the checkpoint but \(128, 64\) in the model",
        tp=2,
    )


def test_every_mismatch_is_reported_at_once(tmp_path: Path) -> None:
    sd = tiny_llama().state_dict()
    del sd["model.norm.weight"]
    sd["extra"] = torch.zeros(1)
    sd["lm_head.weight"] = torch.zeros(1, 1)
    folder = _write_folder(tmp_path / "ckpt", sd)
    _bad_load(folder, r"missing.*model\.norm\.weight; .*extra; 1 shape differ: lm_head\.weight")


def test_a_truncated_safetensors_file_is_named(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path / "ckpt", tiny_llama().state_dict())
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    _bad_load(folder, r"ckpt/model\.safetensors is truncated or corrupt")


def test_a_truncated_dcp_file_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_checkpoint(tiny_llama(), folder, sharded=True)  # tp 1: one process, no group
    (data,) = folder.glob("*.distcp")
    data.write_bytes(data.read_bytes()[:1000])
    _bad_load(folder, rf"{data.name} is truncated \(1000 bytes, needs \d+\)")


def test_a_corrupt_dcp_metadata_file_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_checkpoint(tiny_llama(), folder, sharded=True)
    (folder / ".metadata").write_bytes(b"not a pickle")
    _bad_load(folder, r"ckpt/\.metadata is truncated or corrupt")


def test_a_folder_without_a_checkpoint_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"neither a torch\.distributed\.checkpoint folder"):
        load_checkpoint(_empty_llama(), tmp_path)


def test_a_dcp_checkpoint_loads_at_tp1_with_parity(tmp_path: Path) -> None:
    save_checkpoint(tiny_llama(), tmp_path / "ckpt", sharded=True)
    model = _empty_llama()
    load_checkpoint(model, tmp_path / "ckpt")
    x = token_batch()
    assert torch.equal(model(x).logits, tiny_llama()(x).logits)
    assert copy.deepcopy(model) is not None  # a loaded model is an ordinary module again


class _Freqs(torch.nn.Module):
    """Not a Hugging Face model: nothing says how to recompute its non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("freqs", torch.arange(4.0), persistent=False)


def test_a_buffer_no_one_can_rebuild_is_named(tmp_path: Path) -> None:
    saved = _Freqs()
    save_checkpoint(saved, tmp_path / "ckpt", sharded=False)
    model = _fill_sentinel(_Freqs())
    with pytest.raises(CheckpointError, match=r"buffers freqs are in no checkpoint.*=False"):
        load_checkpoint(model, tmp_path / "ckpt")
    assert _untouched(model) and torch.equal(model.freqs, torch.arange(4.0))
    load_checkpoint(model, tmp_path / "ckpt", rebuild_buffers=False)
    assert torch.equal(model.lin.weight, saved.lin.weight)


# --- fused layers (GPT-2's c_attn holds q|k|v; each rank holds a slice of each) --------------


def _gpt2(device: str = "cpu") -> torch.nn.Module:
    from support.infer_models import gpt2

    with torch.device(device):
        return gpt2()


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_layers_gather_back_to_the_original_order(tp: int) -> None:
    want = _gpt2().state_dict()
    model = _gpt2()
    with simulated_ranks(tp) as mesh:
        tpplan.apply_plan(model, mesh)
        got = full_state_dict(model)
    assert list(got) == list(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_a_fused_model_saved_at_tp2_loads_at_tp4_and_in_transformers(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    folder = tmp_path / "ckpt"
    x = token_batch()
    want = _gpt2()(x).logits
    model = _gpt2()
    with simulated_ranks(2) as mesh:
        save_checkpoint(tpplan.apply_plan(model, mesh), folder, sharded=False)
    assert torch.equal(GPT2LMHeadModel.from_pretrained(folder)(x).logits, want)
    meta = _gpt2("meta")
    with simulated_ranks(4) as mesh:
        model = tpplan.apply_plan(meta, mesh)
        model.to_empty(device="cpu")
        load_checkpoint(model, folder)
        assert _worst(model(x).logits, want) <= TOL


@pytest.mark.slow
def test_fused_layers_through_dcp_load_at_another_tp(tmp_path: Path) -> None:
    """A DCP checkpoint of GPT-2 saved by 2 gloo ranks holds each fused weight as one tensor
    in the unsharded layout (the keys torch's state dict has) and loads on 4 with the
    unsharded logits; so does one in the layout earlier tpplan versions wrote (one tensor
    per fused piece, `NAME.tpplan_part0`, ...)."""
    for mode, nproc in (("fused-save", 2), ("fused-load", 4), ("fused-legacy", 2)):
        run = _torchrun(nproc, mode, str(tmp_path))
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.stdout.count(f"/{nproc} {mode} worst") == nproc, run.stdout
    keys = _stored_chunks(tmp_path / "fused-dcp")
    assert "transformer.h.0.attn.c_attn.weight" in keys
    assert not [k for k in keys if "tpplan_part" in k]


def test_shared_kv_heads_through_dcp_load_at_another_tp(tmp_path: Path) -> None:
    """A DCP checkpoint saved by 4 gloo ranks where each of 2 key/value heads is shared by
    two (replicate_heads) holds each head once, in the unsharded layout, and loads on 2
    with the unsharded logits."""
    for mode, nproc in (("shared-save", 4), ("shared-load", 2)):
        run = _torchrun(nproc, mode, str(tmp_path))
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.stdout.count(f"/{nproc} {mode} worst") == nproc, run.stdout
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(tmp_path / "shared-dcp").read_metadata().state_dict_metadata
    k = meta["model.layers.0.self_attn.k_proj.weight"]
    assert tuple(k.size) == (16, 64)  # 2 heads of 8, whole
    assert sum(math.prod(c.sizes) for c in k.chunks) == 16 * 64  # each row stored once


def _stored_chunks(folder: Path) -> dict[str, int]:
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    return {k: len(v.chunks) for k, v in meta.items() if hasattr(v, "chunks")}


def _qwen3_moe(device: str = "cpu") -> torch.nn.Module:
    with torch.device(device):
        return qwen3_moe()


@pytest.mark.parametrize("mode", ["tensor", "expert"])
def test_split_experts_save_whole_and_load_in_the_other_mode(tmp_path: Path, mode: str) -> None:
    """Experts saved from tp 2 in one mode read back in plain transformers, and into a
    meta-built model split at tp 4 in the other mode, each rank reading its own slices."""
    from transformers import Qwen3MoeForCausalLM

    other = "expert" if mode == "tensor" else "tensor"
    folder = tmp_path / "ckpt"
    x = token_batch()
    want = _qwen3_moe()(x).logits
    model = _qwen3_moe()
    with simulated_ranks(2) as mesh:
        plan = tpplan.infer_plan(model, tp_size=2, experts=mode)
        save_checkpoint(tpplan.apply_plan(model, mesh, plan), folder, sharded=False)
    assert _worst(Qwen3MoeForCausalLM.from_pretrained(folder)(x).logits, want) <= TOL
    meta = _qwen3_moe("meta")
    with simulated_ranks(4) as mesh:
        model = tpplan.apply_plan(meta, mesh, tpplan.infer_plan(meta, tp_size=4, experts=other))
        model.to_empty(device="cpu")
        load_checkpoint(model, folder)
        assert _worst(model(x).logits, want) <= TOL


def test_per_expert_tensors_of_a_hub_checkpoint_load_slice_by_slice(tmp_path: Path) -> None:
    """Mixtral's checkpoints keep one tensor per expert (`block_sparse_moe.experts.3.w1`);
    the model holds all experts in one 3-D weight. Each rank reads its slices of them."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = MixtralForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path / "hub")  # written in the per-expert layout
    with safe_open(next((tmp_path / "hub").glob("*.safetensors")), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in f.keys()  # noqa: SIM118
    x = token_batch()
    want = ref(x).logits
    for tp, mode in [(2, "tensor"), (4, "expert")]:
        with torch.device("meta"):
            meta = MixtralForCausalLM(cfg).eval()
        with simulated_ranks(tp) as mesh:
            model = tpplan.apply_plan(meta, mesh, tpplan.infer_plan(meta, tp_size=tp, experts=mode))
            model.to_empty(device="cpu")
            load_checkpoint(model, tmp_path / "hub")
            assert _worst(model(x).logits, want) <= TOL, (tp, mode)


class _SplitStoredLlama(LlamaForCausalLM):
    """A Llama whose checkpoints store each gate_proj as two halves, and q_proj, k_proj and
    v_proj as one fused qkv tensor: conversions registered with transformers for this class."""


def _register_conversions() -> None:
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Chunk, Concatenate, WeightConverter

    register_checkpoint_conversion_mapping(
        _SplitStoredLlama.__name__,
        [
            WeightConverter(
                source_patterns=["mlp.gate_a.weight", "mlp.gate_b.weight"],
                target_patterns="mlp.gate_proj.weight",
                operations=[Concatenate(dim=0)],
            ),
            WeightConverter(
                source_patterns=["self_attn.qkv.weight"],
                target_patterns=[
                    "self_attn.q_proj.weight",
                    "self_attn.k_proj.weight",
                    "self_attn.v_proj.weight",
                ],
                operations=[Chunk(dim=0)],
            ),
        ],
        overwrite=True,
    )


def _stored_split(tmp_path: Path, *, fuse_qkv: bool) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    ref = _SplitStoredLlama(tiny_llama().config).eval()
    stored = {}
    for k, v in ref.state_dict().items():
        if k.endswith("mlp.gate_proj.weight"):
            half = v.shape[0] // 2
            stored[k.replace("gate_proj", "gate_a")] = v[:half].clone()
            stored[k.replace("gate_proj", "gate_b")] = v[half:].clone()
        elif fuse_qkv and k.endswith("self_attn.q_proj.weight"):
            parts = [v] + [ref.state_dict()[k.replace("q_proj", x)] for x in ("k_proj", "v_proj")]
            stored[k.replace("q_proj", "qkv")] = torch.cat(parts).clone()
        elif fuse_qkv and (k.endswith("k_proj.weight") or k.endswith("v_proj.weight")):
            continue
        else:
            stored[k] = v.clone()
    return _write_folder(tmp_path / "ckpt", stored), ref


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tensor_stored_in_pieces_is_read_slice_by_slice(tmp_path: Path, tp: int) -> None:
    _register_conversions()
    folder, ref = _stored_split(tmp_path, fuse_qkv=False)
    x = token_batch()
    with torch.device("meta"):
        meta = _SplitStoredLlama(ref.config).eval()
    with simulated_ranks(tp) as mesh:
        model = tpplan.apply_plan(meta, mesh, LLAMA_PLAN)
        model.to_empty(device="cpu")
        load_checkpoint(model, folder)
        assert _worst(model(x).logits, ref(x).logits) <= TOL


def test_a_conversion_tpplan_cannot_read_in_slices_is_named(tmp_path: Path) -> None:
    _register_conversions()
    folder, ref = _stored_split(tmp_path, fuse_qkv=True)
    model = _SplitStoredLlama(ref.config).eval()
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(model, folder)
    msg = str(e.value)
    assert "model.layers.0.self_attn" in msg and "Chunk" in msg
    assert "from_pretrained" in msg and "save_checkpoint" in msg
