"""Attention on heads split in a DTensor region: each rank computes its own heads.

Start at `heads_attention`. DTensor has sharding strategies for some of SDPA's kernels only,
and none for the math fallback the meta device of a proof run takes; and a whole key or
value beside split query heads (multi-query attention, key/value layers kept whole) would
have DTensor replicate-to-shard it, which fails on fake ranks. Here each rank runs the op on
its own heads' local tensors: SDPA (`heads_attention`), `bmm` and `baddbmm` of heads folded
into the batch dim (`batched_alike`), and a whole operand met beside split heads taken as the
rank's own rows of them (`own_heads`). regions.py's mode calls them; each returns None where
it does not apply, and DTensor's own dispatch decides.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._runtime.torch_compat import StridedShard
from .local_regions import contiguous_dtensor
from .region_whole import is_whole, own_entries, used_whole

__all__ = ["BATCHED", "MATMULS", "batched_alike", "heads_attention", "own_heads"]

MATMULS = (
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.bmm,
    torch.Tensor.bmm,
)
BATCHED = (torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm)


def batched_alike(func: Any, *args: Any, **kwargs: Any) -> Any:
    """`bmm(a, b)` or `bias.baddbmm(a, b)` of batches split alike as a `_StridedShard` on
    the batch dim (heads merged into it, `(B * heads, q, d)` with heads split: BLOOM's
    attention): each rank multiplies its own batches, and a whole bias of one row per batch
    (BLOOM's ALiBi, `(B * heads, 1, k)`) is cut to the rank's rows first (a local slice,
    no collective; a gradient it needs is gathered back). DTensor itself gathers the
    batches. None where that does not hold."""
    if kwargs.get("out") is not None:
        return None
    adds = func in (torch.baddbmm, torch.Tensor.baddbmm)
    names = ("input", "batch1", "batch2") if adds else ("input", "mat2")
    given = dict(zip(names, args, strict=False))
    given.update({n: kwargs[n] for n in names if n in kwargs})
    if len(given) != len(names) or len(args) > len(names):
        return None
    a, b = (given[n] for n in names[-2:])
    if not (isinstance(a, DTensor) and isinstance(b, DTensor) and a.placements == b.placements):
        return None
    p = a.placements[0]
    if len(a.placements) != 1 or not isinstance(p, StridedShard) or p.dim % a.ndim != 0:
        return None
    if a.ndim != 3 or b.ndim != 3 or a.device_mesh != b.device_mesh:
        return None
    shape = (a.shape[0], a.shape[1], b.shape[2])
    if not adds:
        out = torch.bmm(a.to_local(), b.to_local())
    else:
        bias = _own_rows(given["input"], a, int(p.split_factor))
        if bias is None:
            return None
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        out = torch.baddbmm(bias, a.to_local(), b.to_local(), beta=beta, alpha=alpha)
    return contiguous_dtensor(out, a.device_mesh, [p], shape)


def _own_rows(bias: Any, batches: DTensor, k: int) -> torch.Tensor | None:
    """A bias added to batches split as `_StridedShard(0, k)` as the rank's own batches
    meet it: split alike, its local part; whole and broadcast over the batch dim, as it is;
    whole with one row per batch, the rank's rows (the batch dim seen as (k, n), each rank
    its slice of n). None where it is neither."""
    if isinstance(bias, DTensor):
        if bias.placements == batches.placements and bias.shape[0] == batches.shape[0]:
            return bias.to_local()
        if any(not isinstance(x, Replicate) for x in bias.placements):
            return None
    if not isinstance(bias, torch.Tensor) or bias.dim() > 3:
        return None
    if bias.dim() < 3 or bias.shape[0] == 1:
        return used_whole(bias, batches.device_mesh)
    if isinstance(bias, DTensor):
        bias = bias.to_local()
    tp = batches.device_mesh.size()
    rows = batches.shape[0]
    if bias.shape[0] != rows or rows % (k * tp):
        return None
    whole = DTensor.from_local(
        bias.reshape(k, rows // k, *bias.shape[1:]),
        batches.device_mesh,
        [Replicate()],
        run_check=False,
    )
    mine = whole.redistribute(placements=[Shard(1)]).to_local()
    return mine.reshape(-1, *bias.shape[1:])


def _repeated_to(t: Any, query: DTensor) -> Any:
    """A whole key or value of fewer heads (dim 1) than the query, each repeated for the
    query heads it serves (grouped-query attention's pairing); `t` as it is otherwise."""
    if not isinstance(t, torch.Tensor) or not is_whole(t) or t.dim() != query.dim() or t.dim() < 3:
        return t
    heads, want = t.shape[1], query.shape[1]
    if heads >= want or want % heads:
        return t
    return t.repeat_interleave(want // heads, dim=1)


def own_heads(t: Any, query: Any) -> Any:
    """A whole key or value (plain, or replicated) of the query's shape where the query is
    split on a dim before the last two: this rank's own entries of that dim (its gradient
    summed over the ranks in the backward); `t` as it is otherwise."""
    if not isinstance(query, DTensor) or query.device_mesh.ndim != 1:
        return t
    (p,) = query.placements
    if not isinstance(t, torch.Tensor) or not isinstance(p, (Shard, StridedShard)):
        return t
    if t.dim() != query.dim() or not is_whole(t):
        return t
    d = p.dim % query.dim()
    if d > query.dim() - 3 or t.shape[d] != query.shape[d]:
        return t
    if not isinstance(p, StridedShard):
        return own_entries(t, query, d)
    # heads folded into the batch dim, `(b h)`: each rank's heads of every batch row
    rows = int(p.split_factor)
    own = own_entries(t.unflatten(d, (rows, t.shape[d] // rows)), query, d + 1)
    if not isinstance(own, DTensor):
        return t
    return contiguous_dtensor(own.to_local().flatten(d, d + 1), query.device_mesh, [p], t.shape)


def heads_attention(
    query: Any, key: Any, value: Any, attn_mask: Any = None, *rest: Any, **kw: Any
) -> Any:
    """SDPA of q, k, v split alike on a dim before the last two (heads, or batch): each
    rank attends over its own heads, whatever kernel the device picks (torch has DTensor
    strategies for some of SDPA's kernels only, and none for its math fallback, which the
    meta device of a proof run takes). None where that does not hold (then DTensor's own
    dispatch decides): a mask that is split otherwise or not broadcast over the split dim.
    A key or value that is whole (a key/value layer kept whole, its one head repeated for
    every query head) is used as each rank's own heads of it."""
    if kw.get("enable_gqa") and isinstance(query, DTensor):
        # grouped heads given whole (transformers' SDPA path on CPU): repeated to the
        # query's heads first, so that each rank takes the key/value heads of its own
        key, value = (_repeated_to(t, query) for t in (key, value))
        if key.shape[1] == query.shape[1] and value.shape[1] == query.shape[1]:
            kw = {k: v for k, v in kw.items() if k != "enable_gqa"}
    key, value = (own_heads(t, query) for t in (key, value))
    if not all(isinstance(t, DTensor) for t in (query, key, value)):
        return None
    p = query.placements
    if key.placements != p or value.placements != p:
        return None
    if any(not isinstance(x, (Shard, StridedShard, Replicate)) for x in p):
        return None
    # heads folded into the batch dim, `(b h) n d`, come as a strided shard of it: each
    # rank's rows are still whole attention problems
    dims = [x.dim % query.ndim for x in p if isinstance(x, (Shard, StridedShard))]
    if not dims or any(d > query.ndim - 3 for d in dims):
        return None
    mask: torch.Tensor | None
    if isinstance(attn_mask, DTensor) and attn_mask.placements == p:
        mask = attn_mask.to_local()  # split alike: each rank's own heads' mask
    else:
        if isinstance(attn_mask, DTensor) and any(
            not isinstance(x, Replicate) for x in attn_mask.placements
        ):
            return None
        mask = _own_part(attn_mask, query, dims) if isinstance(attn_mask, torch.Tensor) else None
        if isinstance(attn_mask, torch.Tensor) and mask is None:
            return None
    out = F.scaled_dot_product_attention(
        query.to_local(), key.to_local(), value.to_local(), mask, *rest, **kw
    )
    shape = (*query.shape[:-1], value.shape[-1])
    return contiguous_dtensor(
        # contiguous_dtensor states a contiguous tensor's strides: CPU's kernel may lay its output
        # out heads-last, and a view of the DTensor would then fail on the local tensor
        out.contiguous(),
        query.device_mesh,
        p,
        shape,
    )


def _own_part(mask: torch.Tensor, query: DTensor, dims: list[int]) -> torch.Tensor | None:
    """A whole mask (plain or replicated) as each rank's query heads meet it: as it is
    where it broadcasts over the split dim (a gradient it needs summed over the ranks);
    cut to the rank's part where it is of the full size there (Doge's mask, one per head;
    T5's zero position bias), a local slice whose gradient, if any, is gathered back.
    DTensor's own attention fails on such a mask. None where it is neither."""
    cut = []
    for d in dims:
        md = d - (query.ndim - mask.dim())
        if md < 0 or mask.shape[md] == 1:
            continue
        if mask.shape[md] != query.shape[d] or len(dims) > 1:
            return None
        cut.append(md)
    if not cut:
        return used_whole(mask, query.device_mesh)
    whole = mask
    if not isinstance(whole, DTensor):
        whole = DTensor.from_local(mask, query.device_mesh, [Replicate()], run_check=False)
    return whole.redistribute(placements=[Shard(cut[0])]).to_local()
