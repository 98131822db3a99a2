"""A fused output of unequal pieces inside a DTensor region (q|k|v with fewer key/value
heads than query heads, cut at sizes no attribute holds).

Start at `mark_pieces`. DTensor has no layout for rank r holding its slice of each of
several pieces of different sizes (`[q_r | k_r | v_r]`, what a fused layer's own rows
compute): a `Shard` would say rank r holds one contiguous run, a `_StridedShard` pieces of
one size. So the fused layer hands on its own rows labelled as a `Shard` of the fused
output (its global shape is right, so the code's shape reads are) and noted here as held
in pieces. The label is wrong for anything but cutting the pieces apart, so while the
region runs (`pieces_call`, called by regions.py's mode before anything else):

- a cut along the features at the pieces' bounds (`split`, `split_with_sizes`, `chunk`,
  `narrow`, a slice) hands out each run of pieces as what it truly is on DTensor: one
  piece a `Shard`, several of one size a `_StridedShard`, several of unequal sizes held
  in pieces again;
- a shape read, or a conversion that keeps every element where it is (`contiguous`, `to`),
  passes (the conversion's result is held in pieces too);
- anything else is refused with a `TpplanError`, so the wrong label is never computed
  with: a region proof that meets one fails, and the layers keep their split-and-gather
  rules.

On local shards (local_regions.py) nothing of this is needed: the layer's output is the
plain local tensor, and a cut's sizes are divided by tp as any split's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.weak import WeakIdKeyDictionary

from .._runtime.torch_compat import StridedShard, tree_flatten, tree_map
from ..errors import TpplanError
from .own_rows import shares_a_head

__all__ = [
    "CUTS",
    "FILLED",
    "KEEPS",
    "NOT_HELD",
    "PIECES",
    "Everywhere",
    "Filled",
    "Pieces",
    "contiguous_dtensor",
    "contiguous_strides",
    "cut_spans",
    "filled_as",
    "held_in_pieces",
    "hold_in_pieces",
    "mark_pieces",
    "on_bounds",
    "pieces_call",
    "refuse_held",
    "region_entered",
    "slice_dims",
    "sliced_span",
    "taken",
    "whole_shared_pieces",
]


@dataclass(frozen=True)
class Pieces:
    """How a marked tensor's last dim is held: the pieces' global sizes, laid end to end."""

    parts: tuple[int, ...]
    whole: tuple[bool, ...] = ()
    """Per piece, held whole on every rank (key/value heads shared among ranks, each rank's
    own head in every head's place: compile/shared_heads.py); none where empty."""

    unit: int = 0
    """The head size of the pieces held whole (0 where none is)."""

    def bounds(self) -> list[int]:
        return [0, *itertools.accumulate(self.parts)]

    def is_whole(self, i: int) -> bool:
        return bool(self.whole) and self.whole[i]

    def local(self, i: int, tp: int) -> int:
        """What a rank holds of piece `i`."""
        return self.parts[i] if self.is_whole(i) else self.parts[i] // tp


PIECES: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""{tensor: its Pieces}, for the tensors held in pieces now alive."""

FILLED: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""{replicated DTensor: its Filled}, for the pieces of shared key/value heads now alive whose
every head's place holds the rank's own head (a norm over them sums over the ranks,
region_whole.py's `norm_over_filled`)."""


@dataclass(frozen=True)
class Filled:
    """A tensor's last dim as `heads` heads, each place holding head `at`, which `replicas`
    ranks share."""

    heads: int
    at: int
    replicas: int


def filled_as(width: int, unit: int, mesh: Any) -> Filled:
    """How a rank fills a piece of `width` features of shared heads of `unit`."""
    heads = width // unit
    replicas = mesh.size() // heads
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # a rank applying a plan is on its mesh
    return Filled(heads, coordinate[0] // replicas, replicas)


def held_in_pieces(t: Any) -> Pieces | None:
    return PIECES.get(t) if PIECES and isinstance(t, DTensor) else None


_REGIONS = [0]
"""How many DTensor regions' forwards are running now (regions.py counts them): a fused
output is held in pieces only inside one, where the region's mode guards it."""


def region_entered(by: int) -> None:
    _REGIONS[0] += by


def hold_in_pieces(
    local: torch.Tensor, mesh: Any, parts: Any, shape: Any, whole: Any = (), unit: int = 0
) -> DTensor:
    """`mark_pieces` for a fused layer's output, refused with the fix outside a running
    DTensor region: there nothing would keep the label from being computed with."""
    if not _REGIONS[0]:
        raise TpplanError(
            f"a fused colwise layer of unequal parts {list(parts)} hands DTensors on "
            "(local_output: false) outside a DTensor region: no DTensor layout holds pieces of "
            "several sizes, so only a region's code, which may only cut them apart, can take "
            "them. Fix: drop local_output: false from its rule, or list the module that cuts "
            "them in the plan's regions."
        )
    return mark_pieces(local, mesh, parts, shape, whole, unit)


def refuse_held(out: Any) -> None:
    """A region hands back nothing held in pieces (its label is no layout of them)."""
    for t in tree_flatten(out)[0]:
        found = held_in_pieces(t)
        if found is not None:
            raise TpplanError(
                f"a DTensor region returns a fused output held in its unequal pieces "
                f"{list(found.parts)}, uncut: no DTensor layout holds them outside the region. "
                "Fix: keep the fused layer split and gathered (output: replicate), and report "
                "the model."
            )


def mark_pieces(
    local: torch.Tensor, mesh: Any, parts: Any, shape: Any, whole: Any = (), unit: int = 0
) -> DTensor:
    """`local`, rank r's slice of each of `parts` along the last dim (in order; the whole
    of each piece `whole` flags), as a DTensor of the fused output's global `shape`, held in
    pieces (see the module docstring)."""
    out = contiguous_dtensor(local, mesh, [Shard(local.dim() - 1)], shape)
    PIECES[out] = Pieces(tuple(int(n) for n in parts), tuple(bool(w) for w in whole), unit)
    return out


# the calls that may take a tensor held in pieces and what they do with it
_SPLITS = {
    torch.Tensor.split,
    torch.split,
    torch.Tensor.split_with_sizes,
    torch.split_with_sizes,
    torch.Tensor.chunk,
    torch.chunk,
}
_NARROWS = {torch.Tensor.narrow, torch.narrow}
CUTS = _SPLITS | _NARROWS | {torch.Tensor.__getitem__}
"""The calls `cut_spans` reads."""
KEEPS = {
    torch.Tensor.contiguous,
    torch.Tensor.to,
    torch.Tensor.float,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.type_as,
    # of its own shape: autograd's alias of a tensor a Function hands back as it came (a
    # module's backward hooks wrap its output so)
    torch.Tensor.view_as,
}
_READS = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.numel,
    torch.Tensor.__len__,
    torch.Tensor.is_contiguous,
    torch.Tensor.is_floating_point,
    # hooks on the output's gradient (torch's module trackers): they see it, held alike
    torch.Tensor.register_hook,
}
NOT_HELD = object()


def pieces_call(func: Any, args: Any, kwargs: Any) -> Any:
    """`func(*args, **kwargs)` where a tensor held in pieces takes part (see the module
    docstring); `NOT_HELD` (for the caller to go on) where none does."""
    leaves, _ = tree_flatten((args, kwargs))
    found = next((t for t in leaves if held_in_pieces(t) is not None), None)
    if found is None:
        return NOT_HELD
    held: DTensor = found
    pieces = PIECES[held]
    name = getattr(func, "__name__", str(func))
    if args and args[0] is found:
        if func in CUTS:
            spans = cut_spans(func, held, args[1:], kwargs)
            if spans is not None:
                cut = [taken(held, pieces, a, b) for a, b in spans]
                return (
                    cut[0] if func in _NARROWS or func is torch.Tensor.__getitem__ else tuple(cut)
                )
        elif func in _READS or (name == "__get__" and not _values(func)):
            out = func(*args, **kwargs)
            if not any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
                return out  # a size, a dtype, a hook's handle
        elif func in KEEPS and pieces.whole:
            # pieces held whole beside split ones: the label's local size is no DTensor
            # layout's, so the conversion runs on the local tensor, labelled again
            local = held.to_local()
            args, kwargs = tree_map(lambda t: local if t is held else t, (args, kwargs))
            mine = func(*args, **kwargs)
            if isinstance(mine, torch.Tensor) and mine.shape == local.shape:
                mesh = held.device_mesh
                return mark_pieces(mine, mesh, pieces.parts, held.shape, pieces.whole, pieces.unit)
        elif func in KEEPS:
            out = func(*args, **kwargs)
            if isinstance(out, DTensor) and out.shape == held.shape:
                PIECES[out] = pieces
                return out
    raise TpplanError(
        f"{name} on a fused output held in its unequal pieces {list(pieces.parts)} (a DTensor "
        "region): DTensor has no layout for them, so only a cut at the pieces' bounds may "
        "read it. Fix: apply the plan with apply_plan(..., local_shards=True) (the default), "
        "or keep the fused layer split and gathered (output: replicate), and report the model."
    )


def _values(getter: Any) -> bool:
    """Whether a property getter hands out the tensor's values (`.data`, `.T`, `.grad`)."""
    owner = getattr(getter, "__self__", None)
    return getattr(owner, "__name__", "") in {"data", "T", "mT", "H", "mH", "grad", "real", "imag"}


def cut_spans(func: Any, x: torch.Tensor, rest: Any, kwargs: Any) -> list[tuple[int, int]] | None:
    """The [start, stop) runs of the last dim a cut takes, in order; None where it cuts
    another dim, or in a way other than these."""
    last = x.ndim - 1
    width = x.shape[last]
    if func is torch.Tensor.__getitem__:
        return _sliced(x, rest[0]) if rest else None
    if func in _NARROWS:
        dim, start, length = (list(rest) + [kwargs.get(k) for k in ("dim", "start", "length")])[:3]
        if not all(isinstance(v, int) for v in (dim, start, length)) or dim % x.ndim != last:
            return None
        start %= width
        return [(start, start + length)]
    how = rest[0] if rest else next(
        (kwargs[k] for k in ("split_size_or_sections", "split_sizes", "split_size", "chunks")
         if k in kwargs),
        None,
    )  # fmt: skip
    dim = rest[1] if len(rest) > 1 else kwargs.get("dim", 0)
    if not isinstance(dim, int) or dim % x.ndim != last or how is None:
        return None
    if func in (torch.Tensor.chunk, torch.chunk):
        if not isinstance(how, int) or how < 1:
            return None
        step = -(-width // how)
        sizes = [min(step, width - s) for s in range(0, width, step)]
    elif isinstance(how, int):
        sizes = [min(how, width - s) for s in range(0, width, how)]
    else:
        sizes = [int(n) for n in how]
    bounds = [0, *itertools.accumulate(sizes)]
    return list(itertools.pairwise(bounds))


def _sliced(x: torch.Tensor, index: Any) -> list[tuple[int, int]] | None:
    """The run a slice of the last dim takes, every other dim whole; None otherwise."""
    span = sliced_span(x, index, x.ndim - 1)
    return None if span is None else [span]


def sliced_span(x: torch.Tensor, index: Any, dim: int) -> tuple[int, int] | None:
    """(start, stop) of a slice `x[index]` takes of `dim` (step 1), every other dim whole;
    None for any other index."""
    cut = slice_dims(x, index)
    if cut is None:
        return None
    at = [(d, e) for d, e in cut if e != slice(None)]
    if len(at) != 1 or at[0][0] != dim or not isinstance(at[0][1], slice):
        return None
    start, stop, step = at[0][1].indices(x.shape[dim])
    return (start, stop) if step == 1 else None


def on_bounds(pieces: Pieces, start: int, stop: int) -> bool:
    """Whether [start, stop) is a run of whole pieces."""
    bounds = pieces.bounds()
    return start in bounds and stop in bounds and stop > start


def taken(x: DTensor, pieces: Pieces, start: int, stop: int, dim: int | None = None) -> DTensor:
    """The pieces from `start` to `stop` (both on the pieces' bounds) of `dim` (the last by
    default) as a DTensor of what this rank holds of them; a `TpplanError` where a bound
    falls inside a piece."""
    bounds = pieces.bounds()
    if not on_bounds(pieces, start, stop):
        raise TpplanError(
            f"a cut of [{start}, {stop}) from a fused output held in its pieces "
            f"{list(pieces.parts)} (a DTensor region) falls inside a piece: each rank holds "
            "its slice of every piece, so no rank holds that run. Fix: keep the fused layer "
            "split and gathered (output: replicate), and report the model."
        )
    i, j = bounds.index(start), bounds.index(stop)
    taken = pieces.parts[i:j]
    tp = x.device_mesh.size()
    local = x.to_local()
    last = x.ndim - 1 if dim is None else dim
    begin = sum(pieces.local(k, tp) for k in range(i))
    mine = local.narrow(last, begin, sum(pieces.local(k, tp) for k in range(i, j)))
    shape = list(x.shape)
    shape[last] = stop - start
    whole = [pieces.is_whole(k) for k in range(i, j)]
    if all(whole):
        # shared key/value heads: the rank's own head in each head's place, read only
        # where its query heads read it (check/regions_dtensor.py proves it)
        out = contiguous_dtensor(mine, x.device_mesh, [Replicate()], shape)
        if len(taken) == 1:
            FILLED[out] = filled_as(taken[0], pieces.unit, x.device_mesh)
        return out
    if len(set(taken)) > 1 or any(whole):
        flags = whole if any(whole) else ()
        return mark_pieces(mine, x.device_mesh, taken, shape, flags, pieces.unit)
    placement = StridedShard(last, split_factor=len(taken)) if len(taken) > 1 else Shard(last)
    return contiguous_dtensor(mine, x.device_mesh, [placement], shape)


def slice_dims(x: torch.Tensor, index: Any) -> list[tuple[int, Any]] | None:
    """[(dim, entry)] of an index of slices, ints and one Ellipsis; None for anything else
    (a new axis, a tensor index)."""
    index = index if isinstance(index, tuple) else (index,)
    if index.count(Ellipsis) > 1 or any(
        not isinstance(i, (slice, int)) and i is not Ellipsis for i in index
    ):
        return None
    at = index.index(Ellipsis) if Ellipsis in index else len(index)
    dims = list(range(at)) + list(range(x.ndim - (len(index) - at - 1), x.ndim))
    entries = [i for i in index if i is not Ellipsis]
    return list(zip(dims, entries, strict=True))


def contiguous_dtensor(local: torch.Tensor, mesh: Any, placements: Any, shape: Any) -> DTensor:
    """`local`, each rank's part, as a DTensor of global `shape` whose strides are a
    contiguous tensor's: stated, not inferred (inference would gather the shapes)."""
    shape = tuple(shape)
    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_strides(shape),
    )


def contiguous_strides(shape: Any) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (a DTensor made from a local shard
    states its global ones)."""
    out, n = [], 1
    for size in reversed(list(shape)):
        out.append(n)
        n *= size
    return tuple(reversed(out))


def in_every_place(own: torch.Tensor, heads: int) -> torch.Tensor:
    """`own` (one head, its features last) repeated into each of `heads` places."""
    return own.repeat(*([1] * (own.dim() - 1)), heads)


class Everywhere(torch.autograd.Function):
    """`own` (the rank's head, its features last) in each of `heads` places of the whole
    width. The backward takes the gradient of the own place (`at`, the rank's head) only:
    the whole gradient the region hands back is every rank's (summed over tp), so the
    head's share of it is divided by the `replicas` sharing the head, whose sums of weight
    and input gradients (`_SumOver`, colwise's input sum) count it once."""

    @staticmethod
    def forward(ctx: Any, own: torch.Tensor, heads: int, at: int, replicas: int) -> torch.Tensor:
        ctx.shape = (heads, at, replicas)
        return in_every_place(own, heads)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        heads, at, replicas = ctx.shape
        size = grad.shape[-1] // heads
        return grad.narrow(-1, at * size, size) / replicas, None, None, None


def whole_shared_pieces(
    own: torch.Tensor, parts: tuple[int, ...], unit: int, mesh: Any
) -> tuple[torch.Tensor, tuple[bool, ...]]:
    """A fused layer's own rows' output (`own`: its slice of each piece, one whole head of
    each piece of fewer heads of `unit` than ranks, as own_rows.py orders them) with each
    such piece's head in every head's place, for a region's code (`Everywhere`); and which
    pieces are so held whole."""
    tp = mesh.size()
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # a rank applying a plan is on its mesh
    shared = tuple(shares_a_head(n, tp, unit) for n in parts)
    sizes = [unit if s else n // tp for n, s in zip(parts, shared, strict=True)]
    out = []
    for n, s, piece in zip(parts, shared, own.split(sizes, dim=-1), strict=True):
        if s:
            heads = n // unit
            replicas = tp // heads
            piece = Everywhere.apply(piece, heads, coordinate[0] // replicas, replicas)
        out.append(piece)
    return torch.cat(out, dim=-1), shared
