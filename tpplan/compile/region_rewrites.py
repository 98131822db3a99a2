"""What a rank does differently, call by call, to run a DTensor region's code on its local
shards: the notes local_regions.py's proof writes and its run applies (start there).

A note belongs to a call *site*, the caller's code object and bytecode offset (`call_site`).
Each is one small class with a `rewrite` of the call's arguments: `Sizes` (a view, reshape,
expand or new_* at a split dim), `Split` (a split's widths), `Slice` (slice bounds on fused
pieces), `Shape` (a shape read answered global, after the call) and `Cuts` (whole tensors
meeting split ones, cut to the rank's part, their gradient summed). `Call` is a site's
notes in order.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

from .._runtime.torch_compat import StridedShard, tree_flatten, tree_unflatten
from ..errors import TpplanError
from .local_run import _rank, copy_to_ranks, group_name
from .region_pieces import slice_dims

__all__ = [
    "EXPAND",
    "NARROW",
    "NEW",
    "NORMS",
    "SLICES",
    "SPLITS",
    "SUMS",
    "VIEWS",
    "Call",
    "Context",
    "Cut",
    "Cuts",
    "Narrow",
    "NotLocal",
    "Shape",
    "Site",
    "Sizes",
    "Slice",
    "Split",
    "call_site",
    "context",
    "placement_dim",
    "reads_shape",
    "sizes_of",
    "slice_dims",
    "where",
]

Site = tuple[CodeType, int]

_TORCH = os.path.dirname(torch.__file__) + os.sep
_TORCH_LAYERS = os.path.join(_TORCH, "nn", "modules") + os.sep
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_USER, _THROUGH, _SKIP = 0, 1, 2
_kinds: dict[CodeType, int] = {}


def _kind(code: CodeType) -> int:
    """A frame's part in a call's site: the region's own code (torch's nn modules count as
    such: a LayerNorm inside a region is its code too), torch's function wrappers (looked
    through), or tpplan's own forwards (a split layer's local run: not the region's)."""
    kind = _kinds.get(code)
    if kind is None:
        name = code.co_filename
        if name.startswith(_OURS):
            kind = _SKIP
        elif name.startswith(_TORCH) and (
            not name.startswith(_TORCH_LAYERS) or name.endswith(f"{os.sep}module.py")
        ):
            kind = _THROUGH
        else:
            kind = _USER
        _kinds[code] = kind
    return kind


def call_site() -> Site | None:
    """The site of the torch call being handled: the first caller frame of the region's own
    code, above the mode's frame; None inside tpplan's own forwards."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        kind = _kind(frame.f_code)
        if kind == _USER:
            return frame.f_code, frame.f_lasti
        if kind == _SKIP:
            return None
        frame = frame.f_back
    return None


def where(site: Site) -> str:
    code, lasti = site
    line = next((ln for start, end, ln in code.co_lines() if start <= lasti < end), None)
    return f"{os.path.basename(code.co_filename)}:{line} ({code.co_name})"


class NotLocal(Exception):
    """A region call that no local rewrite reproduces; the region stays on DTensors."""


@dataclass(frozen=True)
class Context:
    """What a rewrite needs of the rank: the tp size, its index (an int, or on simulated
    ranks each rank's own), the mesh and its group's name."""

    tp: int
    rank: Any
    mesh: DeviceMesh
    group: str


def context(mesh: DeviceMesh) -> Context:
    return Context(mesh.size(), _rank(mesh), mesh, group_name(mesh))


# --- size arguments ------------------------------------------------------------------------

VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape}
NEW = {
    torch.Tensor.new_empty,
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_full,
}
EXPAND = {torch.Tensor.expand}
SPLITS: set[Any] = {
    torch.Tensor.split,
    torch.split,
    torch.Tensor.split_with_sizes,
    torch.split_with_sizes,
}
SLICES = {torch.Tensor.__getitem__}
NARROW = {torch.Tensor.narrow, torch.narrow}
# reductions a region's code may run over the split dim, which DTensor sums over the ranks
NORMS = (F.rms_norm, F.layer_norm)
SUMS = (torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean)


def _is_size(x: Any) -> bool:
    return isinstance(x, (tuple, list, torch.Size)) and all(isinstance(n, int) for n in x)


def sizes_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int] | None:
    """The size list a view, reshape, expand or new_* call is given, or None."""
    for key in ("size", "shape"):
        if key in kwargs and _is_size(kwargs[key]):
            return list(kwargs[key])
    rest = args[1:]
    if len(rest) >= 1 and _is_size(rest[0]):
        return list(rest[0])
    ints = []
    for a in rest:
        if not isinstance(a, int) or isinstance(a, bool):
            break
        ints.append(a)
    return ints or None


def _with_sizes(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], sizes: list[int]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with its size list replaced."""
    for key in ("size", "shape"):
        if key in kwargs and _is_size(kwargs[key]):
            return args, {**kwargs, key: tuple(sizes)}
    if len(args) >= 2 and _is_size(args[1]):
        return (args[0], tuple(sizes), *args[2:]), kwargs
    return (args[0], *sizes, *args[1 + len(sizes) :]), kwargs


def placement_dim(t: Any) -> tuple[int, Any] | None:
    """(dim, placement) of a DTensor split on a 1-D mesh; None for a whole tensor."""
    if not isinstance(t, DTensor) or len(t.placements) != 1:
        return None
    p = t.placements[0]
    if isinstance(p, (Shard, StridedShard)):
        return p.dim % t.ndim, p
    return None


def _divided(v: int, tp: int, what: str) -> int:
    if v % tp:
        raise TpplanError(
            f"a DTensor region run on local shards got the size {v} for {what}, which tp {tp} "
            "does not divide, unlike the sizes its proof saw. Fix: apply the plan with "
            "apply_plan(..., local_shards=False), and report the model."
        )
    return v // tp


@dataclass
class Sizes:
    """A view, reshape, expand or new_* whose size at a split dim is global: the rank's."""

    dims: frozenset[int]
    """The output dims that are split."""

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: Context) -> Any:
        sizes = sizes_of(func, args, kwargs)
        if sizes is None:
            return args, kwargs
        new = list(sizes)
        for d in self.dims:
            if d < len(new) and new[d] != -1:
                new[d] = _divided(new[d], ctx.tp, f"dim {d} of {getattr(func, '__name__', func)}")
        return _with_sizes(func, args, kwargs, new)


@dataclass
class Split:
    """A split along a split dim at global widths: each width becomes the rank's share."""

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: Context) -> Any:
        key = next(
            (k for k in ("split_size_or_sections", "split_sizes", "split_size") if k in kwargs),
            None,
        )
        x = args[0]
        how = args[1] if len(args) > 1 else kwargs[key]
        if isinstance(how, int):
            how = _divided(how, ctx.tp, "a split's width")
        else:
            how = [_divided(n, ctx.tp, "a split's width") for n in how]
        if len(args) > 1:
            return (x, how, *args[2:]), kwargs
        return args, {**kwargs, key: how}


@dataclass
class Shape:
    """A shape read of a split tensor: the global size at its split dim, as in the proof."""

    dim: int

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: Context) -> Any:
        return args, kwargs

    def after(self, func: Any, args: Any, out: Any, ctx: Context) -> Any:
        if isinstance(out, torch.Size):
            return torch.Size(n * ctx.tp if i == self.dim else n for i, n in enumerate(out))
        x = args[0]
        if func is torch.Tensor.size and isinstance(out, int):
            asked = args[1] if len(args) > 1 else None
            return out * ctx.tp if asked is not None and asked % x.ndim == self.dim else out
        if func in (torch.Tensor.numel, torch.numel):
            return out * ctx.tp
        if func is torch.Tensor.__len__:
            return out * ctx.tp if self.dim == 0 else out
        return out


_SHAPES = {torch.Tensor.size, torch.Tensor.numel, torch.numel, torch.Tensor.__len__}
_SHAPE_GET = torch.Tensor.shape.__get__  # type: ignore[attr-defined]


def reads_shape(func: Any) -> bool:
    return func in _SHAPES or func == _SHAPE_GET


@dataclass
class Slice:
    """A slice on a split dim cut on the bounds of fused pieces split alike (q|k|v cut at
    positions from a config): each bound becomes the rank's."""

    dim: int

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: Context) -> Any:
        x, index = args[0], args[1]
        cut = slice_dims(x, index)
        if cut is None:
            return args, kwargs
        whole = x.shape[self.dim] * ctx.tp
        entries = list(index) if isinstance(index, tuple) else [index]
        k = 0
        for pos, entry in enumerate(entries):
            if entry is Ellipsis:
                continue
            dim, _ = cut[k]
            k += 1
            if dim != self.dim or not isinstance(entry, slice) or entry == slice(None):
                continue
            start, stop, _ = entry.indices(whole)
            entries[pos] = slice(start // ctx.tp, stop // ctx.tp, entry.step)
        new = tuple(entries) if isinstance(index, tuple) else entries[0]
        return (x, new, *args[2:]), kwargs


@dataclass
class Narrow:
    """A narrow of a split dim on the bounds of fused pieces split alike: its start and
    length become the rank's."""

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: Context) -> Any:
        given = dict(zip(("dim", "start", "length"), args[1:], strict=False)) | kwargs
        start = _divided(
            given["start"] % (args[0].shape[given["dim"]] * ctx.tp), ctx.tp, "a narrow's start"
        )
        length = _divided(given["length"], ctx.tp, "a narrow's length")
        return (args[0], given["dim"], start, length), {}


# --- whole tensors meeting split ones --------------------------------------------------------


@dataclass(frozen=True)
class Cut:
    leaf: int
    """The argument's index among the call's flattened arguments."""
    dim: int | None
    """The dim cut to the rank's part (None: used whole)."""
    piece: int | None
    """The length of one piece of a `_StridedShard` (None for a Shard): the pieces are
    counted at run time, since on a dim that merges the batch with the heads (BLOOM's
    `(B * heads, ...)`) their count is the batch's size."""
    ref: tuple[int, int] | None = None
    """(leaf, dim) of a split argument whose dim lines up with the cut one: a tensor whose
    size there is that argument's local size already came local (from a local shape) and
    is not cut again."""


def _own_part(t: torch.Tensor, dim: int, factor: int, ctx: Context) -> torch.Tensor:
    """The rank's part of a whole tensor split on `dim` as a Shard (factor 1) or a
    `_StridedShard` of `factor` pieces: the dim seen as (factor, tp, n), this rank's n."""
    shape = t.shape
    n = shape[dim] // (factor * ctx.tp)
    if isinstance(ctx.rank, int):
        parts = t.unflatten(dim, (factor, ctx.tp, n)).select(dim + 1, ctx.rank)
        return parts.flatten(dim, dim + 1)
    # simulated ranks: each rank's indices, laid out by DTensor without a collective
    table = torch.arange(shape[dim], device=t.device).view(factor, ctx.tp, n).transpose(0, 1)
    mine = DTensor.from_local(table, ctx.mesh, [Replicate()], run_check=False)
    index = mine.redistribute(placements=[Shard(0)]).to_local().reshape(-1)
    return t.index_select(dim, index)


@dataclass
class Cuts:
    cuts: tuple[Cut, ...]

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: Context) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        for cut in self.cuts:
            t = leaves[cut.leaf]
            if not isinstance(t, torch.Tensor):
                continue
            # a gradient of a whole tensor from this rank's heads is a partial sum
            t = copy_to_ranks(t, ctx.group, ctx.tp)
            if cut.dim is not None and t.dim() > cut.dim and not self._local(t, cut, leaves):
                factor = 1 if cut.piece is None else t.shape[cut.dim] // cut.piece
                t = _own_part(t, cut.dim, factor, ctx)
            leaves[cut.leaf] = t
        return tree_unflatten(leaves, spec)

    @staticmethod
    def _local(t: torch.Tensor, cut: Cut, leaves: list[Any]) -> bool:
        if cut.ref is None or cut.dim is None:
            return False
        ref = leaves[cut.ref[0]]
        return isinstance(ref, torch.Tensor) and t.shape[cut.dim] == ref.shape[cut.ref[1]]


@dataclass
class Call:
    """Everything one site does differently on local tensors, in order."""

    steps: list[Any]

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: Context) -> Any:
        for step in self.steps:
            args, kwargs = step.rewrite(func, args, kwargs, ctx)
        return args, kwargs

    def call(self, func: Any, args: Any, kwargs: Any, ctx: Context) -> Any:
        """The call on local tensors: arguments rewritten, a shape read answered global."""
        new_args, new_kwargs = self.rewrite(func, args, kwargs, ctx)
        out = func(*new_args, **new_kwargs)
        for step in self.steps:
            if isinstance(step, Shape):
                out = step.after(func, new_args, out, ctx)
        return out
