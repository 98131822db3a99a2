"""Safetensors files on their own: headers indexed, regions read exactly, files streamed out.

No model: a few small tensors written with safetensors' own `save_file` (or tpplan's
`StreamingWriter`) and read back. Whole checkpoints are tested in tests/test_checkpoint.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tpplan.checkpoint.safetensors_io import (
    INDEX_NAME,
    CheckpointError,
    StreamingWriter,
    index_folder,
    open_files,
    read_slices_into,
    safetensors_files,
)

pytestmark = pytest.mark.unit

SENTINEL = 7.0  # what the destination holds before the read


@pytest.mark.parametrize(
    ("shape", "region"),
    [
        ((6, 10), (slice(2, 4), slice(0, 10))),  # rows: one run
        ((6, 10), (slice(0, 6), slice(5, 10))),  # columns: one short run per row, in blocks
        ((4, 5, 6), (slice(1, 3), slice(0, 5), slice(2, 4))),  # runs over two outer dims
        ((3, 40000), (slice(0, 3), slice(20000, 40000))),  # runs long enough to read one by one
        ((), ()),  # a 0-dim tensor
        ((5, 0), (slice(0, 5), slice(0, 0))),  # nothing to read
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_region_is_read_exactly(
    tmp_path: Path, shape: tuple[int, ...], region: tuple[slice, ...], dtype: torch.dtype
) -> None:
    """Whatever the stored dtype, the region lands in an fp32 tensor as torch indexing gives it."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(shape, generator=g).to(dtype)
    save_file({"pad": torch.ones(3), "t": full}, tmp_path / "x.safetensors")
    out = torch.full(full[region].shape, SENTINEL)
    with open_files([tmp_path / "x.safetensors"]) as fds:
        entry = index_folder(fds)["t"]
        read_slices_into(fds[entry.file], entry, region, out)
    assert torch.equal(out, full[region].float())


def test_a_region_reads_into_a_strided_view(tmp_path: Path) -> None:
    """A rank's local shard may be a view of a bigger tensor (one fused part of it)."""
    full = torch.arange(24.0).reshape(4, 6)
    save_file({"t": full}, tmp_path / "x.safetensors")
    holder = torch.full((4, 8), SENTINEL)
    with open_files([tmp_path / "x.safetensors"]) as fds:
        entry = index_folder(fds)["t"]
        read_slices_into(fds[entry.file], entry, (slice(0, 4), slice(2, 5)), holder[:, 1:4])
    assert torch.equal(holder[:, 1:4], full[:, 2:5])
    assert (holder[:, [0, 4, 5, 6, 7]] == SENTINEL).all()


def test_the_index_reads_headers_only(tmp_path: Path) -> None:
    save_file(
        {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int64)}, tmp_path / "x.safetensors"
    )
    with open_files([tmp_path / "x.safetensors"]) as fds:
        index = index_folder(fds)
    assert {k: (e.shape, e.dtype) for k, e in index.items()} == {
        "a": ((2, 3), torch.float32),
        "b": ((4,), torch.int64),
    }


def test_a_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(1)}, tmp_path / "one.safetensors")
    save_file({"a": torch.zeros(1)}, tmp_path / "two.safetensors")
    with (
        open_files(safetensors_files(tmp_path)) as fds,
        pytest.raises(CheckpointError) as e,
    ):
        index_folder(fds)
    assert str(e.value) == (
        "tensor a is in both one.safetensors and two.safetensors; fix: remove the stale file "
        "from the checkpoint folder."
    )


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(100)}, path)
    path.write_bytes(path.read_bytes()[:-10])
    with (
        pytest.raises(CheckpointError, match=r"x\.safetensors is truncated or corrupt"),
        open_files([path]),
    ):
        pass


def test_the_files_of_a_folder_without_an_index_are_every_safetensors_file(tmp_path: Path) -> None:
    for name in ("b.safetensors", "a.safetensors", "notes.txt"):
        (tmp_path / name).write_text("x")
    assert safetensors_files(tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]


def test_an_index_names_the_files(tmp_path: Path) -> None:
    for name in ("model-1.safetensors", "model-2.safetensors", "stale.safetensors"):
        (tmp_path / name).write_text("x")
    weight_map = {
        "a": "model-2.safetensors",
        "b": "model-1.safetensors",
        "c": "model-2.safetensors",
    }
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    assert safetensors_files(tmp_path) == [
        tmp_path / "model-1.safetensors",
        tmp_path / "model-2.safetensors",
    ]


def test_an_index_naming_a_missing_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(CheckpointError) as e:
        safetensors_files(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / INDEX_NAME} names files that are not in {tmp_path}: gone.safetensors; "
        "fix: copy the whole checkpoint folder again (a download or copy was cut short)."
    )


def test_an_unreadable_index_is_refused(tmp_path: Path) -> None:
    (tmp_path / INDEX_NAME).write_text("{}")
    with pytest.raises(CheckpointError) as e:
        safetensors_files(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / INDEX_NAME} is not a readable safetensors index ('weight_map'); fix: "
        f"re-save the checkpoint, or delete the index to read every *.safetensors file in "
        f"{tmp_path}."
    )


def test_a_streamed_file_is_what_safetensors_reads(tmp_path: Path) -> None:
    tensors = {
        "w": torch.randn(3, 5),
        "ids": torch.arange(7),
        "half": torch.ones(2, dtype=torch.bfloat16),
    }
    entries = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    writer = StreamingWriter(tmp_path / "x.safetensors", entries, metadata={"format": "pt"})
    for name, t in tensors.items():
        writer.write(name, t)
    writer.close()
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t)


def test_every_dtype_safetensors_stores_is_written_and_read(tmp_path: Path) -> None:
    """Each dtype of the safetensors version installed (float8 variants, unsigned and complex
    included): streamed as the format names it, read back by safetensors and by tpplan."""
    from safetensors.torch import _TYPES

    tensors = {str(d): torch.arange(4).to(d) for d in _TYPES.values()}
    entries = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    writer = StreamingWriter(tmp_path / "x.safetensors", entries, metadata={})
    for name, t in tensors.items():
        writer.write(name, t)
    writer.close()
    with (
        safe_open(tmp_path / "x.safetensors", "pt") as f,
        open_files([tmp_path / "x.safetensors"]) as fds,
    ):
        index = index_folder(fds)
        for name, t in tensors.items():
            assert f.get_tensor(name).view(torch.uint8).equal(t.view(torch.uint8)), name
            out = torch.empty_like(t)
            read_slices_into(fds[index[name].file], index[name], (slice(0, 4),), out)
            assert out.view(torch.uint8).equal(t.view(torch.uint8)), name


def test_a_dtype_safetensors_cannot_store_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"safetensors cannot store dtype torch\.complex128"):
        StreamingWriter(tmp_path / "x.safetensors", [("c", torch.complex128, (2,))], metadata={})


def test_a_streamed_file_closed_short_is_a_bug(tmp_path: Path) -> None:
    entries = [("a", torch.float32, (2,)), ("b", torch.float32, (2,))]
    writer = StreamingWriter(tmp_path / "x.safetensors", entries, metadata={})
    writer.write("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="closed with tensors unwritten"):
        writer.close()
