"""Fused layers split as DTensor's `_StridedShard`, and the checkpoint chunks that needs.

Start at `split_parts`. A fused layer holds several pieces in one weight (q|k|v, gate|up);
tensor parallelism gives rank r its slice of every piece, so its local rows are
`[q_r | k_r | v_r]`, which is what the model's code cuts apart. torch names that layout
`_StridedShard(dim, split_factor=len(parts))` (the dim cut into the pieces, each piece cut
over the ranks), so the parameter is an honest DTensor: its full tensor is the original
weight, and `full_tensor()`, `state_dict()`, `get_model_state_dict`, optimizers (whose
moments copy the parameter's placements) and FSDP see the unsharded model's layout.

torch's distributed checkpoint (DCP) writes a DTensor's local tensor as one box of the whole
tensor; a rank holding a slice of each of three pieces holds three boxes, and DCP refuses
the save ("overlapping chunks"). `teach_checkpoint_chunks` extends DTensor's checkpoint
protocol (`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`) so that
a local tensor made of several boxes is written and read as one chunk per box: a save at one
tp size loads at any other, also through plain `dcp.load` and `dcp_to_torch_save`. A
DTensor whose local tensor is one box keeps torch's own protocol untouched.

`local_runs` (which global indices each rank holds, per dim, for any Shard/_StridedShard/
Replicate placements) serves the checkpoint protocol here and the safetensors loader.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

from .._runtime.torch_compat import StridedShard

__all__ = [
    "Run",
    "boxes",
    "equal_parts",
    "fused_order",
    "gather_pieces",
    "local_runs",
    "own_parts",
    "own_slices",
    "shard_step",
    "split_parts",
    "teach_checkpoint_chunks",
]

# A run: (first local index, first global index, length) along one dim.
Run = tuple[int, int, int]


def equal_parts(parts: Sequence[int]) -> bool:
    """Whether a fused layer's pieces can be one `_StridedShard`: all the same size."""
    return len(set(parts)) == 1


def own_parts(
    parts: Sequence[int], mesh: DeviceMesh, device: torch.device, unit: int | None = None
) -> torch.Tensor:
    """The features of a whole fused output that make this rank's slice of each part, in
    order (each rank's own index, also on simulated ranks); with `unit` (head_dim), a part of
    fewer heads than ranks gives each rank its one head (own_rows.py's `own_order`)."""
    if unit is None:
        order = torch.tensor(fused_order(parts, mesh.size()), device=device)
    else:
        from .own_rows import own_order

        rows = own_order(parts, mesh.size(), unit)
        order = torch.tensor([i for r in rows for i in r], device=device)
    return distribute_tensor(order, mesh, [Shard(0)], src_data_rank=None).to_local()


def own_slices(
    split: DTensor, mesh: DeviceMesh, parts: Sequence[int], dim: int, unit: int | None = None
) -> torch.Tensor:
    """This rank's slice of each of `parts`, pieces of several sizes laid end to end along
    `dim` of `split` (a plain Shard of the whole fused output): the whole gathered, the
    rank's slices picked out. The gradient is partial (each rank's picks only), summed back
    to the shards."""
    whole = split.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    return whole.index_select(dim, own_parts(parts, mesh, whole.device, unit))


def fused_order(parts: Sequence[int], tp: int) -> list[int]:
    """Indices that put rank 0's slice of every piece first, then rank 1's, and so on: a
    contiguous Shard of the reordered dim gives each rank its own slice of each piece."""
    out: list[int] = []
    for r in range(tp):
        start = 0
        for size in parts:
            step = size // tp
            out.extend(range(start + r * step, start + (r + 1) * step))
            start += size
    return out


def gather_pieces(
    local: torch.Tensor, mesh: DeviceMesh, parts: Sequence[int], dim: int
) -> torch.Tensor:
    """The whole fused output on every rank, from each rank's slice of every piece (`local`,
    as a fused layer's `_StridedShard` weight makes it): gathered as a plain Shard, which
    lays rank 0's slices first, then put back in the pieces' order by a fixed permutation.
    The same numbers as torch's `_StridedShard` gather, which reads shard offsets off a
    tensor's values and so stops a dry run on fake tensors."""
    dim = dim % local.dim()
    gathered = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
    whole = gathered.redistribute(placements=[Replicate()]).to_local()
    back = [0] * whole.shape[dim]
    for position, feature in enumerate(fused_order(parts, mesh.size())):
        back[feature] = position
    return whole.index_select(dim, torch.tensor(back, device=whole.device))


def split_parts(
    param: torch.Tensor,
    mesh: DeviceMesh,
    dim: int,
    parts: Sequence[int],
    src_data_rank: int | None,
) -> DTensor:
    """`param` split along `dim` as each rank's slice of each of its equal `parts`.

    The local tensors are cut as a contiguous Shard of the rows in rank order (DTensor's own
    scatter of a `_StridedShard` gives every simulated rank rank 0's rows under
    LocalTensorMode), then labelled with the placement that says where they sit in the
    original weight.
    """
    if not equal_parts(parts):
        raise ValueError(f"parts {list(parts)} are not all the same size")
    order = torch.tensor(fused_order(parts, mesh.size()), device=param.device)
    data = param.detach().index_select(dim, order)
    local = distribute_tensor(data, mesh, [Shard(dim)], src_data_rank=src_data_rank).to_local()
    return DTensor.from_local(
        local,
        mesh,
        [StridedShard(dim, split_factor=len(parts))],
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


# ---- which part of the whole a rank holds ---------------------------------------------------


def _take(runs: list[range], start: int, count: int) -> list[range]:
    """`count` indices of `runs` (read in order) from the `start`-th on, as runs."""
    out: list[range] = []
    for r in runs:
        if count <= 0:
            break
        if start >= len(r):
            start -= len(r)
            continue
        piece = r[start : start + count]
        out.append(piece)
        count -= len(piece)
        start = 0
    return out


def shard_step(total: int, n: int) -> int:
    """The entries each of the first of `n` chunks holds when `total` are cut as torch.chunk
    (and DTensor's Shard) cut them: ceil(total/n); the last chunks hold fewer, or none."""
    return -(-total // n)


def _chunks(runs: list[range], n: int) -> list[list[range]]:
    """torch.chunk's rule over the indices of `runs`: n chunks of ceil(len/n), the last
    ones shorter or empty."""
    total = sum(len(r) for r in runs)
    step = shard_step(total, n)
    return [_take(runs, i * step, min(step, max(total - i * step, 0))) for i in range(n)]


def _split(runs: list[range], p: Placement, n: int, at: int) -> list[range]:
    if isinstance(p, StridedShard):
        # cut into split_factor pieces, each piece over the ranks; a rank's share is its
        # chunk of every piece, in order
        pieces = _chunks(runs, int(p.split_factor))
        return [r for piece in pieces for r in _chunks(piece, n)[at]]
    return _chunks(runs, n)[at]


def local_runs(
    shape: Sequence[int],
    placements: Sequence[Placement],
    mesh: DeviceMesh,
    coordinate: Sequence[int],
) -> list[list[Run]]:
    """Per dim of a tensor of `shape` split by `placements`, the runs of global indices the
    rank at `coordinate` holds, in its local order, left to right over the mesh axes as
    DTensor splits. Replicate and Partial keep a dim whole."""
    held = [[range(n)] for n in shape]
    for axis, p in enumerate(placements):
        if isinstance(p, (Shard, StridedShard)):
            d = p.dim % len(shape)
            held[d] = _split(held[d], p, mesh.size(axis), coordinate[axis])
    out: list[list[Run]] = []
    for runs in held:
        local, merged = 0, list[Run]()
        for r in runs:
            if not r:
                continue
            if merged and merged[-1][1] + merged[-1][2] == r.start:
                first, start, n = merged[-1]
                merged[-1] = (first, start, n + len(r))
            else:
                merged.append((local, r.start, len(r)))
            local += len(r)
        out.append(merged)
    return out


def boxes(t: DTensor) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] | None:
    """(local offsets, global offsets, sizes) of each box of the whole tensor this rank's
    local tensor holds; None where it is one box (or none), which torch's protocol handles."""
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    per_dim = local_runs(tuple(t.shape), t.placements, t.device_mesh, coordinate)
    if all(len(runs) == 1 for runs in per_dim) or any(not runs for runs in per_dim):
        return None
    return [
        (
            tuple(r[0] for r in combo),
            tuple(r[1] for r in combo),
            tuple(r[2] for r in combo),
        )
        for combo in itertools.product(*per_dim)
    ]


# ---- DTensor's checkpoint protocol for several boxes per rank --------------------------------
_TORCH_PROTOCOL: dict[str, Any] = {}


def _write_items(self: DTensor, fqn: str, object: Any) -> Any:
    found = boxes(self)
    if found is None:
        return _TORCH_PROTOCOL["__create_write_items__"](self, fqn, object)
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    properties = TensorProperties.create_from_tensor(self.to_local())
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(start)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(start), sizes=torch.Size(size)),
                properties=properties,
                size=self.size(),
            ),
        )
        for _, start, size in found
    ]


def _chunk_list(self: DTensor) -> Any:
    found = boxes(self)
    if found is None:
        return _TORCH_PROTOCOL["__create_chunk_list__"](self)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return [
        ChunkStorageMetadata(offsets=torch.Size(start), sizes=torch.Size(size))
        for _, start, size in found
    ]


def _tensor_shard(self: DTensor, index: Any) -> Any:
    found = boxes(self)
    if found is None or index.offset is None:
        return _TORCH_PROTOCOL["__get_tensor_shard__"](self, index)
    for local_start, start, size in found:
        if tuple(index.offset) == start:
            # a view: loading writes into the parameter itself
            view = self.to_local()
            for d, (at, n) in enumerate(zip(local_start, size, strict=True)):
                view = view.narrow(d, at, n)
            return view
    raise ValueError(f"{index.fqn} holds no chunk at offset {tuple(index.offset)} on this rank")


def teach_checkpoint_chunks() -> None:
    """Give DTensor's checkpoint protocol one chunk per box of a rank's local tensor (once
    per process; idempotent). Called where tpplan makes a `_StridedShard` parameter."""
    if _TORCH_PROTOCOL:
        return
    for name, ours in (
        ("__create_write_items__", _write_items),
        ("__create_chunk_list__", _chunk_list),
        ("__get_tensor_shard__", _tensor_shard),
    ):
        _TORCH_PROTOCOL[name] = getattr(DTensor, name)
        setattr(DTensor, name, ours)
