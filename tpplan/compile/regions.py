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
from .local_regions import Recorder, RegionNotes, contiguous_dtensor, note_outputs
from .params import REGION_FLAG
from .region_filled import kept_filled, norm_over_filled
from .region_heads import BATCHED, MATMULS, batched_alike, heads_attention, own_heads
from .region_pieces import (
    NOT_HELD,
    PIECES,
    Pieces,
    on_bounds,
    pieces_call,
    refuse_held,
    region_entered,
    sliced_span,
    taken,
)
from .region_whole import (
    ELEMENTWISE,
    NORMS,
    SUMS,
    made_whole,
    norm_over_split,
    own_entries,
    own_entries_beside,
    reduced_over_split,
)

__all__ = ["hold_dtensors"]


class _ReplicatePlain(TorchFunctionMode):
    """An op mixing DTensors with plain tensors gets the plain ones as replicated DTensors;
    attention on heads split alike runs on each rank's own heads."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if PIECES:
            # a fused output held in unequal pieces: cut apart at their bounds, or refused
            found = pieces_call(func, args, kwargs)
            if found is not NOT_HELD:
                return found
        found = kept_filled(func, args, kwargs)
        if found is not None:
            return found
        if func is F.scaled_dot_product_attention:
            found = heads_attention(*args, **kwargs)
            if found is not None:
                return found
        if func in SUMS and args and isinstance(args[0], DTensor):
            found = reduced_over_split(func, *args, **kwargs)
            if found is not None:
                return found
        if func in NORMS and args and isinstance(args[0], DTensor):
            found = norm_over_filled(func, *args, **kwargs)
            if found is not None:
                return found
            found = norm_over_split(func, *args, **kwargs)
            if found is not None:
                return found
        if func in BATCHED:
            found = batched_alike(func, *args, **kwargs)
            if found is not None:
                return found
        if func in MATMULS and len(args) == 2 and not kwargs:
            # `q @ k.transpose(1, 2)` on `(b h)` batches: a bmm, a whole side its own rows
            a, b = (own_heads(t, args[1 - i]) for i, t in enumerate(args))
            if all(isinstance(t, DTensor) and t.ndim == 3 for t in (a, b)):
                found = batched_alike(torch.bmm, a, b)
                if found is not None:
                    return found
            elif (a is not args[0] or b is not args[1]) and all(
                isinstance(t, DTensor) for t in (a, b)
            ):
                # `q @ k.transpose(-2, -1)` on split heads with k whole: its own heads, whose
                # gradient comes back whole (DTensor's own matmul would hand k a split one)
                return func(a, b)
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
                if func in MATMULS:
                    # a whole operand beside split batch dims (heads): its own rows of them
                    own = own_heads(t, first)
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
    return contiguous_dtensor(out, source.device_mesh, source.placements, size)


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
    return contiguous_dtensor(local, first.device_mesh, [placement], shape)


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
    span = sliced_span(x, index, d)
    if span is None or x.shape[d] % k:
        return None
    pieces = Pieces((x.shape[d] // k,) * k)
    return taken(x, pieces, *span, dim=d) if on_bounds(pieces, *span) else None


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
        region_entered(1)
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
            region_entered(-1)
        refuse_held(out)
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
