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
every other call runs untouched. Start at `Recorder`, then `run_locally`; the notes themselves are in region_rewrites.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from .._runtime.torch_compat import StridedShard, tree_flatten, tree_unflatten
from ..errors import TpplanError
from .local_run import group_name
from .region_pieces import contiguous_dtensor, contiguous_strides, held_in_pieces
from .region_rewrites import (
    EXPAND,
    NARROW,
    NEW,
    NORMS,
    SLICES,
    SPLITS,
    SUMS,
    VIEWS,
    Call,
    Context,
    Cut,
    Cuts,
    Narrow,
    NotLocal,
    Shape,
    Site,
    Sizes,
    Slice,
    Split,
    call_site,
    context,
    placement_dim,
    reads_shape,
    sizes_of,
    slice_dims,
    where,
)

__all__ = [
    "NotLocal",
    "Recorder",
    "RegionNotes",
    "contiguous_strides",
    "note_outputs",
    "run_locally",
]


# --- the proof side ---------------------------------------------------------------------------


def reduces_split(func: Any, args: Any, kwargs: Any, dim: int) -> bool:
    """Whether `func` sums, averages or normalizes over `dim` of its first argument (its
    split dim): a norm over the last dims, a sum or mean over the dims it is given."""
    x = args[0]
    if func in NORMS:
        shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape", ())
        return dim >= x.ndim - len([shape] if isinstance(shape, int) else shape)
    if func in SUMS:
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if dims is None:
            return True
        return dim in {d % x.ndim for d in ([dims] if isinstance(dims, int) else dims)}
    return False


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

    sites: dict[Site, Call] = field(default_factory=dict)
    funcs: set[Any] = field(default_factory=set)
    """The torch functions called at the sites in `sites`: any other call passes through at
    run time without looking for its site (a frame walk per call, the mode's main cost)."""
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


def _grouped_whole(args: Any, kwargs: Any) -> None:
    """SDPA with `enable_gqa` on several key/value heads given whole beside split query heads:
    regions.py repeats them to the query's heads before each rank takes its own, which no
    note replays, and torch's grouping of a rank's few query heads over every key/value head
    pairs them wrongly. So such a region stays on DTensors."""
    given = dict(zip(("query", "key", "value"), args, strict=False)) | kwargs
    query, key = given.get("query"), given.get("key")
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return
    split_query = placement_dim(query) is not None and query.dim() > 2
    # one key/value head serves every query head wherever they are
    grouped = key.dim() > 2 and key.shape[-3] not in (1, query.shape[-3])
    if split_query and placement_dim(key) is None and grouped:
        raise NotLocal(
            "SDPA with enable_gqa on key/value heads used whole, fewer than the split "
            "query heads (each rank's query heads would meet the wrong ones)"
        )


class Recorder(TorchFunctionMode):
    """Entered above the DTensor region's own mode in the proof run: notes each call of the
    region's own code (see the module docstring) and replays it on local tensors."""

    def __init__(self, notes: RegionNotes, mesh: DeviceMesh) -> None:
        super().__init__()
        self.notes = notes
        self.ctx = Context(mesh.size(), 0, mesh, group_name(mesh))
        self.inside_layer = 0
        """>0 while a split layer's own forward runs (its calls are the layer's, not the
        region's)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        site = None if self.inside_layer else call_site()
        out = func(*args, **kwargs)
        if site is not None and self.notes.refused is None:
            try:
                self._note(site, func, args, kwargs, out)
            except NotLocal as e:
                self.notes.refuse(f"{getattr(func, '__name__', func)} at {where(site)}: {e}")
        return out

    def _note(self, site: Site, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if func is F.scaled_dot_product_attention and kwargs.get("enable_gqa"):
            _grouped_whole(args, kwargs)
        leaves, _ = tree_flatten((args, kwargs))
        if any(getattr(held_in_pieces(t), "whole", ()) for t in leaves):
            raise NotLocal(
                "a fused output whose key/value heads ranks share, held in its pieces (no note "
                "gives a rank's cuts of them)"
            )
        outs, _ = tree_flatten(out)
        split_in = [t for t in leaves if placement_dim(t) is not None]
        split_out = [t for t in outs if placement_dim(t) is not None]
        if any(
            isinstance(t, DTensor) and placement_dim(t) is None and not _whole(t)
            for t in [*leaves, *outs]
        ):
            raise NotLocal("a partial sum or a layout other than one split dim")
        steps = self._steps(func, args, kwargs, leaves, split_in, split_out)
        self._merge(site, func, steps)
        if (split_in or split_out) and not reads_shape(func):
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
        at = placement_dim(args[0]) if args else None
        if reads_shape(func):
            return [Shape(at[0])] if at is not None else []
        if at is not None and reduces_split(func, args, kwargs, at[0]):
            # DTensor sums it over the ranks; on local shards it would read one rank's part
            raise NotLocal("a sum, mean or norm over the split dim")
        # what whole tensors meet: the split result, or the split tensor written into
        written = args[0] if func is torch.Tensor.__setitem__ and at is not None else None
        target = split_out[0] if split_out else written
        if target is not None:
            cuts = self._cuts(func, leaves, target)
            if cuts:
                steps.append(Cuts(cuts))
        if func in VIEWS | NEW | EXPAND and split_out:
            sizes = sizes_of(func, args, kwargs)
            d, _ = placement_dim(split_out[0])  # type: ignore[misc]
            if sizes is not None and d < len(sizes) and sizes[d] != -1:
                steps.append(Sizes(frozenset({d})))
        elif func in SPLITS and at is not None:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            if at[0] == dim % args[0].ndim:
                steps.append(Split())
        elif func in SLICES and at is not None:
            cut = slice_dims(args[0], args[1])
            if cut is None or any(d == at[0] and isinstance(e, int) for d, e in cut):
                raise NotLocal("an index into the split dim other than a slice")
            if any(d == at[0] and isinstance(e, slice) and e != slice(None) for d, e in cut):
                if not isinstance(at[1], StridedShard) and held_in_pieces(args[0]) is None:
                    raise NotLocal("a slice of the split dim that is not a fused piece")
                steps.append(Slice(at[0]))
        elif func in NARROW and at is not None:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if not isinstance(dim, int) or dim % args[0].ndim != at[0]:
                raise NotLocal("narrow on a split tensor")
            if not isinstance(at[1], StridedShard) and held_in_pieces(args[0]) is None:
                raise NotLocal("a narrow of the split dim that is not a fused piece")
            steps.append(Narrow())
        return steps

    def _merge(self, site: Site, func: Any, steps: list[Any]) -> None:
        """One rewrite per site: a site that needs another one call by call (a helper shaping
        split and whole tensors alike) cannot be told apart at run time."""
        have = self.notes.seen.setdefault(site, steps)
        if have != steps:
            raise NotLocal("one site called with split and whole tensors alike")
        if steps:
            self.notes.sites[site] = Call(steps)
            self.notes.funcs.add(func)

    def _cuts(self, func: Any, leaves: list[Any], out: DTensor) -> tuple[Cut, ...]:
        """Whole tensors meeting split ones: cut where they are full-size on the dim
        aligned (from the right) with the output's split dim, used whole otherwise; a
        whole tensor written in place with split values cannot be local."""
        d, p = placement_dim(out)  # type: ignore[misc]
        piece = out.shape[d] // int(p.split_factor) if isinstance(p, StridedShard) else None
        name = getattr(func, "__name__", "")
        ref = None
        for j, t in enumerate(leaves):
            at_split = placement_dim(t)
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
                cuts.append(Cut(i, cut_dim, piece, ref))
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
        at = placement_dim(t)
        if at is not None:
            if not isinstance(at[1], Shard):
                notes.refuse("it returns a tensor split as fused pieces")
            split.append((i, at[0]))
    notes.outputs[spec] = tuple(split)
    return out


# --- the run side ------------------------------------------------------------------------------


class _LocalRegion(TorchFunctionMode):
    """The region's notes applied by site; every other call untouched."""

    def __init__(self, notes: RegionNotes, ctx: Context) -> None:
        super().__init__()
        self.sites = notes.sites
        self.funcs = notes.funcs
        self.ctx = ctx

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        call = self.sites.get(call_site()) if func in self.funcs else None  # type: ignore[arg-type]
        if call is None:
            return func(*args, **kwargs)
        return call.call(func, args, kwargs, self.ctx)


def _returned(out: Any, notes: RegionNotes, ctx: Context, name: str) -> Any:
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
        leaves[i] = contiguous_dtensor(t, ctx.mesh, [Shard(dim)], shape)
    return tree_unflatten(leaves, spec)


@dataclass(frozen=True)
class _RegionRun:
    """What a region's local forward reads: its notes, the rank's context, its name. A deep
    copy of the model shares it (the notes hold for the copy, and the mesh is the same)."""

    notes: RegionNotes
    ctx: Context
    name: str

    def __deepcopy__(self, memo: Any) -> _RegionRun:
        return self


def run_locally(module: nn.Module, notes: RegionNotes, mesh: DeviceMesh, name: str) -> None:
    """Run `module`'s forward on local tensors under its region's notes; idempotent. What
    it needs is kept on the module and the forward bound to it, so that a deep copy of the
    model runs its own forward (a closure would run the original's)."""
    if getattr(module, "_tpplan_local_region", False):
        return
    module.__dict__["_tpplan_region_run"] = _RegionRun(notes, context(mesh), name)
    module.__dict__["_tpplan_region_forward"] = module.forward
    module.forward = _local_forward.__get__(module)
    module._tpplan_local_region = True  # type: ignore[assignment]


# torch.compile cannot trace the mode (it finds call sites by their frames): in a compiled
# model the region runs eagerly, every call the same as without compile, and the rest of the
# model is compiled around it
@torch.compiler.disable
def _local_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    run: _RegionRun = self.__dict__["_tpplan_region_run"]
    with _LocalRegion(run.notes, run.ctx):
        out = self.__dict__["_tpplan_region_forward"](*args, **kwargs)
    return None if out is None else _returned(out, run.notes, run.ctx, run.name)
