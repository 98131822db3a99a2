"""Modules whose forward runs on DTensor activations (`Plan.regions`).

Start at `hold_dtensors`. Inside such a module the split layers hand DTensors on, so the
module's own code sees global shapes and DTensor's sharding propagation carries the split
from the colwise layers that open it to the rowwise ones that close it (the plan's rules
say `local_output: false` on the openers). What the forward meets besides them (rotary
tables, masks, positions, a norm's plain weight) is a plain tensor, whole on every rank.
DTensor refuses an op that mixes the two, so while the module's forward runs, a plain
tensor that meets a DTensor in one op is made a replicated DTensor first (`from_local`,
no copy, no collective). That is done in the forward, where autograd records it, so the
backward needs nothing more: a gradient that comes back partial to such a tensor (a norm's
weight applied to split heads) is summed there, as DTensor's `from_local` does.

torch's own `implicit_replication()` is not used: it is a thread-local flag that autograd
resets to its value at `.backward()` for every node it runs, so it cannot be scoped to one
module's backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from .._runtime.torch_compat import StridedShard, tree_flatten, tree_map
from .dtensor_ops import teach_dtensor
from .local_regions import Recorder, RegionNotes, contiguous_strides, note_outputs
from .params import REGION_FLAG
from .region_whole import (
    ELEMENTWISE,
    NORMS,
    SUMS,
    made_whole,
    norm_over_split,
    own_entries,
    own_entries_beside,
    reduced_over_split,
    used_whole,
)

__all__ = ["hold_dtensors"]


class _ReplicatePlain(TorchFunctionMode):
    """An op mixing DTensors with plain tensors gets the plain ones as replicated DTensors;
    attention on heads split alike runs on each rank's own heads."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            found = _heads_attention(*args, **kwargs)
            if found is not None:
                return found
        if func in SUMS and args and isinstance(args[0], DTensor):
            found = reduced_over_split(func, *args, **kwargs)
            if found is not None:
                return found
        if func in NORMS and args and isinstance(args[0], DTensor):
            found = norm_over_split(func, *args, **kwargs)
            if found is not None:
                return found
        if func in _BATCHED:
            found = _batched_alike(func, *args, **kwargs)
            if found is not None:
                return found
        if func in _MATMULS and len(args) == 2 and not kwargs:
            # `q @ k.transpose(1, 2)` on `(b h)` batches: a bmm, a whole side its own rows
            a, b = (_own_heads(t, args[1 - i]) for i, t in enumerate(args))
            if all(isinstance(t, DTensor) and t.ndim == 3 for t in (a, b)):
                found = _batched_alike(torch.bmm, a, b)
                if found is not None:
                    return found
        if func in _NEW and args and isinstance(args[0], DTensor):
            found = _new_alike(func, *args, **kwargs)
            if found is not None:
                return found
        if func is torch.Tensor.__getitem__ and args and isinstance(args[0], DTensor):
            found = _pieces_sliced(*args)
            if found is not None:
                return found
        if func in _CATS and args and isinstance(args[0], (list, tuple)):
            args = (_without_empty(args[0]), *args[1:])
            found = _pieces_joined(*args, **kwargs)
            if found is not None:
                return found
            args = (_split_alike(*args, **kwargs), *args[1:])
        leaves, _ = tree_flatten((args, kwargs))
        first = next((t for t in leaves if isinstance(t, DTensor)), None)
        if first is not None and args and _plain(args[0]) and _in_place(func):
            # a plain tensor written in place with DTensors (a static KV cache's buffer, by
            # index_copy_): lifted, DTensor would write a sharded copy of it and leave the
            # buffer itself as it was, with no error. It takes the whole values instead.
            args, kwargs = tree_map(_whole_of, (args, kwargs))
            return func(*args, **kwargs)
        if first is not None and any(_plain(t) for t in leaves):
            mesh = first.device_mesh
            placements = [Replicate()] * mesh.ndim

            def lift(t: Any) -> Any:
                if not _plain(t):
                    return t
                if func in _MATMULS:
                    # a whole operand beside split batch dims (heads): its own rows of them
                    own = _own_heads(t, first)
                    if own is not t:
                        return own
                if t.requires_grad and func in ELEMENTWISE:
                    own = own_entries_beside(t, first)
                    if own is not None:
                        return own
                if t.requires_grad and func is F.linear and t.dim() == 1 and len(args) > 2:
                    # a linear's bias meets its output's features as its weight's rows do
                    weight = args[1]
                    if isinstance(weight, DTensor) and weight.placements == (Shard(0),):
                        own = own_entries(t, weight, 0)
                        if isinstance(own, DTensor):
                            return own
                return DTensor.from_local(t, mesh, placements, run_check=False)

            args, kwargs = tree_map(lift, (args, kwargs))
        return func(*args, **kwargs)


_CATS = (torch.cat, torch.concat, torch.concatenate)
_MATMULS = (
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.bmm,
    torch.Tensor.bmm,
)
_BATCHED = (torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm)
_NEW = (
    torch.Tensor.new_empty,
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_full,
)


def _new_alike(func: Any, source: DTensor, *args: Any, **kwargs: Any) -> Any:
    """`x.new_empty(shape)` (or new_zeros, ones, full) of a split DTensor, the new tensor as
    large as `x` on every split dim: split alike, so that writing x's own pieces into it
    (transformers' DeepSeek-V3 builds its keys so, `copy_` into slices) stays on each rank.
    DTensor itself makes it whole, and the writes then gather. None where that does not
    hold."""
    if not args:
        return None
    size = args[0] if isinstance(args[0], (tuple, list, torch.Size)) else None
    rest = args[1:]
    if size is None:
        ints = [a for a in args if isinstance(a, int)]
        size, rest = tuple(ints), args[len(ints) :]
    size = tuple(int(n) for n in size)
    if len(size) != source.ndim or any(
        not isinstance(p, (Shard, Replicate)) for p in source.placements
    ):
        return None
    dims = [p.dim % source.ndim for p in source.placements if isinstance(p, Shard)]
    if not dims or any(size[d] != source.shape[d] for d in dims):
        return None
    local = list(size)
    for d in dims:
        local[d] = source.to_local().shape[d]
    out = func(source.to_local(), tuple(local), *rest, **kwargs)
    return DTensor.from_local(
        out,
        source.device_mesh,
        source.placements,
        run_check=False,
        shape=torch.Size(size),
        stride=contiguous_strides(size),
    )


def _batched_alike(func: Any, *args: Any, **kwargs: Any) -> Any:
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
    return DTensor.from_local(
        out,
        a.device_mesh,
        [p],
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_strides(shape),
    )


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


def _without_empty(tensors: Any) -> Any:
    """A concatenation's tensors without the empty plain ones a DTensor meets (a KV cache's
    first `cat` onto `torch.tensor([])`): torch skips them, but lifted to a replicated
    DTensor such a 1-D placeholder cannot be laid out like the heads it is joined to."""
    if not any(isinstance(t, DTensor) for t in tensors):
        return tensors
    kept = [t for t in tensors if isinstance(t, DTensor) or t.numel() > 0]
    return type(tensors)(kept) if kept else tensors


def _pieces_joined(tensors: Any, dim: int = 0, **kw: Any) -> Any:
    """A `cat` along the dim its DTensors are all split on, each in pieces of one size (a
    Shard is one piece, a `_StridedShard` its split factor): rank r holds its slice of each
    piece, so joining the local tensors in order is rank r's slice of every piece of the
    joined tensor, a `_StridedShard` of all the pieces. DTensor itself would gather them
    (Flux's single-stream block joins its attention and MLP features before one proj_out).
    None where that does not hold."""
    if kw.get("out") is not None or not tensors:
        return None
    if not all(isinstance(t, DTensor) and len(t.placements) == 1 for t in tensors):
        return None
    first = tensors[0]
    d = dim % first.ndim
    tp = first.device_mesh.size()
    count, sizes = 0, set()
    for t in tensors:
        p = t.placements[0]
        if t.device_mesh != first.device_mesh or not isinstance(p, (Shard, StridedShard)):
            return None
        if p.dim % t.ndim != d:
            return None
        k = int(p.split_factor) if isinstance(p, StridedShard) else 1
        if t.shape[d] % (k * tp):
            return None
        count += k
        sizes.add(t.shape[d] // k)
    if len(sizes) != 1:
        return None
    local = torch.cat([t.to_local() for t in tensors], dim=d)
    shape = list(first.shape)
    shape[d] = int(sum(t.shape[d] for t in tensors))
    placement = StridedShard(d, split_factor=count) if count > 1 else Shard(d)
    return DTensor.from_local(
        local,
        first.device_mesh,
        [placement],
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_strides(tuple(shape)),
    )


def _pieces_sliced(x: DTensor, index: Any) -> Any:
    """`x[..., a:b]` of a fused output split as its equal pieces (a `_StridedShard`: rank r
    holds its slice of each piece), where a and b fall on the pieces' bounds (Phi-3 cuts q,
    k and v out of its qkv_proj at positions computed from the config): rank r's slice of
    the pieces taken is its own local slice, a Shard of one piece or a `_StridedShard` of
    several, with no collective. DTensor itself would gather. None where that does not
    hold."""
    if len(x.placements) != 1 or not isinstance(x.placements[0], StridedShard):
        return None
    p = x.placements[0]
    d, k = p.dim % x.ndim, int(p.split_factor)
    index = index if isinstance(index, tuple) else (index,)
    if index.count(Ellipsis) > 1 or any(
        not isinstance(i, slice) and i is not Ellipsis for i in index
    ):
        return None
    # each index entry's dim: those after an Ellipsis count from the end
    at = index.index(Ellipsis) if Ellipsis in index else len(index)
    dims = list(range(at)) + list(range(x.ndim - (len(index) - at - 1), x.ndim))
    entries = [i for i in index if i is not Ellipsis]
    cut = [(dim, i) for dim, i in zip(dims, entries, strict=True) if i != slice(None)]
    if len(cut) != 1 or cut[0][0] != d or cut[0][1].step not in (None, 1):
        return None
    start, stop, _ = cut[0][1].indices(x.shape[d])
    piece = x.shape[d] // k
    if x.shape[d] % k or start % piece or stop % piece or stop <= start:
        return None
    local = x.to_local()
    mine = local.shape[d] // k  # this rank's share of one piece
    sliced = local.narrow(d, start // piece * mine, (stop - start) // piece * mine)
    taken = (stop - start) // piece
    shape = list(x.shape)
    shape[d] = stop - start
    return DTensor.from_local(
        sliced,
        x.device_mesh,
        [StridedShard(d, split_factor=taken) if taken > 1 else Shard(d)],
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_strides(tuple(shape)),
    )


def _split_alike(tensors: Any, dim: int = 0, **kw: Any) -> Any:
    """A `cat` along a dim its split DTensors are not split on, joining whole ones too (a
    rotary key part every head shares, expanded to the heads, joined to each head's own
    part): the whole ones are cut as the split ones are first (a local slice, no
    collective; the backward gathers their gradient), rather than DTensor's choice of
    gathering the split ones."""
    split = {
        t.placements
        for t in tensors
        if isinstance(t, DTensor) and any(not isinstance(p, Replicate) for p in t.placements)
    }
    if len(split) != 1:
        return tensors
    (placements,) = split
    first = next(t for t in tensors if isinstance(t, DTensor))
    if any(isinstance(p, Shard) and p.dim % first.ndim == dim % first.ndim for p in placements):
        return tensors
    if not all(isinstance(p, (Shard, Replicate)) for p in placements):
        return tensors

    def alike(t: Any) -> Any:
        if _plain(t):
            t = DTensor.from_local(t, first.device_mesh, [Replicate()], run_check=False)
        whole = isinstance(t, DTensor) and all(isinstance(p, Replicate) for p in t.placements)
        return t.redistribute(placements=placements) if whole else t

    return type(tensors)(alike(t) for t in tensors)


def _repeated_to(t: Any, query: DTensor) -> Any:
    """A whole key or value of fewer heads (dim 1) than the query, each repeated for the
    query heads it serves (grouped-query attention's pairing); `t` as it is otherwise."""
    whole = not isinstance(t, DTensor) or all(isinstance(p, Replicate) for p in t.placements)
    if not isinstance(t, torch.Tensor) or not whole or t.dim() != query.dim() or t.dim() < 3:
        return t
    heads, want = t.shape[1], query.shape[1]
    if heads >= want or want % heads:
        return t
    return t.repeat_interleave(want // heads, dim=1)


def _own_heads(t: Any, query: Any) -> Any:
    """A whole key or value (plain, or replicated) of the query's shape where the query is
    split on a dim before the last two: this rank's own entries of that dim (its gradient
    summed over the ranks in the backward); `t` as it is otherwise."""
    if not isinstance(query, DTensor) or query.device_mesh.ndim != 1:
        return t
    (p,) = query.placements
    if not isinstance(t, torch.Tensor) or not isinstance(p, (Shard, StridedShard)):
        return t
    if t.dim() != query.dim() or (
        isinstance(t, DTensor) and not isinstance(t.placements[0], Replicate)
    ):
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
    return DTensor.from_local(
        own.to_local().flatten(d, d + 1),
        query.device_mesh,
        [p],
        run_check=False,
        shape=t.shape,
        stride=contiguous_strides(t.shape),
    )


def _heads_attention(
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
    key, value = (_own_heads(t, query) for t in (key, value))
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
    return DTensor.from_local(
        # the strides given below are a contiguous tensor's: CPU's kernel may lay its output
        # out heads-last, and a view of the DTensor would then fail on the local tensor
        out.contiguous(),
        query.device_mesh,
        p,
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_strides(shape),
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


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))


def _whole_of(t: Any) -> Any:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _plain(t: Any) -> bool:
    # 0-d tensors are scalars to DTensor already
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() > 0


def hold_dtensors(
    module: nn.Module,
    *,
    notes: RegionNotes | None = None,
    mesh: Any = None,
    stream: bool = False,
) -> None:
    """Let `module`'s forward mix DTensors with whole plain tensors; idempotent. With
    `notes` (the proof run of check/run.py, on the fake `mesh`), a `Recorder` notes what
    each call of the module's own code would do on local shards (local_regions.py). What it
    returns whole or summed is handed back plain, except from a sequence-parallel `stream`
    region, whose outputs flow on as DTensors to the next."""
    teach_dtensor()
    if getattr(module, REGION_FLAG, False):
        return
    # modes entered by this module's pre-hook, left by its hook (a list in the closures,
    # not on the module, so a deepcopy of the module holds no live mode)
    modes: list[TorchFunctionMode] = []
    recorders: list[Recorder] = []

    def enter(m: nn.Module, args: Any) -> None:
        mode = _ReplicatePlain()
        mode.__enter__()
        modes.append(mode)
        if notes is not None:
            recorder = Recorder(notes, mesh)
            recorder.__enter__()  # above the region's own mode: it sees the model's calls
            modes.append(recorder)
            recorders.append(recorder)

    def leave(m: nn.Module, args: Any, out: Any) -> Any:
        recorded = notes is not None and modes and isinstance(modes[-1], Recorder)
        if recorded:
            modes.pop().__exit__(None, None, None)
            recorders.pop()
        if modes:
            modes.pop().__exit__(None, None, None)
        out, summed = made_whole(out) if not stream else (out, False)
        if recorded and notes is not None:
            notes.ran = True
            # what the module returns split is gathered, as it will be on local shards
            return note_outputs(notes, out)
        return out if summed else None

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    if notes is not None:
        _layers_apart(module, recorders)
    setattr(module, REGION_FLAG, True)


def _layers_apart(module: nn.Module, recorders: list[Recorder]) -> None:
    """The split layers inside a recorded region: their calls (and their styles' hooks) are
    the layer's own, not the region's code, so the recorder steps aside while they run."""

    def inside(m: nn.Module, args: Any) -> None:
        if recorders:
            recorders[-1].inside_layer += 1

    def outside(m: nn.Module, args: Any, out: Any) -> None:
        if recorders:
            recorders[-1].inside_layer -= 1

    for child in module.modules():
        if child is not module and any(
            isinstance(p, DTensor) for p in child.parameters(recurse=False)
        ):
            child.register_forward_pre_hook(inside, prepend=True)
            child.register_forward_hook(outside, always_call=True)
