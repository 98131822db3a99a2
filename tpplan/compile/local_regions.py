"""DTensor regions run on plain local tensors, their DTensor run being the proof.

A region (`Plan.regions`, regions.py) is a module whose own code computes sizes no plan
attribute can divide (`C // self.n_head` with C read from a shape, q|k|v cut at positions
from a shared config). On DTensors its code sees global shapes and DTensor carries the split,
which is right but costs DTensor's dispatch on every op, and leaves DTensors in whatever the
code keeps (KV caches). Here the region's code runs on each rank's local shards instead.

The proof run on fake ranks (check/run.py, `prove_local_regions`) runs the region on
DTensors with a `Recorder` on top: for every torch call the region's own code makes, it
notes at the call's *site* (the caller's code object and bytecode offset) what a rank must
do differently to compute its own shard of DTensor's result. The region's Python code keeps
seeing the numbers it saw on DTensors: a shape read of a split tensor answers the global
size (`_Shape`), so every size the code computes is global, as in the proof, and only the
calls that take sizes change:

- a size argument at a split dim (a view's heads, a split's width, slice bounds on fused
  pieces) becomes the shard's own (`_Sizes`, `_Split`, `_Slice`);
- a whole tensor meeting split ones (an ALiBi bias of every head, a zero position bias) is
  cut to the rank's part as DTensor lays it out; one that needs a gradient has it summed
  over the ranks, as DTensor's `from_local` does (`_Cuts`);
- a split tensor the module returns, beside what its closing layers sum, is handed back as
  a DTensor over the local shard (no collective until it is read, as on the DTensor path).

Each note is replayed at once on rank 0's local fake tensors and must give DTensor's local
shapes. A call that fits none of them (a reduction over the split dim, a whole tensor
written with split values, an index into the heads) leaves the region on DTensors with the
reason. At run time `run_locally` applies the notes by site through a TorchFunctionMode;
every other call runs untouched. Start at `Recorder`, then `run_locally`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import TpplanError
from .local_run import _rank, copy_to_ranks, group_name

__all__ = ["NotLocal", "Recorder", "RegionNotes", "run_locally"]

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


def _site() -> Site | None:
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


def _where(site: Site) -> str:
    code, lasti = site
    line = next((ln for start, end, ln in code.co_lines() if start <= lasti < end), None)
    return f"{os.path.basename(code.co_filename)}:{line} ({code.co_name})"


class NotLocal(Exception):
    """A region call that no local rewrite reproduces; the region stays on DTensors."""


@dataclass(frozen=True)
class _Context:
    """What a rewrite needs of the rank: the tp size, its index (an int, or on simulated
    ranks each rank's own), the mesh and its group's name."""

    tp: int
    rank: Any
    mesh: DeviceMesh
    group: str


def _context(mesh: DeviceMesh) -> _Context:
    return _Context(mesh.size(), _rank(mesh), mesh, group_name(mesh))


# --- size arguments ------------------------------------------------------------------------

_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape}
_NEW = {
    torch.Tensor.new_empty,
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_full,
}
_EXPAND = {torch.Tensor.expand}
_SPLITS: set[Any] = {
    torch.Tensor.split,
    torch.split,
    torch.Tensor.split_with_sizes,
    torch.split_with_sizes,
}
_SLICES = {torch.Tensor.__getitem__}
_NARROW = {torch.Tensor.narrow, torch.narrow}


def _is_size(x: Any) -> bool:
    return isinstance(x, (tuple, list, torch.Size)) and all(isinstance(n, int) for n in x)


def _sizes_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int] | None:
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


def _placement_dim(t: Any) -> tuple[int, Any] | None:
    """(dim, placement) of a DTensor split on a 1-D mesh; None for a whole tensor."""
    if not isinstance(t, DTensor) or len(t.placements) != 1:
        return None
    p = t.placements[0]
    if isinstance(p, (Shard, _StridedShard)):
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
class _Sizes:
    """A view, reshape, expand or new_* whose size at a split dim is global: the rank's."""

    dims: frozenset[int]
    """The output dims that are split."""

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: _Context) -> Any:
        sizes = _sizes_of(func, args, kwargs)
        if sizes is None:
            return args, kwargs
        new = list(sizes)
        for d in self.dims:
            if d < len(new) and new[d] != -1:
                new[d] = _divided(new[d], ctx.tp, f"dim {d} of {getattr(func, '__name__', func)}")
        return _with_sizes(func, args, kwargs, new)


@dataclass
class _Split:
    """A split along a split dim at global widths: each width becomes the rank's share."""

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: _Context) -> Any:
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
class _Shape:
    """A shape read of a split tensor: the global size at its split dim, as in the proof."""

    dim: int

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: _Context) -> Any:
        return args, kwargs

    def after(self, func: Any, args: Any, out: Any, ctx: _Context) -> Any:
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


def _reads_shape(func: Any) -> bool:
    return func in _SHAPES or func == _SHAPE_GET


def _slice_dims(x: torch.Tensor, index: Any) -> list[tuple[int, Any]] | None:
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


@dataclass
class _Slice:
    """A slice on a split dim cut on the bounds of fused pieces split alike (q|k|v cut at
    positions from a config): each bound becomes the rank's."""

    dim: int

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: _Context) -> Any:
        x, index = args[0], args[1]
        cut = _slice_dims(x, index)
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


# --- whole tensors meeting split ones --------------------------------------------------------


@dataclass(frozen=True)
class _Cut:
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


def _own_part(t: torch.Tensor, dim: int, factor: int, ctx: _Context) -> torch.Tensor:
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
class _Cuts:
    cuts: tuple[_Cut, ...]

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: _Context) -> Any:
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
    def _local(t: torch.Tensor, cut: _Cut, leaves: list[Any]) -> bool:
        if cut.ref is None or cut.dim is None:
            return False
        ref = leaves[cut.ref[0]]
        return isinstance(ref, torch.Tensor) and t.shape[cut.dim] == ref.shape[cut.ref[1]]


@dataclass
class _Call:
    """Everything one site does differently on local tensors, in order."""

    steps: list[Any]

    def rewrite(self, func: Any, args: Any, kwargs: Any, ctx: _Context) -> Any:
        for step in self.steps:
            args, kwargs = step.rewrite(func, args, kwargs, ctx)
        return args, kwargs

    def call(self, func: Any, args: Any, kwargs: Any, ctx: _Context) -> Any:
        """The call on local tensors: arguments rewritten, a shape read answered global."""
        new_args, new_kwargs = self.rewrite(func, args, kwargs, ctx)
        out = func(*new_args, **new_kwargs)
        for step in self.steps:
            if isinstance(step, _Shape):
                out = step.after(func, new_args, out, ctx)
        return out


# --- the proof side ---------------------------------------------------------------------------


def _whole(t: Any) -> bool:
    if isinstance(t, DTensor):
        return all(isinstance(p, Replicate) for p in t.placements)
    return isinstance(t, torch.Tensor) and t.dim() > 0


def _local_shape(t: Any) -> Any:
    if isinstance(t, DTensor):
        return tuple(t._local_tensor.shape)
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _plain_leaf(t: Any) -> Any:
    if isinstance(t, DTensor):
        return t._local_tensor  # rank 0's on the fake mesh of the proof
    return t


@dataclass
class RegionNotes:
    """What the proof found for one region's class: a rewrite per site, or why not."""

    sites: dict[Site, _Call] = field(default_factory=dict)
    seen: dict[Site, list[Any]] = field(default_factory=dict)
    """Every site the region's code called, with its rewrite (empty: none)."""
    outputs: dict[Any, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    """{output tree spec: ((leaf, dim), ...) of the split tensors returned}."""
    refused: str | None = None
    ran: bool = False
    """Whether a module of the class ran in the proof at all."""

    def refuse(self, why: str) -> None:
        if self.refused is None:
            self.refused = why


class Recorder(TorchFunctionMode):
    """Entered above the DTensor region's own mode in the proof run: notes each call of the
    region's own code (see the module docstring) and replays it on local tensors."""

    def __init__(self, notes: RegionNotes, mesh: DeviceMesh) -> None:
        super().__init__()
        self.notes = notes
        self.ctx = _Context(mesh.size(), 0, mesh, group_name(mesh))
        self.inside_layer = 0
        """>0 while a split layer's own forward runs (its calls are the layer's, not the
        region's)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        site = None if self.inside_layer else _site()
        out = func(*args, **kwargs)
        if site is not None and self.notes.refused is None:
            try:
                self._note(site, func, args, kwargs, out)
            except NotLocal as e:
                self.notes.refuse(f"{getattr(func, '__name__', func)} at {_where(site)}: {e}")
        return out

    def _note(self, site: Site, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        leaves, _ = tree_flatten((args, kwargs))
        outs, _ = tree_flatten(out)
        split_in = [t for t in leaves if _placement_dim(t) is not None]
        split_out = [t for t in outs if _placement_dim(t) is not None]
        if any(
            isinstance(t, DTensor) and _placement_dim(t) is None and not _whole(t)
            for t in [*leaves, *outs]
        ):
            raise NotLocal("a partial sum or a layout other than one split dim")
        steps = self._steps(func, args, kwargs, leaves, split_in, split_out)
        self._merge(site, steps)
        if (split_in or split_out) and not _reads_shape(func):
            self._replay(site, func, args, kwargs, outs)

    def _steps(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        leaves: list[Any],
        split_in: list[Any],
        split_out: list[Any],
    ) -> list[Any]:
        steps: list[Any] = []
        at = _placement_dim(args[0]) if args else None
        if _reads_shape(func):
            return [_Shape(at[0])] if at is not None else []
        # what whole tensors meet: the split result, or the split tensor written into
        written = args[0] if func is torch.Tensor.__setitem__ and at is not None else None
        target = split_out[0] if split_out else written
        if target is not None:
            cuts = self._cuts(func, leaves, target)
            if cuts:
                steps.append(_Cuts(cuts))
        if func in _VIEWS | _NEW | _EXPAND and split_out:
            sizes = _sizes_of(func, args, kwargs)
            d, _ = _placement_dim(split_out[0])  # type: ignore[misc]
            if sizes is not None and d < len(sizes) and sizes[d] != -1:
                steps.append(_Sizes(frozenset({d})))
        elif func in _SPLITS and at is not None:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            if at[0] == dim % args[0].ndim:
                steps.append(_Split())
        elif func in _SLICES and at is not None:
            cut = _slice_dims(args[0], args[1])
            if cut is None or any(d == at[0] and isinstance(e, int) for d, e in cut):
                raise NotLocal("an index into the split dim other than a slice")
            if any(d == at[0] and isinstance(e, slice) and e != slice(None) for d, e in cut):
                if not isinstance(at[1], _StridedShard):
                    raise NotLocal("a slice of the split dim that is not a fused piece")
                steps.append(_Slice(at[0]))
        elif func in _NARROW and at is not None:
            raise NotLocal("narrow on a split tensor")
        return steps

    def _merge(self, site: Site, steps: list[Any]) -> None:
        """One rewrite per site: a site that needs another one call by call (a helper shaping
        split and whole tensors alike) cannot be told apart at run time."""
        have = self.notes.seen.setdefault(site, steps)
        if have != steps:
            raise NotLocal("one site called with split and whole tensors alike")
        if steps:
            self.notes.sites[site] = _Call(steps)

    def _cuts(self, func: Any, leaves: list[Any], out: DTensor) -> tuple[_Cut, ...]:
        """Whole tensors meeting split ones: cut where they are full-size on the dim
        aligned (from the right) with the output's split dim, used whole otherwise; a
        whole tensor written in place with split values cannot be local."""
        d, p = _placement_dim(out)  # type: ignore[misc]
        piece = out.shape[d] // int(p.split_factor) if isinstance(p, _StridedShard) else None
        name = getattr(func, "__name__", "")
        ref = None
        for j, t in enumerate(leaves):
            at_split = _placement_dim(t)
            if at_split is not None and at_split[0] == d - (out.ndim - t.ndim):
                ref = (j, at_split[0])
                break
        cuts = []
        for i, t in enumerate(leaves):
            if not _whole(t):
                continue
            if i == 0 and (name == "__setitem__" or (name.endswith("_") and name[:1] != "_")):
                raise NotLocal("a whole tensor written in place with split values")
            at = d - (out.ndim - t.dim())
            cut_dim = at if 0 <= at < t.dim() and t.shape[at] == out.shape[d] > 1 else None
            if cut_dim is not None or t.requires_grad:
                cuts.append(_Cut(i, cut_dim, piece, ref))
        return tuple(cuts)

    def _replay(self, site: Site, func: Any, args: Any, kwargs: Any, outs: list[Any]) -> None:
        """The call again on rank 0's local tensors, rewritten as the run will: it must give
        DTensor's local shapes."""
        leaves, spec = tree_flatten((args, kwargs))
        largs, lkwargs = tree_unflatten([_plain_leaf(t) for t in leaves], spec)
        call = self.notes.sites.get(site)
        with torch.no_grad():
            try:
                if call is not None:
                    largs, lkwargs = call.rewrite(func, largs, lkwargs, self.ctx)
                got = func(*largs, **lkwargs)
            except Exception as e:
                raise NotLocal(f"fails on local tensors ({type(e).__name__}: {e})") from None
        got_leaves, _ = tree_flatten(got)
        want = [_local_shape(t) for t in outs]
        have = [_local_shape(t) for t in got_leaves]
        if want != have:
            raise NotLocal(f"local shapes {have} where DTensor's are {want}")


def note_outputs(notes: RegionNotes, out: Any) -> Any:
    """The split tensors a region returns, noted by the output's structure (handed back as
    DTensors at run time, as the proof's DTensor run returns them); the output, unchanged."""
    leaves, spec = tree_flatten(out)
    split = []
    for i, t in enumerate(leaves):
        at = _placement_dim(t)
        if at is not None:
            if not isinstance(at[1], Shard):
                notes.refuse("it returns a tensor split as fused pieces")
            split.append((i, at[0]))
    notes.outputs[spec] = tuple(split)
    return out


# --- the run side ------------------------------------------------------------------------------


class _LocalRegion(TorchFunctionMode):
    """The region's notes applied by site; every other call untouched."""

    def __init__(self, notes: RegionNotes, ctx: _Context) -> None:
        super().__init__()
        self.sites = notes.sites
        self.ctx = ctx

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        call = self.sites.get(_site())  # type: ignore[arg-type]
        if call is None:
            return func(*args, **kwargs)
        return call.call(func, args, kwargs, self.ctx)


def _returned(out: Any, notes: RegionNotes, ctx: _Context, name: str) -> Any:
    leaves, spec = tree_flatten(out)
    split = notes.outputs.get(spec)
    if split is None:
        raise TpplanError(
            f"{name} (a DTensor region run on local shards) returned outputs shaped unlike "
            "those its proof saw (output_attentions, say), which may hold split tensors. Fix: "
            "apply the plan with apply_plan(..., local_shards=False) to run it on DTensors."
        )
    for i, dim in split:
        # no gather here: most such outputs are thrown away by the caller (BLOOM returns its
        # attention probabilities at every call); as a DTensor it costs nothing until read,
        # and reads as the whole tensor (`full_tensor()`), as on the DTensor path
        t = leaves[i]
        shape = list(t.shape)
        shape[dim] *= ctx.tp
        leaves[i] = DTensor.from_local(
            t,
            ctx.mesh,
            [Shard(dim)],
            run_check=False,
            shape=torch.Size(shape),
            stride=_strides(shape),
        )
    return tree_unflatten(leaves, spec)


def _strides(shape: list[int]) -> tuple[int, ...]:
    out, n = [], 1
    for size in reversed(shape):
        out.append(n)
        n *= size
    return tuple(reversed(out))


def run_locally(module: nn.Module, notes: RegionNotes, mesh: DeviceMesh, name: str) -> None:
    """Run `module`'s forward on local tensors under its region's notes; idempotent."""
    if getattr(module, "_tpplan_local_region", False):
        return
    ctx = _context(mesh)
    modes: list[_LocalRegion] = []

    def enter(m: nn.Module, args: Any) -> None:
        mode = _LocalRegion(notes, ctx)
        mode.__enter__()
        modes.append(mode)

    def leave(m: nn.Module, args: Any, out: Any) -> Any:
        if modes:
            modes.pop().__exit__(None, None, None)
        return None if out is None else _returned(out, notes, ctx, name)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    module._tpplan_local_region = True  # type: ignore[assignment]
