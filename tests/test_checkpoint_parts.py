"""The checkpoint package's small parts, each on its own and without a model to shard.

Key matching (keys.py), recomputing buffers (buffers.py), weight files (save.py), ranks
without a process group (ranks.py) and the progress bar (progress.py); a few-parameter
nn.Module stands in for a model where one is needed. Whole saves and loads are tested in
tests/test_checkpoint.py.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tpplan._runtime.ranks import agree_on_failure, barrier, cause, rank, simulated
from tpplan.checkpoint import CheckpointError
from tpplan.checkpoint.buffers import recompute_buffers
from tpplan.checkpoint.keys import count, match_keys, names, shape_text
from tpplan.checkpoint.progress import Progress
from tpplan.checkpoint.save import DEFAULT_MAX_FILE_BYTES, split_into_files

pytestmark = pytest.mark.unit

PATH = Path("ckpt")


# ---- wording ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("items", "text"),
    [
        ([], ""),
        (["a"], "a"),
        ([f"k{i}" for i in range(8)], "k0, k1, k2, k3, k4, k5, k6, k7"),
        ([f"k{i}" for i in range(11)], "k0, k1, k2, k3, k4, k5, k6, k7 (and 3 more)"),
    ],
)
def test_names_shows_eight_and_counts_the_rest(items: list[str], text: str) -> None:
    assert names(items) == text


@pytest.mark.parametrize(("n", "text"), [(0, "0 keys"), (1, "1 key"), (2, "2 keys")])
def test_count(n: int, text: str) -> None:
    assert count(["k"] * n, "key") == text


@pytest.mark.parametrize(("shape", "text"), [((), "()"), ((4,), "(4)"), ((2, 3), "(2, 3)")])
def test_shape_text(shape: tuple[int, ...], text: str) -> None:
    assert shape_text(shape) == text


# ---- matching keys ------------------------------------------------------------------------
class _Tied(nn.Module):
    """Two keys holding one tensor, as tied embeddings do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(t.shape) for k, t in model.state_dict().items()}


def _match(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    return match_keys(model, model.state_dict(keep_vars=True), shapes, PATH)


def test_every_key_matches_itself() -> None:
    model = nn.Linear(4, 2)
    assert _match(model, _shapes(model)) == {"weight": "weight", "bias": "bias"}


def test_a_tied_weight_stored_once_serves_both_keys() -> None:
    model = _Tied()
    assert _match(model, {"embed.weight": (10, 4)}) == {
        "embed.weight": "embed.weight",
        "head.weight": "embed.weight",
    }


def test_every_mismatch_is_named_at_once() -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(CheckpointError) as e:
        _match(model, {"weight": (2, 5), "extra": (1,)})
    assert str(e.value) == (
        "ckpt does not fit this Linear: 1 key missing from the checkpoint: bias; 1 key in the "
        "checkpoint but not in the model: extra; 1 shape differ: weight is (2, 5) in the "
        "checkpoint but (2, 4) in the model. Nothing was loaded. Fix: load a checkpoint saved "
        "from a model with the same config (layer count, widths, vocab), or build the model "
        "from the checkpoint's config.json."
    )


def test_keys_a_model_says_to_ignore_are_not_unexpected() -> None:
    model = nn.Linear(4, 2)
    model._keys_to_ignore_on_load_unexpected = [r"\.rotary\.inv_freq$"]
    shapes = {**_shapes(model), "layers.0.rotary.inv_freq": (2,)}
    assert set(_match(model, shapes)) == {"weight", "bias"}


# ---- buffers no checkpoint holds ----------------------------------------------------------
class _Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.zeros(4), persistent=False)


class _Model(nn.Module):
    """A Hugging Face-like model: `_init_weights(module)` recomputes its buffers (or not)."""

    def __init__(self, *, recomputes: bool) -> None:
        super().__init__()
        self.rotary = _Rotary()
        self.recomputes = recomputes

    def _init_weights(self, module: nn.Module) -> None:
        if self.recomputes and isinstance(module, _Rotary):
            module.inv_freq.copy_(torch.arange(4.0))


def test_buffers_are_recomputed_by_the_model() -> None:
    model = _Model(recomputes=True)
    model.rotary.inv_freq.fill_(float("nan"))  # what to_empty may leave
    recompute_buffers(model)
    assert torch.equal(model.rotary.inv_freq, torch.arange(4.0))


def test_buffers_the_model_does_not_recompute_are_named_and_left_alone() -> None:
    model = _Model(recomputes=False)
    model.rotary.inv_freq.fill_(5.0)
    with pytest.raises(CheckpointError) as e:
        recompute_buffers(model)
    assert str(e.value).startswith(
        "non-persistent buffers rotary.inv_freq are in no checkpoint and the model's "
        "_init_weights did not recompute them; nothing was loaded."
    )
    assert (model.rotary.inv_freq == 5.0).all()


def test_buffers_of_a_model_without_init_weights_are_named() -> None:
    with pytest.raises(
        CheckpointError,
        match=r"buffers inv_freq are in no checkpoint and the model has no _init_weights",
    ):
        recompute_buffers(_Rotary())


def test_a_model_without_such_buffers_needs_nothing() -> None:
    recompute_buffers(nn.Linear(2, 2))


# ---- weight files -------------------------------------------------------------------------
def _entries(*sizes: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """fp32 tensors of `sizes` elements, named t0, t1, ..."""
    return [(f"t{i}", torch.float32, (n,)) for i, n in enumerate(sizes)]


def test_a_small_model_is_one_file() -> None:
    entries = _entries(10, 20)
    assert split_into_files(entries, DEFAULT_MAX_FILE_BYTES) == [("model.safetensors", entries)]


def test_files_are_filled_in_order_and_named_as_hugging_face_names_them() -> None:
    entries = _entries(10, 10, 10, 10, 10)  # 40 bytes each
    files = split_into_files(entries, 100)
    assert [(name, [e[0] for e in group]) for name, group in files] == [
        ("model-00001-of-00003.safetensors", ["t0", "t1"]),
        ("model-00002-of-00003.safetensors", ["t2", "t3"]),
        ("model-00003-of-00003.safetensors", ["t4"]),
    ]


def test_a_tensor_bigger_than_a_file_gets_a_file_of_its_own() -> None:
    """As save_pretrained does: the 400-byte tensor alone, the small ones packed together."""
    files = split_into_files(_entries(1, 100, 1), 100)
    assert sorted([e[0] for e in group] for _, group in files) == [["t0", "t2"], ["t1"]]
    assert [name for name, _ in files] == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]


# ---- ranks without a process group --------------------------------------------------------
def test_alone_this_is_rank_0_and_nothing_is_simulated() -> None:
    assert rank() == 0 and simulated() is False
    barrier()  # nothing to wait for


@pytest.mark.parametrize("failure", [None, OSError("disk full")])
def test_alone_a_failure_is_agreed_on_as_it_is(failure: BaseException | None) -> None:
    assert agree_on_failure(failure) is failure


def test_cause_is_one_line() -> None:
    assert cause(OSError("disk full")) == "OSError: disk full"


def test_cause_of_a_dcp_failure_is_the_first_ranks_own_error() -> None:
    class CheckpointException(BaseException):
        """DCP's: each failed rank's error with its traceback, by rank."""

        def __init__(self, failures: dict[int, tuple[BaseException, Any]]) -> None:
            self.failures = failures

    failures = {3: (ValueError("late"), None), 1: (OSError("disk full"), None)}
    assert cause(CheckpointException(failures)) == "rank 1: OSError: disk full"


# ---- the progress bar ---------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_drawn_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _Terminal()
    monkeypatch.setattr("sys.stderr", stream)
    with Progress(2 * 2**20, "loading x") as progress:
        progress.advance(2**20)
        progress.advance(2**20)
    text = stream.getvalue()
    assert text.startswith("\rloading x:")
    assert text.rstrip().endswith("s]") and "100%" in text and "2.00M/2.00M" in text


def test_progress_is_silenced_as_transformers_bars_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_DISABLE_PROGRESS_BARS, which silences transformers' bars, silences this one."""
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    stream = _Terminal()
    monkeypatch.setattr("sys.stderr", stream)
    disable_progress_bars()
    try:
        with Progress(10, "loading x") as progress:
            progress.advance(10)
    finally:
        enable_progress_bars()
    assert stream.getvalue() == ""


def test_progress_is_silent_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    with Progress(10, "loading x") as progress:
        progress.advance(10)
    assert stream.getvalue() == ""
