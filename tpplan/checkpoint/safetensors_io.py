"""Safetensors folders as the unsharded world writes and reads them, without whole models in memory.

Used by tpplan/checkpoint/load.py and save.py; start there. `index_folder` reads only the headers of a
folder's `.safetensors` files (the files named by `model.safetensors.index.json` when there
is one), so a checkpoint is checked against a model before any data is read.
`read_slices_into` reads one rectangular region of one tensor straight into the tensor that
holds it, reading no other bytes. `StreamingWriter` writes a file tensor by tensor, so the rank that
writes holds one gathered tensor at a time rather than the whole state dict.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError

__all__ = [
    "INDEX_NAME",
    "CheckpointError",
    "Entry",
    "StreamingWriter",
    "index_folder",
    "open_files",
    "read_slices_into",
    "safetensors_files",
]

INDEX_NAME = "model.safetensors.index.json"

# The safetensors header's names for torch dtypes (the format's own spelling).
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
}


_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


@dataclass(frozen=True)
class Entry:
    """Where one tensor of a safetensors folder lives, and what it is."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    """The byte offset of its data in the file."""


def safetensors_files(folder: Path) -> list[Path]:
    """The data files of a model folder: those its index names, else every *.safetensors."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index} is not a readable safetensors index ({e}); fix: re-save the checkpoint, "
                f"or delete the index to read every *.safetensors file in {folder}."
            ) from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{index} names files that are not in {folder}: {', '.join(missing)}; fix: copy "
                "the whole checkpoint folder again (a download or copy was cut short)."
            )
        return files
    return sorted(folder.glob("*.safetensors"))


@contextmanager
def open_files(files: list[Path]) -> Iterator[dict[Path, int]]:
    """{file: open descriptor} for every file, closed on exit; an unreadable file is named.

    Each file is first opened once with safe_open, which checks that the header parses and
    that the data covers every offset it declares, so a truncated file is refused here,
    before any tensor is copied. Data is then read with pread (see `read_slices_into`).
    """
    with ExitStack() as stack:
        fds: dict[Path, int] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt"):
                    pass
                fd = os.open(f, os.O_RDONLY)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(
                    f"{f} is truncated or corrupt and cannot be read ({e}); nothing was loaded. "
                    "Fix: save or copy that checkpoint again."
                ) from None
            stack.callback(os.close, fd)
            fds[f] = fd
        yield fds


def index_folder(fds: dict[Path, int]) -> dict[str, Entry]:
    """{tensor name: Entry} over the open files, from their headers alone."""
    index: dict[str, Entry] = {}
    for f, fd in fds.items():
        (n,) = struct.unpack("<Q", _pread(fd, 8, 0))
        header = json.loads(_pread(fd, n, 8))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in index:
                raise CheckpointError(
                    f"tensor {name} is in both {index[name].file.name} and {f.name}; fix: "
                    "remove the stale file from the checkpoint folder."
                )
            if info["dtype"] not in _DTYPES:
                raise CheckpointError(
                    f"tensor {name} in {f} has dtype {info['dtype']}, which tpplan cannot read; "
                    f"fix: convert the checkpoint to one of {', '.join(_DTYPES)}."
                )
            start = 8 + n + info["data_offsets"][0]
            index[name] = Entry(f, tuple(info["shape"]), _DTYPES[info["dtype"]], start)
    return index


def read_slices_into(fd: int, entry: Entry, region: tuple[slice, ...], out: torch.Tensor) -> None:
    """Copy one rectangular region of a stored tensor into `out`, reading only its bytes.

    Not get_slice: that maps the file, and the pages a rank touches stay resident (and in
    its peak RSS) until the file is closed; over a whole load that doubled the memory per
    rank. pread into the destination costs no memory beyond it. The region is a set of
    contiguous runs of the row-major data (one run for a split of dim 0); runs too short
    to read one by one are read in blocks through a small scratch buffer.
    """
    shape = tuple(s.stop - s.start for s in region)
    if tuple(out.shape) != shape:
        raise RuntimeError(f"tpplan bug: region {shape} read into a tensor of {tuple(out.shape)}")
    direct = out.dtype == entry.dtype and out.is_contiguous() and out.device.type == "cpu"
    dest = out if direct else torch.empty(shape, dtype=entry.dtype)
    if dest.numel():
        _read_runs(fd, entry, region, _bytes_of(dest))
    if not direct:
        out.copy_(dest)  # casts when the checkpoint's dtype differs from the model's


_SCRATCH = 2**20  # bytes: the most a block read of short runs holds beside the model
_SHORT = 2**16  # bytes: runs shorter than this are read in blocks


def _read_runs(fd: int, entry: Entry, region: tuple[slice, ...], dest: memoryview) -> None:
    item = entry.dtype.itemsize
    strides = [item] * len(entry.shape)
    for d in range(len(entry.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * entry.shape[d + 1]
    # dims after `k` are whole, so each run spans region[k] and everything after it
    k = len(region) - 1
    while k > 0 and region[k] == slice(0, entry.shape[k]):
        k -= 1
    run = item if not region else (region[k].stop - region[k].start) * strides[k]
    starts = [entry.start + (region[k].start * strides[k] if region else 0)]
    for d in range(k - 1, -1, -1):
        starts = [
            s + i * strides[d] for i in range(region[d].start, region[d].stop) for s in starts
        ]
    starts.sort()
    written = 0
    i = 0
    while i < len(starts):
        if run >= _SHORT:
            _pread_into(fd, dest[written : written + run], starts[i])
            written += run
            i += 1
            continue
        j = i + 1  # gather following runs while the span fits in the scratch buffer
        while j < len(starts) and starts[j] + run - starts[i] <= _SCRATCH:
            j += 1
        block = bytearray(starts[j - 1] + run - starts[i])
        _pread_into(fd, memoryview(block), starts[i])
        for s in starts[i:j]:
            at = s - starts[i]
            dest[written : written + run] = block[at : at + run]
            written += run
        i = j


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's own memory, writable, as bytes."""
    return t.detach().reshape(-1).view(torch.uint8).numpy().data.cast("B")


def _pread(fd: int, n: int, offset: int) -> bytes:
    buf = bytearray(n)
    _pread_into(fd, memoryview(buf), offset)
    return bytes(buf)


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got == 0:
            raise CheckpointError(
                f"a checkpoint file ended early at byte {offset + done}; "
                "fix: save or copy that checkpoint again."
            )
        done += got


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise CheckpointError(
            f"safetensors cannot store dtype {dtype}; fix: cast the model to one of "
            f"{', '.join(str(d) for d in _DTYPE_NAMES)}, or save with sharded=True."
        )
    return _DTYPE_NAMES[dtype]


class StreamingWriter:
    """Writes one safetensors file whose layout is fixed up front, one tensor at a time.

    The header (names, dtypes, shapes, byte offsets) is known from the model before any data
    is gathered, so it is written first and each tensor is appended as it arrives, in
    `entries` order. `close` refuses a file that did not get every tensor.
    """

    def __init__(
        self,
        path: Path,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        *,
        metadata: dict[str, str],
    ) -> None:
        header: dict[str, Any] = {"__metadata__": metadata}
        self._order: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in entries:
            nbytes = dtype.itemsize * _numel(shape)
            header[name] = {
                "dtype": _dtype_name(dtype),
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115  # closed by close()
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0
        self.path = path

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, nbytes = self._order[self._next]
        if name != want:
            raise RuntimeError(f"tpplan bug: {self.path.name} expected {want} next, got {name}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if data.numel() != nbytes:
            raise RuntimeError(f"tpplan bug: {name} has {data.numel()} bytes, header says {nbytes}")
        self._file.write(data.numpy().data)
        self._next += 1

    def close(self) -> None:
        done = self._next == len(self._order)
        self._file.close()
        if not done:
            raise RuntimeError(f"tpplan bug: {self.path.name} closed with tensors unwritten")

    def abort(self) -> None:
        self._file.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
