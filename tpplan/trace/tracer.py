"""The tracer: run a model once on fake tensors and record where each Linear's output features go.

Start at `trace_model`; it returns a `Trace`, a bag of facts that `tpplan/infer/decide.py` turns into
rules. Nothing here decides a style.

How it works. The model is copied onto fake tensors (shapes and dtypes, no storage), hooks mark
every nn.Linear / nn.Embedding call, and a TorchDispatchMode sees every aten op in between. The
output of a Linear called on an unsplit input gets a `Split`: "dim d of this tensor holds that
Linear's output features; splitting them into tp contiguous chunks splits this dim so". Each op
either carries the Split to its outputs (element-wise ops, views, transposes, batched matmuls,
attention over heads) or ends it (a reduction, softmax or norm over the split dim, an op we do
not know); an ended Split marks its source Linears `broken` with the reason. A Split that arrives
at a Linear on its contracted input dim marks that Linear a closer. Names are recorded only to
report facts; the decisions follow the data flow alone.

Long stacks of identical blocks are traced through a prefix that holds each distinct block
structure (at least two blocks), so a 126-layer model costs what a 2-layer one does;
`Trace.stand_ins` says which traced block stands for which untraced one.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .._runtime.inputs import example_inputs as _derived_inputs
from .._runtime.local import outside_simulation
from .._runtime.lookup import put_in_lookup_place
from .._runtime.tree import tensor_leaves
from ..errors import TpplanError
from .record import Trace
from .split import (
    Split,
    SplitEnds,
    after_reduce,
    carved,
    every_step,
    merge,
    norm_dim,
    permutation,
    reshape,
)

__all__ = ["Trace", "TraceError", "trace_model"]


class TraceError(TpplanError, RuntimeError):
    """The model could not be run on fake tensors to trace it."""


# ---- op vocabulary -------------------------------------------------------------------------
# Ops that look at a tensor's metadata only.
_METADATA = {
    "device",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "dim",
    "is_contiguous",
}
# Element-wise ops that carry no pointwise tag; anything tagged pointwise is element-wise too.
_ELEMENTWISE = {
    "where", "_to_copy", "clone", "alias", "detach", "lift_fresh", "native_dropout",
    "masked_fill", "fill_", "zero_", "copy_", "contiguous", "dropout",
}  # fmt: skip
_RESHAPES = {
    "view",
    "_unsafe_view",
    "reshape",
    "_reshape_alias",
    "unsqueeze",
    "squeeze",
    "view_as",
    "flatten",
    "unflatten",
}
_SAME_SHAPE_OVER_DIM = {
    "_softmax",
    "_safe_softmax",
    "_log_softmax",
    "softmax",
    "log_softmax",
    "cumsum",
    "cumprod",
    "logcumsumexp",
}
_REDUCTIONS = {
    "sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "std_mean", "prod",
    "logsumexp", "norm", "linalg_vector_norm", "argmax", "argmin", "any", "all",
}  # fmt: skip
_SPLITS = {
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "unsafe_split",
    "unsafe_split_with_sizes",
    "tensor_split",
}
_NORMS = {"native_layer_norm", "_fused_rms_norm", "rms_norm", "layer_norm"}
# Ops whose output is the same data as their one input: a parameter or a model input passed
# through them is still that parameter or input.
# Ops making a tensor whose values are the same along every dim it is given a size for:
# sized by a split dim read just before, it is split like that dim (`sized_by_a_shard`).
_NEW_FROM = {"new_empty", "new_zeros", "new_ones"}
_SHARD_SIZED = _NEW_FROM | {"empty", "zeros", "ones", "expand"}
_PASS_THROUGH = _RESHAPES | {
    "alias",
    "detach",
    "t",
    "transpose",
    "permute",
    "expand",
    "_to_copy",
    "clone",
    "lift_fresh",
    "slice",
    "contiguous",
}


# Ops whose integer arguments size a tensor (views, expansions, new tensors).
_SIZED = _RESHAPES | {
    "expand", "new_zeros", "new_ones", "new_empty", "new_full", "zeros", "ones", "empty", "full",
    "arange", "repeat", "split", "split_with_sizes", "narrow", "slice",
}  # fmt: skip


# Ops linear in their first argument (a partial sum), given plain other arguments.
_LINEAR_IN_PARTIAL = _RESHAPES | {
    "t", "transpose", "permute", "_to_copy", "clone", "contiguous", "alias", "detach",
    "index", "index_select", "select", "slice", "narrow", "sum", "expand", "gather", "neg",
}  # fmt: skip
# Sums of tensors that must all be partial sums (or per-expert biases, added once).
_ADDS = {
    "add", "add_", "sub", "sub_", "index_add", "index_add_", "index_put", "index_put_",
    "scatter_add", "scatter_add_", "cat", "stack",
}  # fmt: skip


_COPIES = {"clone", "contiguous", "alias", "_reshape_alias", "_to_copy"}


def run_op(func: Any, args: Any, kwargs: Any) -> Any:
    """The op, on fake or meta tensors too. The meta kernel of the grouped matmul
    (mixture-of-experts layers) takes bf16 only, though CPU runs it in fp32: its shapes are
    the same, so it is asked in bf16 and the result given the dtype the real op would have."""
    if (
        func is torch.ops.aten._grouped_mm.default
        and args[0].dtype == torch.float32
        and (isinstance(args[0], FakeTensor) or args[0].device.type == "meta")
    ):
        half = [
            a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args
        ]
        return func(*half, **kwargs).to(torch.float32)
    return func(*args, **kwargs)


class _Tracer(TorchDispatchMode):
    """Carries Splits from op to op; see the module docstring."""

    def __init__(self, trace: Trace, params: dict[int, str]) -> None:
        super().__init__()
        self.trace = trace
        self.splits: dict[int, tuple[torch.Tensor, Split]] = {}
        # Tensors that are (views or copies of) a parameter or the model's input; the tensors
        # are held so that their ids stay unique while traced.
        self.params: dict[int, tuple[Any, str]] = {i: (None, n) for i, n in params.items()}
        # Tensors computed from parameters (id -> tensor): in training they carry a gradient
        # back to the weights (see `carries`).
        self.carrying: dict[int, torch.Tensor] = {}
        self.inputs: dict[int, torch.Tensor] = {}
        # Layers an earlier pass found could not stay split (see `_settled`): their outputs
        # are whole from the start, with the reasons that pass gave.
        self.whole: dict[str, list[str]] = {}
        self.quiet = 0  # > 0 inside a hooked module or a whole-op rule: ops there are not ours
        # Integer attributes of modules read by each running forward, innermost last:
        # (module, attribute, value). A count or size an op is given was read by the forward
        # that calls the op (or one enclosing it), so these say which attribute a number came
        # from (see `_watch_reads`); reads inside a finished child forward are dropped.
        self.reads: list[list[tuple[str, str, int]]] = [[]]
        self.chunking = 0  # > 0 inside Tensor.chunk: its split cuts into equal parts by count
        # The sizes of the running view or reshape as the model wrote them: a reshape reaches
        # dispatch as a copy and `_unsafe_view` with -1 already resolved.
        self.asked: list[tuple[Any, ...]] = []
        # Sizes of split dims read off split tensors since the last op (`x.shape`): a count
        # taken so is each shard's own.
        self.shapes_read: set[int] = set()
        # The same sizes -> the split they were read off (dim, outer, n, inner, sources).
        self.shape_splits: dict[int, Split] = {}
        self.embedding_calls: list[str] = []  # the Embedding modules whose forward is running
        self.slots: list[str] = []  # ... of those, whose nn.Embedding.forward is running
        self.slotted: set[str] = set()  # Embedding subclasses whose forward is their own
        # Per running Embedding forward: the tensors linear in its lookup's rows (id ->
        # tensor), and the first op that was not linear in them.
        self.looked_up: list[tuple[dict[int, torch.Tensor], list[str]]] = []
        self.fresh: list[tuple[str, str, int]] = []  # attribute reads since the last op
        self.held: list[torch.Tensor] = []  # tensors whose ids the trace records
        # Parameters (2-D or 3-D) of modules that hold 3-D expert weights, and views of them:
        # id -> (view, parameter, the stored dim behind each dim of the view; None if new).
        self.expert_params: set[str] = set()
        self.views: dict[int, tuple[torch.Tensor, str, tuple[int | None, ...]]] = {}
        # Tensors holding each rank's partial sum of expert outputs (closing expert matmuls
        # and what is linear in them): id -> (tensor, sources). Zeros are a partial sum of
        # nothing (empty sources): an accumulator they start may take partial sums.
        self.partials: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}
        # Outputs of parameter-free submodules of experts modules made without the split
        # weights (an identity expert's tokens), and what is linear in them: id -> (tensor,
        # the submodules). Each rank computes them whole, so one added to the partial sums
        # is scaled 1/tp by the plan; `whole_owner`: submodule -> its experts module.
        self.wholes: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}
        self.whole_owner: dict[str, str] = {}
        self.running: list[str] = []  # experts modules whose forward is running, innermost last
        # Routing weights an experts module was given, and views of them; partial sums they
        # scaled (id -> tensor).
        # Views of 1-D parameters (`sinks.view(1, -1, 1)`): id -> (view, parameter, the dim
        # of the view holding the parameter's entries).
        self.vectors: dict[int, tuple[torch.Tensor, str, int]] = {}
        self.routing: dict[int, torch.Tensor] = {}
        self.weighted: dict[int, torch.Tensor] = {}

    # ---- bookkeeping ------------------------------------------------------------------
    def split_of(self, t: Any) -> Split | None:
        entry = self.splits.get(id(t)) if isinstance(t, torch.Tensor) else None
        if entry is None or entry[0] is not t:
            return None
        # Once every layer behind a split has had it end somewhere, none of them will stay
        # split (each is kept whole or gathered), so what follows sees whole tensors: a
        # normed latent (DeepSeek's q_a_proj) does not tie the next layer into its region.
        if all(src in self.trace.regions.broken for src in entry[1].sources):
            return None
        return entry[1]

    def mark(self, t: torch.Tensor, split: Split, op: str) -> None:
        self.splits[id(t)] = (t, split)
        if len(split.sources) == 1:
            (src,) = split.sources
            if (
                split.n < self.trace.regions.openers.get(src, 0)
                and src not in self.trace.regions.parts
            ):
                self.trace.regions.heads.setdefault(
                    src, split.n
                )  # the first view into (heads, head_dim)
        for s in split.sources:
            self.trace.regions.units[s] = math.gcd(
                self.trace.regions.units.get(s, split.n), split.n
            )
            self.trace.regions.ops.setdefault(s, set()).add(op)
        if len(split.sources) > 1:
            self.trace.regions.links.add(split.sources)

    def param_of(self, t: Any) -> str | None:
        entry = self.params.get(id(t))
        return entry[1] if entry is not None and (entry[0] is None or entry[0] is t) else None

    def expert_view(self, t: Any) -> tuple[str, tuple[int | None, ...]] | None:
        """(expert parameter, stored dim behind each dim) when `t` is one or a view of one."""
        if not isinstance(t, torch.Tensor):
            return None
        view = self.views.get(id(t))
        if view is not None and view[0] is t:
            return view[1], view[2]
        entry = self.params.get(id(t))
        if entry is not None and entry[0] is None and entry[1] in self.expert_params:
            return entry[1], tuple(range(t.dim()))
        return None

    def vector_view(self, t: Any) -> tuple[str, int] | None:
        """(1-D parameter, the dim of `t` holding its entries) when `t` is one, a view of
        one, or computed from one alone (`sinks.float()`)."""
        if not isinstance(t, torch.Tensor):
            return None
        view = self.vectors.get(id(t))
        if view is not None and view[0] is t:
            return view[1], view[2]
        name = self.param_of(t)
        if name is None or t.dim() != 1 or name in self.expert_params:
            return None
        return name, 0

    def carries(self, t: Any) -> bool:
        """True when `t` is computed from parameters, so that training sends a gradient
        through it to the weights (the trace itself runs without autograd)."""
        if not isinstance(t, torch.Tensor):
            return False
        entry = self.carrying.get(id(t))
        return (entry is not None and entry is t) or self.param_of(t) is not None

    def side_input(self, t: torch.Tensor, s: Split, op: str) -> None:
        """An unsplit tensor computed from the weights (not a parameter: those get rules of
        their own) meeting split features inside a region, broadcast across them: on each
        rank its gradient sums over that rank's features only, and no collective adds the
        ranks' partial sums, so the weights behind it would train wrong. Experts modules
        are exempt: their style sums the gradients of everything they are given."""
        if not self.carries(t) or self.param_of(t) is not None or self.vector_view(t):
            return
        if any(src in self.expert_params for src in s.sources):
            return
        raise SplitEnds(
            f"{op} meets an unsplit tensor computed from the weights (broadcast over the split "
            "dim): its gradient would be each rank's partial sum, with nothing to add them up"
        )

    def running_param(self, t: Any) -> tuple[str, tuple[int | None, ...]] | None:
        """(name, ()) when `t` is a parameter of the innermost experts module running, held
        by that module itself (JetMoE's bias, added to the experts' partial sums)."""
        p = self.param_of(t)
        if p is None or not self.running or p.rpartition(".")[0] != self.running[-1]:
            return None
        return p, ()

    def partial_of(self, t: Any) -> frozenset[str] | None:
        entry = self.partials.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is t else None

    def whole_of(self, t: Any) -> frozenset[str] | None:
        entry = self.wholes.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is t else None

    # ---- the dispatch hook ------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = run_op(func, args, kwargs)
        if func is torch.ops.aten.embedding.default:
            self.note_lookup(args[1])
            if self.looked_up:
                self.looked_up[-1][0][id(out)] = out
        elif self.looked_up:
            self.note_rows(func, args, kwargs, out)
        if not self.quiet:
            self.on_op(func, args, kwargs, out)
        if func.overloadpacket.__name__ not in _COPIES:
            # a reshape of a strided tensor runs as a copy and then a view: reads just
            # before the reshape are still fresh at its view
            self.fresh.clear()
            self.shapes_read.clear()
            self.shape_splits.clear()
        return out

    def note_rows(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Inside an Embedding's forward: is what it returns linear in the looked-up rows?
        A vocab-parallel lookup returns each rank's partial rows, summed after the forward,
        so an op that is not linear (a norm) would see partial rows. A parameter of the
        table written over rows as it is can be split and written as each rank's share."""
        rows, bent = self.looked_up[-1]
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        written = self.note_table_params(name, args, ins, out)
        mine = [t for t in ins if rows.get(id(t)) is t]
        if written is not None:
            table = self.embedding_calls[-1]
            if mine == [ins[0]]:
                self.trace.lookups.written_rows.setdefault(table, set()).add(written)
            else:  # written over something other than the rows
                self.trace.lookups.used_otherwise.add(f"{table}.{written}".lstrip("."))
        if not mine or bent:
            return
        others = [t for t in ins if rows.get(id(t)) is not t and t.is_floating_point()]
        linear = (
            (name in _LINEAR_IN_PARTIAL and ins[0] is mine[0] and not others)
            or (name in ("mul", "div") and len(mine) == 1 and (name == "mul" or ins[0] is mine[0]))
            or (written is not None and mine == [ins[0]])
        )
        if not linear and name not in _METADATA:
            bent.append(name)
            return
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor):
                rows[id(o)] = o

    def note_table_params(
        self, name: str, args: Any, ins: list[torch.Tensor], out: Any
    ) -> str | None:
        """Inside an Embedding's forward: how it uses its own parameters other than the
        weight. Returns the one written over rows by this op (`index_put`, its values the
        parameter as it is), if any; a copy or view of one stands for it, and any other use
        makes it one the split cannot take (`table_params`)."""
        table = self.embedding_calls[-1] if self.embedding_calls else None
        if table is None:
            return None
        prefix = f"{table}." if table else ""
        own: list[str] = []
        for t in ins:
            p = self.param_of(t)
            if p is not None and p.startswith(prefix) and "." not in p[len(prefix) :]:
                own.append(p)
        own = [p for p in own if p != f"{prefix}weight"]
        if not own or name in _METADATA:
            return None
        if name in _PASS_THROUGH and len(ins) == 1 and isinstance(out, torch.Tensor):
            self.params[id(out)] = (out, own[0])
            return None
        if name in ("index_put", "index_put_") and own == [self.param_of(args[2])]:
            target, indices, values = args[:3]
            if (
                target is not values
                and len(indices) < target.dim()  # whole rows: the features are not indexed
                and values.shape[-1:] == target.shape[-1:]
            ):
                return own[0][len(prefix) :]
        self.trace.lookups.used_otherwise.update(own)
        return None

    def note_lookup(self, indices: torch.Tensor) -> None:
        """An embedding's rows are token rows when its lookups read the model's input ids:
        seen at the lookup itself, since an Embedding subclass may look up positions it
        computes from the ids it is given (BART's, Whisper's positional embeddings)."""
        if not self.embedding_calls:
            return
        module = self.embedding_calls[-1]
        tokens = id(indices) in self.inputs and self.inputs[id(indices)] is indices
        seen = self.trace.lookups.token_ids.get(module)
        self.trace.lookups.token_ids[module] = tokens if seen is None else seen and tokens
        if module in self.slotted:
            slot = self.trace.lookups.at_lookup_place
            slot[module] = slot.get(module, True) and self.slots[-1:] == [module]

    def on_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        name = func.overloadpacket.__name__
        ins = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        splits = [s for s in (self.split_of(t) for t in ins) if s is not None]
        sources = frozenset().union(*(s.sources for s in splits))
        a = _named(func, args, kwargs)
        if name not in _METADATA and any(self.carries(t) for t in ins):
            for o in outs:
                if o.is_floating_point():
                    self.carrying[id(o)] = o
        if self.expert_params:
            self.note_views(name, a, ins, outs)
            partial = [p for p in (self.partial_of(t) for t in ins) if p is not None]
            zeros = name in ("zeros_like", "new_zeros", "zeros", "zero_") or (
                name in _PASS_THROUGH and len(ins) == 1 and partial == [frozenset()]
            )
            # a sum is floating point: integer zeros start a count or a mask (`one_hot`)
            zeros = zeros and len(outs) == 1 and outs[0].is_floating_point()
            if zeros:
                self.partials[id(outs[0])] = (outs[0], frozenset())
            if (
                not any(partial)
                and name in _LINEAR_IN_PARTIAL
                and len(outs) == 1
                and ins
                and self.routing.get(id(ins[0])) is ins[0]
            ):
                self.routing[id(outs[0])] = outs[0]
            # an accumulator of nothing yet (zeros) changed in place by anything but a zero
            # fill must be judged too: `acc.index_add_(0, i, x)` with a whole x first would
            # otherwise leave it looking like a sum of nothing
            into_empty = name.endswith("_") and not zeros and self.partial_of(ins[0]) == frozenset()
            if any(partial) or into_empty:
                self.follow_partial(func, name, a, ins, outs, frozenset().union(*partial))
                return
            if self.wholes and any(self.whole_of(t) is not None for t in ins):
                self.follow_whole(func, name, ins, outs)
            if name in ("_grouped_mm", "bmm", "mm") and self.expert_product(name, a, out):
                return
        self.note_vectors(func, name, a, ins, outs)
        self.note_params(name, ins, outs, sources)
        if not splits or name in _NEW_FROM:
            # `x.new_empty(...)` reads nothing of x but its dtype and device
            if not self.sized_by_a_shard(name, ins, outs):
                self.note_unsplit_sizes(name, args, kwargs)
            return
        if not outs:
            if func.namespace != "prim" and name not in _METADATA:
                self.trace.regions.break_(
                    sources, f"{name} turns the split tensor into a plain value"
                )
            return
        try:
            results = self.follow(func, name, args, kwargs, out)
        except SplitEnds as e:
            self.trace.regions.break_(sources, f"{name}: {e}")
            return
        for t, s in results:
            self.mark(t, s, name)

    def sized_by_a_shard(
        self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]
    ) -> bool:
        """A tensor made to the size of a split dim read just before (`x.shape[1]`), with
        values that are the same along that dim: a new buffer (`x.new_empty(*x.shape[:-1],
        d)`, filled in afterwards) or an unsplit tensor broadcast to it (`k.expand(-1,
        x.shape[1], -1, -1)`). On each rank it takes the shard's size, and any slice of it
        along that dim is the rank's own: it is split like the tensor read."""
        if name not in _SHARD_SIZED or len(outs) != 1 or not self.shape_splits:
            return False
        out = outs[0]
        if name == "expand":
            grown = [
                d
                for d in range(out.dim())
                # dims the expand adds in front are grown too, but have no size to read
                if d - out.dim() + ins[0].dim() >= 0
                and ins[0].shape[d - out.dim() + ins[0].dim()] == 1
                and out.shape[d] != 1
            ]
        else:
            grown = list(range(out.dim()))
        # a size some attribute read in forward also holds may be that attribute (T5's
        # `zeros((1, self.n_heads, ...))`, whole on every rank) rather than the shard's
        read = {v for frame in self.reads for _, _, v in frame}
        dims = [d for d in grown if out.shape[d] in self.shape_splits and out.shape[d] not in read]
        if len(dims) != 1:
            return False  # no size read off a split, or ambiguous: leave it whole
        (d,) = dims
        s = self.shape_splits[out.shape[d]]
        if name == "expand" and self.carries(ins[0]) and self.param_of(ins[0]) is None:
            # each rank would broadcast it over its own share only: its gradient is partial
            self.trace.regions.break_(
                s.sources,
                "expand: it broadcasts an unsplit tensor computed from the weights to the split "
                "size; its gradient would be each rank's partial sum, with nothing to add them up",
            )
            return True
        self.mark(out, s.at(d), name)
        return True

    def note_unsplit_sizes(self, name: str, args: Any, kwargs: Any) -> None:
        """Attributes read to size an op on tensors that are not split: dividing them for a
        split tensor would resize these too, so they must not be divided."""
        if name not in _SIZED:
            return
        for v in pytree.tree_leaves((args, kwargs)):
            if type(v) is int and v > 1:
                for module, attr, value in self.fresh:
                    if value == v:
                        self.trace.reads.unsplit_sizes.add((module, attr))

    def note_params(
        self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor], sources: frozenset[str]
    ) -> None:
        """Which parameters meet split tensors, and which tensors are still the model input."""
        used = [
            p
            for p in (self.param_of(t) for t in ins)
            if p is not None and p not in self.expert_params
        ]
        if name in _PASS_THROUGH and len(ins) == 1 and len(outs) == 1:
            if used:
                self.params[id(outs[0])] = (outs[0], used[0])
                return
            if id(ins[0]) in self.inputs and self.inputs[id(ins[0])] is ins[0]:
                self.inputs[id(outs[0])] = outs[0]
        if len(set(used)) == 1 and len(used) == len(ins) and len(outs) == 1 and not sources:
            # computed from one parameter alone (`1 + weight`, `softplus(alpha)`): still that
            # parameter where it meets other tensors, so its gradient is judged there
            self.params[id(outs[0])] = (outs[0], used[0])
            return
        if not outs:
            return  # a query (`weight.device`, a size) computes nothing a gradient flows through
        for p in used:
            if sources:
                self.trace.params.in_region.setdefault(p, set()).update(sources)
            else:
                self.trace.params.outside.add(p)

    def note_vectors(
        self,
        func: Any,
        name: str,
        a: dict[str, Any],
        ins: list[torch.Tensor],
        outs: list[torch.Tensor],
    ) -> None:
        """Follow views of 1-D parameters, keeping which dim holds their entries."""
        if len(outs) != 1 or not ins:
            return
        found = self.vector_view(ins[0])
        if found is None:
            return
        pname, vd = found
        t, out = ins[0], outs[0]
        new: int | None = None
        if name == "unsqueeze":
            new = vd + (1 if norm_dim(a["dim"], out.dim()) <= vd else 0)
        elif name == "expand":
            new = vd + out.dim() - t.dim()
        elif name in ("t", "transpose", "permute"):
            new = permutation(name, a, t.dim()).index(vd)
        elif name in _RESHAPES:
            # only a view that keeps the entries in one dim, all others of size 1
            big = [d for d, n in enumerate(out.shape) if n != 1]
            new = big[0] if len(big) == 1 else None
        elif out.shape == t.shape and (
            name in _PASS_THROUGH or (len(ins) == 1 and torch.Tag.pointwise in func.tags)
        ):
            new = vd  # a copy, a cast, or `1 + sinks`
        if new is not None and 0 <= new < out.dim() and out.shape[new] == t.shape[vd]:
            self.vectors[id(out)] = (out, pname, new)

    def split_param(self, t: torch.Tensor, s: Split, nd: int) -> bool:
        """A 1-D parameter (or a view of one) with one entry per element of the split dim,
        met element by element by the split tensor: a per-head attention sink. It can be
        split alike (each rank holds its own contiguous share), so the split goes on."""
        found = self.vector_view(t)
        if found is None or s.outer != 1:
            return False
        pname, vd = found
        if vd != s.dim - (nd - t.dim()) or t.shape[vd] != s.n * s.inner:
            return False
        if pname.rpartition(".")[0] in self.trace.layers.linears:
            return False  # a Linear's own bias used elsewhere: not the Linear's rule to make
        self.trace.params.split_vectors.setdefault(pname, set()).update(s.sources)
        return True

    # ---- mixture-of-experts --------------------------------------------------------------
    def note_views(
        self, name: str, a: dict[str, Any], ins: list[torch.Tensor], outs: list[torch.Tensor]
    ) -> None:
        """Follow views of expert parameters (transposes, per-token gathers of experts)."""
        if len(outs) != 1 or not ins:
            return
        found = self.expert_view(ins[0])
        if found is None:
            return
        pname, dims = found
        nd = len(dims)
        if name in ("alias", "detach", "_to_copy", "clone", "contiguous", "lift_fresh", "slice"):
            new: tuple[int | None, ...] = dims
        elif name in ("t", "transpose", "permute"):
            new = tuple(dims[k] for k in permutation(name, a, nd))
        elif name == "index" and len(a["indices"]) == 1 and a["indices"][0] is not None:
            new = (None,) * a["indices"][0].dim() + dims[1:]  # experts gathered per token
        elif name == "select":
            d = norm_dim(a["dim"], nd)
            new = dims[:d] + dims[d + 1 :]
        else:
            return
        self.views[id(outs[0])] = (outs[0], pname, new)

    def expert_product(self, name: str, a: dict[str, Any], out: torch.Tensor) -> bool:
        """A batched per-expert matmul with an expert weight: opens a split of its output
        features (unsplit input) or closes one (input split on the contracted dim), leaving
        each rank's partial sum. False when no expert weight takes part."""
        first, second = a["self"], a["mat2"]
        if name in ("_grouped_mm", "mm") or self.expert_view(second) is not None:
            x, w, x_in, w_in, w_out = (
                first,
                second,
                first.dim() - 1,
                second.dim() - 2,
                second.dim() - 1,
            )
        else:
            x, w, x_in, w_in, w_out = second, first, 1, 2, 1
        found = self.expert_view(w)
        # one expert's weight (a 2-D view) in `mm`, or all of them (3-D) batched
        if found is None or w.dim() != (2 if name == "mm" else 3):
            return False
        pname, dims = found
        stored_in, stored_out = dims[w_in], dims[w_out]
        if stored_in in (None, 0) or stored_out in (None, 0):
            return False
        out_dim = out.dim() - 1 if w_out == w.dim() - 1 else 1
        s = self.split_of(x)
        roles = self.trace.experts.roles
        if s is None:
            if roles.get(pname, ("open",))[0] != "open":
                self.trace.regions.misfits[pname] = (
                    "it is called both on split and on unsplit inputs"
                )
            features = out.shape[out_dim]
            self.trace.regions.openers[pname] = features
            roles[pname] = ("open", stored_out)
            self.mark(out, Split(out_dim, 1, features, 1, frozenset({pname})), name)
        elif s.dim == x_in and s.outer == 1:
            if roles.get(pname, ("close",))[0] != "close" or (
                pname in self.trace.regions.closers
                and not self.trace.regions.closers[pname].same_cut(s)
            ):
                self.trace.regions.misfits[pname] = (
                    "it is called both on split and on unsplit inputs"
                )
            roles[pname] = ("close", stored_in)
            self.trace.regions.closers[pname] = s
            self.trace.regions.links.add(s.sources | {pname})
            self.partials[id(out)] = (out, s.sources | {pname})
        else:
            self.trace.regions.break_(
                s.sources, f"{name}: an expert matmul takes it along another dim"
            )
        return True

    def follow_partial(
        self,
        func: Any,
        name: str,
        a: dict[str, Any],
        ins: list[torch.Tensor],
        outs: list[torch.Tensor],
        sources: frozenset[str],
    ) -> None:
        """Partial sums stay partial through ops linear in them: the all-reduce after the
        experts then gives what the unsharded model computes. Anything else ends them."""
        floats = [t for t in ins if t.is_floating_point()]
        partial = [t for t in floats if self.partial_of(t) is not None]
        others = [t for t in floats if self.partial_of(t) is None]
        wholes = [self.whole_of(t) for t in others]
        ok = True
        if name in _METADATA or func.namespace == "prim":
            return
        if name not in _ADDS:
            self.bend_whole(wholes, f"{name} combines it with the experts' partial sums")
        linear = self.linear_in(name, ins, partial, others)
        if linear is not None:
            ok = linear
            if ok and any(self.routing.get(id(t)) is t for t in others):
                self.weighted.update((id(o), o) for o in outs)
        elif name in _ADDS:
            biases = [self.expert_view(t) or self.running_param(t) for t in others]
            # per-expert biases and outputs of parameter-free submodules (identity experts)
            # are whole on every rank: the plan adds each as 1/tp per rank
            ok = len(partial) >= 1 and all(
                b is not None or w is not None for b, w in zip(biases, wholes, strict=True)
            )
            for b in biases:
                if b is not None:
                    self.trace.experts.after_sum[b[0]] = b[0].rpartition(".")[0]
                    if any(self.weighted.get(id(t)) is t for t in partial):
                        self.trace.experts.after_weighting.add(b[0])
            if ok:
                for child in frozenset().union(*(w for w in wholes if w is not None)):
                    self.trace.experts.added_whole[child] = self.whole_owner[child]
            elif others and all(self.split_of(t) is None for t in others):
                self.end_partial(
                    sources,
                    partial,
                    f"{name} adds to the experts' partial sums a tensor made without the split "
                    "weights (the same on every rank, so the all-reduce would count it tp "
                    "times), and not as the output of a parameter-free submodule, which the "
                    "plan could scale by 1/tp",
                )
                return
        elif name in ("masked_fill", "masked_fill_", "where"):
            value = a.get("value", a.get("other"))
            ok = not others and (not isinstance(value, (int, float)) or value == 0)
        else:
            ok = False
        if not ok:
            self.end_partial(
                sources,
                partial,
                f"{name} is not linear in the experts' partial sums (the all-reduce after them would change it)",
            )
            return
        scaled = any(self.weighted.get(id(t)) is t for t in partial)
        for o in outs:
            if o.is_floating_point():
                self.partials[id(o)] = (o, sources)
                if scaled:
                    self.weighted[id(o)] = o

    def end_partial(self, sources: frozenset[str], partial: list[torch.Tensor], why: str) -> None:
        self.trace.regions.break_(sources, why)
        if not sources and self.running:
            # a sum no expert with weights has reached yet: no weight to blame, so the
            # experts module running holds the reason (`Trace.sum_breaks`)
            self.trace.experts.sum_breaks.setdefault(self.running[-1], why)
        for t in partial:
            self.partials.pop(id(t), None)

    def bend_whole(self, wholes: list[frozenset[str] | None], why: str) -> None:
        for w in wholes:
            for child in w or ():
                self.trace.experts.whole_used_otherwise.setdefault(child, why)

    def linear_in(
        self,
        name: str,
        ins: list[torch.Tensor],
        mine: list[torch.Tensor],
        others: list[torch.Tensor],
    ) -> bool | None:
        """Whether the op's output is linear in `mine` (the tensors followed), given the
        `others`: views and copies of the first input, a product with (or a quotient by) one
        unsplit tensor. None for any other op: sums are each caller's to judge."""
        if name in _LINEAR_IN_PARTIAL:
            return ins[0] is mine[0] and not others
        if name in ("mul", "div", "mul_", "div_"):
            return (
                len(mine) == 1
                and (name.startswith("mul") or ins[0] is mine[0])
                and all(self.split_of(t) is None for t in others)
            )
        return None

    def follow_whole(
        self, func: Any, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]
    ) -> None:
        """Outputs of parameter-free submodules of an experts module stay such through ops
        linear in them (a view, the routing weight), until added to the partial sums
        (`follow_partial`). The plan scales the submodule's output by 1/tp, which is right
        only when every use of it is linear and ends in that sum: any other use bends it."""
        if name in _METADATA or func.namespace == "prim":
            return
        floats = [t for t in ins if t.is_floating_point()]
        mine = [t for t in floats if self.whole_of(t) is not None]
        others = [t for t in floats if self.whole_of(t) is None]
        children = frozenset().union(*(self.whole_of(t) or () for t in mine))
        ok = self.linear_in(name, ins, mine, others)
        if ok is None:
            ok = name in _ADDS and not others
        if not ok:
            self.bend_whole([children], f"{name} takes it")
            return
        for o in outs:
            if o.is_floating_point():
                self.wholes[id(o)] = (o, children)

    # ---- op rules: each returns [(output tensor, its Split)] or raises SplitEnds ----------
    def follow(
        self, func: Any, name: str, args: Any, kwargs: Any, out: Any
    ) -> list[tuple[torch.Tensor, Split]]:
        a = _named(func, args, kwargs)
        if name in _RESHAPES:
            before = self.only_split(args[0])
            s = reshape(before, tuple(args[0].shape), tuple(out.shape))
            self.check_count(a.get("size", a.get("shape")), s, before, args[0], out.shape)
            return [(out, s)]
        if name in ("transpose", "t", "permute"):
            return [(out, self.permuted(name, a, args[0]))]
        if name in ("view_as_complex", "view_as_real"):
            s = self.only_split(args[0])
            if s.dim == args[0].dim() - 1 and name == "view_as_complex":
                raise SplitEnds("it pairs up the split features as complex numbers")
            return [(out, s)]  # a trailing pair of reals <-> one complex number
        if name == "expand":
            s = self.only_split(args[0])
            d = s.dim + out.dim() - args[0].dim()
            if out.shape[d] != args[0].shape[s.dim]:
                raise SplitEnds("it expands the split dim")
            return [(out, s.at(d))]
        if name in ("slice", "select", "narrow"):
            return self.sliced(name, a, args[0], out)
        if name == "constant_pad_nd":
            return [(out, self.padded(a["pad"], args[0]))]
        if name == "cat":
            return [(out, self.concatenated(a))]
        if name == "stack":
            return [(out, self.stacked(a, out))]
        if name in _SPLITS:
            return self.split_apart(name, a, args[0], out)
        if name in _SAME_SHAPE_OVER_DIM:
            s = self.only_split(args[0])
            if norm_dim(a["dim"], args[0].dim()) == s.dim:
                raise SplitEnds("it normalizes over the split dim")
            return [(out, s)]
        if name in _REDUCTIONS:
            return self.reduced(a, args[0], out)
        if name in _NORMS:
            s = self.only_split(args[0])
            if s.dim >= args[0].dim() - len(a["normalized_shape"]):
                raise SplitEnds("it normalizes over the split features")
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.check_affine(a, first, s)
            return [(first, s)]
        if name in ("mm", "bmm", "addmm", "baddbmm"):
            return [(out, self.multiplied(name, a, out))]
        if name in _ELEMENTWISE or torch.Tag.pointwise in func.tags:
            return self.elementwise(func, args, kwargs, out)
        raise SplitEnds("the tracer does not know how this op treats a split dim")

    def check_count(
        self, sizes: Any, s: Split, before: Split, x: torch.Tensor, out_shape: Any
    ) -> None:
        """A view of split features must size the split dim so that each rank's shard gets
        its share, and the dims beside it so that they do not change.

        - A fixed count at the split dim must be an integer attribute of a running module,
          which the plan divides by the tp size (`view(B, T, self.n_head, hd)`).
        - Where the view reshapes the split features, every size beside the split dim must be
          an integer attribute read in forward (`self.head_dim`), or 2 to 4 times one
          (`3 * self.head_size`, fused pieces per head): one computed from the
          width (`t.size(-1) // cfg.n_head`) would shrink on a shard, without a word when the
          split dim is -1. Numbers the tracer cannot trace to an attribute end the split.
        - A view that keeps the split dim as it was (`x.reshape(*x.shape[:-1], -1, 2)` on
          heads) only needs its count at the split dim, when -1 is elsewhere, to be an
          attribute: read off the tensor it would be the shard's own, but from elsewhere not.
        """
        if not isinstance(sizes, (list, tuple)):
            return  # squeeze, unsqueeze, flatten: dims, not sizes
        k = s.dim
        if list(sizes) == list(x.shape):
            return  # the same shape again: on a shard, the shard's own
        read = {v for frame in self.reads for _, _, v in frame}
        kept = before.n == s.n and before.inner == s.inner and x.shape[before.dim] == sizes[k]
        pieces = carved(list(out_shape), k, x.shape[before.dim])
        if kept:
            if sizes[k] == -1 or (-1 not in sizes and sizes[k] not in read):
                return
            fresh = {v for _, _, v in self.fresh}
            if sizes[k] in self.shapes_read and sizes[k] not in fresh:
                return  # read off a split tensor just before (`*x.shape[:-1]`): the shard's own
        elif len(pieces) > 1:  # the split dim is cut into (count, ..., size) dims
            *middle, last = pieces[1:]
            # `3 * self.head_size` (q|k|v interleaved per head, GPT-NeoX) is as fixed as the
            # attribute, unless the split tensor's width was just read (it may come from
            # that) or the attribute is a count the plan divides (nanoGPT's `C // n_head`
            # equals 2 * n_head by chance, and changes when n_head is divided)
            counts = {v for found in self.trace.reads.counts.values() for _, _, v in found}
            counts.add(sizes[k])
            multiple = x.shape[before.dim] not in self.shapes_read and any(
                last == m * v for v in read - counts if v > 1 for m in (2, 3, 4)
            )
            if (last not in read and not multiple) or any(m not in read and m > 4 for m in middle):
                raise SplitEnds(
                    f"it sizes the features beside the split dim at {pieces[1:]}, which no "
                    "module attribute read in forward holds; computed from a shard's width "
                    "they would be wrong on every rank"
                )
        else:
            # A merge sized by -1 or by the tensor's own sizes is the shard's own. One sized
            # by an attribute read right before it (`reshape(B, T, self.embed_dim)`) is
            # divided by the plan; a number that only equals some attribute read earlier
            # (a head count taken from a shape) is not that attribute.
            asked = self.asked[-1] if self.asked else ()
            if len(asked) == len(sizes) and all(isinstance(v, int) for v in asked):
                sizes = asked  # -1 as written, not as dispatch resolved it
            # the attribute holds the whole merged width, or the count of split units in it
            # (`bsz * self.num_heads`): either way dividing it gives each rank its share
            held = [
                (m, a, v)
                for m, a, v in self.fresh
                if v == sizes[k] or (v == s.n and sizes[k] == s.outer * s.n * s.inner)
            ]
            if sizes[k] == -1 or not held:
                if sizes[k] != -1 and -1 in sizes:
                    raise SplitEnds(
                        f"it merges the split dim into one of fixed size {sizes[k]} with -1 elsewhere"
                    )
                return
            others = [v for j, v in enumerate(sizes) if j != k]
            if len({(m, a) for m, a, _ in held}) != 1 or held[0][2] in others:
                raise SplitEnds(
                    f"it merges the split features into a fixed size {sizes[k]}, and which "
                    "attribute read just before it sized them is ambiguous "
                    f"({', '.join(sorted({a for _, a, _ in held}))})"
                )
            for src in s.sources:
                self.trace.reads.counts.setdefault(src, set()).add(held[0])
            return
        fresh = {v for _, _, v in self.fresh}
        if sizes[k] in self.shapes_read and sizes[k] not in fresh:
            return  # the count was read off a split tensor just before: the shard's own
        if sizes[k] != -1:
            doing = "with -1 elsewhere, it fixes" if -1 in sizes else "it fixes"
            count = self.attribute_holding(sizes[k], f"{doing} the split dim at")
            for src in s.sources:
                self.trace.reads.counts.setdefault(src, set()).add(count)

    def attribute_holding(self, value: int, doing: str) -> tuple[str, str, int]:
        """(module, attribute, value) of the one integer attribute read just before this op
        with this value; the plan divides it by the tp size. Anything else ends the split."""
        read: set[tuple[str, str]] = set()
        for frame in reversed(self.reads):
            read = {(m, a) for m, a, v in frame if v == value}
            if read:
                break
        if len(read) != 1:
            which = (
                f"several attributes read in forward hold it ({', '.join(sorted(a for _, a in read))})"
                if read
                else "no module attribute read in forward holds it"
            )
            raise SplitEnds(f"{doing} {value}, and {which}")
        ((module, attr),) = read
        return module, attr, value

    def only_split(self, t: torch.Tensor) -> Split:
        s = self.split_of(t)
        if s is None:
            raise SplitEnds("unexpected unsplit operand")
        return s

    def permuted(self, name: str, a: dict[str, Any], t: torch.Tensor) -> Split:
        s = self.only_split(t)
        return s.at(permutation(name, a, t.dim()).index(s.dim))

    def sliced(
        self, name: str, a: dict[str, Any], t: torch.Tensor, out: torch.Tensor
    ) -> list[tuple[torch.Tensor, Split]]:
        s = self.only_split(t)
        d = norm_dim(a.get("dim", 0), t.dim())
        if d == s.dim:
            if name != "select" and out.shape[d] == t.shape[d]:
                return [(out, s)]  # a full slice, `x[..., :n]` with n the whole size
            step = a.get("step", 1) if name == "slice" else 1
            start = a.get("start") or 0
            if step > 1 and 0 <= start < step and out.shape[d] == -(-(t.shape[d] - start) // step):
                # every step-th feature (interleaved gate/up): on a shard whose size is a
                # multiple of the step, the same pick of the shard's own features
                picked = every_step(s, step)
                if picked is not None:
                    return [(out, picked)]
            raise SplitEnds("it takes part of the split dim")
        if name == "select" and d < s.dim:
            return [(out, s.at(s.dim - 1))]
        return [(out, s)]

    def padded(self, pad: list[int], t: torch.Tensor) -> Split:
        """`F.pad` pads the last dims, two numbers each, last dim first. Padding dims beside
        the split (a sequence padded to whole chunks) keeps each rank's features where they
        were; padding the split dim itself would add features at the ends of the whole dim,
        which no shard holds."""
        s = self.only_split(t)
        nd = t.dim()
        for i in range(0, len(pad), 2):
            if nd - 1 - i // 2 == s.dim and (pad[i] or pad[i + 1]):
                raise SplitEnds("it pads the split dim")
        return s

    def concatenated(self, a: dict[str, Any]) -> Split:
        tensors = [t for t in a["tensors"] if t.numel() or t.dim() > 1]
        nd = tensors[0].dim()
        d = norm_dim(a.get("dim", 0), nd)
        splits = [s for s in (self.split_of(t) for t in tensors) if s is not None]
        merged = merge(splits, [s.dim for s in splits])
        if merged.dim == d:
            raise SplitEnds("it concatenates along the split dim")
        for t in tensors:
            # an unsplit part is fine only as a 1-D parameter split alike (GPT-OSS's sinks,
            # one per head, joined to the attention logits along the keys)
            if self.split_of(t) is None and not self.split_param(t, merged, nd):
                raise SplitEnds("it joins split and unsplit tensors")
        return merged

    def stacked(self, a: dict[str, Any], out: torch.Tensor) -> Split:
        """Tensors of one shape stacked along a new dim (a rotary's `stack((-x2, x1), -1)`):
        split alike, they stay split, the new dim moving the split one up when it comes
        before; an unsplit one among them would have the whole size where the others have
        a shard's."""
        splits = [s for s in (self.split_of(t) for t in a["tensors"]) if s is not None]
        if len(splits) != len(a["tensors"]):
            raise SplitEnds("it stacks split and unsplit tensors")
        merged = merge(splits, [s.dim for s in splits])
        d = norm_dim(a.get("dim", 0), out.dim())
        k = merged.dim + 1 if d <= merged.dim else merged.dim
        return merged.at(k)

    def split_apart(
        self, name: str, a: dict[str, Any], t: torch.Tensor, out: Any
    ) -> list[tuple[torch.Tensor, Split]]:
        s = self.only_split(t)
        d = norm_dim(a.get("dim", 0), t.dim())
        if d == s.dim:
            return self.cut(name, a, s, t, out)
        dim = s.dim - 1 if name == "unbind" and d < s.dim else s.dim  # unbind drops its dim
        return [(o, s.at(dim)) for o in out]

    def cut(
        self, name: str, a: dict[str, Any], s: Split, t: torch.Tensor, out: Any
    ) -> list[tuple[torch.Tensor, Split]]:
        """A fused layer's output cut into its pieces (q|k|v, gate|up) along the split dim.

        Sharded, the layer stores each piece's rank-r slice next to the others' (`parts` in
        the plan), so rank r's shard is [q_r, k_r, v_r]; the model's own cut finds those
        pieces only when it cuts into equal pieces by count (`chunk`) or by sizes read from
        module attributes, which the plan divides by the tp size.
        """
        if len(s.sources) != 1 or s.outer != 1 or name not in ("split", "split_with_sizes"):
            raise SplitEnds(
                f"its split features are cut into {len(out)} parts in a way a fused split "
                "cannot follow; a contiguous shard would mix the parts"
            )
        (src,) = s.sources
        sizes = [o.shape[s.dim] for o in out]
        if any(n % s.inner for n in sizes):
            raise SplitEnds("it cuts the split features inside a block that must stay whole")
        held: list[tuple[str, str, int]] = []
        if not self.chunking:
            asked = a["split_size"] if name == "split" else a["split_sizes"]
            for size in sorted(set([asked] if isinstance(asked, int) else asked)):
                if size > 0:  # nothing to divide in an empty piece
                    held.append(self.attribute_holding(size, "it cuts the fused features at"))
        per_unit = self.trace.regions.openers[src] // (s.n * s.inner)
        parts = tuple(n * per_unit for n in sizes if n)
        if self.trace.regions.parts.setdefault(src, parts) != parts:
            raise SplitEnds("the fused features are cut two different ways")
        self.trace.reads.counts.setdefault(src, set()).update(held)
        return [
            (o, Split(s.dim, 1, n // s.inner, s.inner, s.sources))
            for o, n in zip(out, sizes, strict=True)
            if n
        ]

    def reduced(
        self, a: dict[str, Any], t: torch.Tensor, out: Any
    ) -> list[tuple[torch.Tensor, Split]]:
        s = self.only_split(t)
        dims = a.get("dim")
        if dims is None or dims == []:
            raise SplitEnds("it reduces the whole tensor, split dim included")
        dims = [dims] if isinstance(dims, int) else list(dims)
        dims = [norm_dim(d, t.dim()) for d in dims]
        result = after_reduce(s, dims, keepdim=bool(a.get("keepdim", False)))
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        return [(o, result) for o in outs]

    def multiplied(self, name: str, a: dict[str, Any], out: torch.Tensor) -> Split:
        """mm/bmm (and addmm/baddbmm): batch dims must be split alike, rows or columns may be
        split against an unsplit other side; a split contracted dim is a Linear's job."""
        x, y = {
            "mm": ("self", "mat2"),
            "bmm": ("self", "mat2"),
            "addmm": ("mat1", "mat2"),
            "baddbmm": ("batch1", "batch2"),
        }[name]
        sx, sy = self.split_of(a[x]), self.split_of(a[y])
        batched = name in ("bmm", "baddbmm")
        row, col = (1, 2) if batched else (0, 1)
        if sx is not None and sy is not None:
            if not (batched and sx.dim == 0 and sy.dim == 0):
                raise SplitEnds("it contracts split operands outside a Linear")
            result = merge([sx, sy], [0, 0])
        elif sx is not None and sx.dim == row:
            result = sx
            self.side_input(a[y], sx, "it")
        elif sy is not None and sy.dim == col:
            result = sy
            self.side_input(a[x], sy, "it")
        else:
            raise SplitEnds("it contracts or batches over the split dim against an unsplit operand")
        if name in ("addmm", "baddbmm"):
            bias = a["self"]
            if self.split_of(bias) is not None:
                raise SplitEnds("it adds a split bias to a matrix product")
            self.check_broadcast(bias, result, out.dim())
        return result

    def elementwise(
        self, func: Any, args: Any, kwargs: Any, out: Any
    ) -> list[tuple[torch.Tensor, Split]]:
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        shape = outs[0].shape
        nd = len(shape)
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        pairs = [(t, self.split_of(t)) for t in ins]
        split_pairs = [(t, s) for t, s in pairs if s is not None]
        dims = [s.dim + nd - t.dim() for t, s in split_pairs]
        for (t, s), d in zip(split_pairs, dims, strict=True):
            if t.shape[s.dim] != shape[d]:
                raise SplitEnds("the split dim is broadcast")
        result = merge([s for _, s in split_pairs], dims)
        for t, maybe in pairs:
            if (
                maybe is None
                and not self.expert_bias(t, result, nd)
                and not self.split_param(t, result, nd)
            ):
                vector = self.vector_view(t)
                if vector is not None:
                    self.trace.params.whole_vectors.add(vector[0])
                self.check_broadcast(t, result, nd)
                self.side_input(t, result, "it")
        if func._schema.is_mutable and self.split_of(args[0]) is None:
            raise SplitEnds("it writes split values into an unsplit tensor in place")
        return [(o, result) for o in outs if o.dim() == nd]

    def expert_bias(self, t: torch.Tensor, s: Split, nd: int) -> bool:
        """A per-expert bias gathered per token and added to an opening expert matmul's
        split output: split alike, with that weight."""
        found = self.expert_view(t)
        if found is None or len(s.sources) != 1:
            return False
        (src,) = s.sources
        k = s.dim - (nd - t.dim())
        if self.trace.experts.roles.get(src, ("",))[0] != "open" or k < 0:
            return False
        stored = found[1][k]
        if stored in (None, 0) or t.shape[k] != s.outer * s.n * s.inner:
            return False
        self.trace.experts.biases[found[0]] = (src, stored)
        return True

    def check_affine(self, a: dict[str, Any], out: torch.Tensor, s: Split) -> None:
        for key in ("weight", "bias"):
            if isinstance(a.get(key), torch.Tensor):
                self.check_broadcast(a[key], s, out.dim())

    def check_broadcast(self, t: torch.Tensor, s: Split, nd: int) -> None:
        """An unsplit operand may meet a split one only where it is broadcast (size 1)."""
        k = s.dim - (nd - t.dim())
        if k >= 0 and t.shape[k] != 1:
            raise SplitEnds(
                "it combines the split tensor with an unsplit one of full size along the split dim"
            )


def _named(func: Any, args: Any, kwargs: Any) -> dict[str, Any]:
    names = [arg.name for arg in func._schema.arguments]
    out = dict(zip(names, args, strict=False))  # trailing defaults are not passed
    out.update(kwargs)
    return out


# Cuts into a number of equal pieces: a rank's shard of a fused output cut so gives the
# rank's slice of each piece, with no size to divide.
_CHUNKS = (torch.Tensor.chunk, torch.chunk)
_VIEWS = (torch.Tensor.view, torch.Tensor.reshape, torch.reshape)
_VIEWS_AS = (torch.Tensor.view_as, torch.Tensor.reshape_as)
_SHAPES = (torch.Tensor.size, torch.Tensor.shape.__get__)  # type: ignore[attr-defined]


class _Attention(TorchFunctionMode):
    """scaled_dot_product_attention as one op: heads (dim -3) of q, k and v go together.

    Seen whole, so its evidence reads as attention and its internals (on the math path on fake
    tensors) need no rules. Grouped-query attention pairs query head i with key/value head
    i * kv_heads // heads, so a tp-way split keeps pairs together when tp divides both counts.
    """

    def __init__(self, tracer: _Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SHAPES and not self.tracer.quiet:
            out = func(*args, **kwargs)
            split = self.tracer.split_of(args[0])
            if split is not None:
                if isinstance(out, int) and norm_dim(args[1], args[0].dim()) == split.dim:
                    self.tracer.shapes_read.add(out)
                    self.tracer.shape_splits[out] = split
                elif isinstance(out, tuple):
                    self.tracer.shapes_read.add(out[split.dim])
                    self.tracer.shape_splits[out[split.dim]] = split
            return out
        if func in _VIEWS_AS and not self.tracer.quiet:
            # the sizes come from the other tensor's shape, read in C++ where `_SHAPES`
            # does not see it: a split dim's size read so is each shard's own
            other = args[1]
            split = self.tracer.split_of(other)
            if split is not None:
                self.tracer.shapes_read.add(other.shape[split.dim])
                self.tracer.shape_splits[other.shape[split.dim]] = split
            self.tracer.asked.append(tuple(other.shape))
            try:
                return func(*args, **kwargs)
            finally:
                self.tracer.asked.pop()
        if func in _VIEWS:
            sizes = args[1:]
            if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
                sizes = sizes[0]
            self.tracer.asked.append(tuple(sizes))
            try:
                return func(*args, **kwargs)
            finally:
                self.tracer.asked.pop()
        if func in _CHUNKS:
            self.tracer.chunking += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.tracer.chunking -= 1
        if func is not torch.nn.functional.scaled_dot_product_attention or self.tracer.quiet:
            return func(*args, **kwargs)
        t = self.tracer
        qkv = list(args[:3]) + [kwargs[k] for k in ("query", "key", "value") if k in kwargs]
        splits = [t.split_of(x) for x in qkv]
        if all(s is None for s in splits):
            return func(*args, **kwargs)
        sources = frozenset().union(*(s.sources for s in splits if s is not None))
        t.quiet += 1
        try:
            out = func(*args, **kwargs)
        finally:
            t.quiet -= 1
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if any(t.carries(x) for x in qkv):
            t.carrying[id(out)] = out
        try:
            q = _attention_split(qkv, splits)
            if isinstance(mask, torch.Tensor):
                ms = t.split_of(mask)
                if ms is None:
                    t.check_broadcast(mask, q, out.dim())
                    t.side_input(mask, q, "its mask")
                elif not ms.same_cut(q.at(ms.dim)) or ms.dim != q.dim:
                    raise SplitEnds("the mask is split differently from the heads")
        except SplitEnds as e:
            t.trace.regions.break_(sources, f"scaled_dot_product_attention: {e}")
            return out
        mask_split = t.split_of(mask) if isinstance(mask, torch.Tensor) else None
        if mask_split is not None:
            sources |= mask_split.sources  # a per-head bias joins the heads' region
        for s in sources:
            t.trace.regions.units[s] = math.gcd(
                t.trace.regions.units.get(s, q.n), *(x.n for x in splits if x)
            )
        t.mark(out, Split(q.dim, 1, q.n, q.inner, sources), "scaled_dot_product_attention")
        return out


def _attention_split(qkv: list[torch.Tensor], splits: list[Split | None]) -> Split:
    if any(s is None for s in splits):
        raise SplitEnds("query, key and value are not all split")
    dims = [x.dim() - 3 for x in qkv]
    for x, s, d in zip(qkv, splits, dims, strict=True):
        assert s is not None
        if s.dim != d or s.outer != 1 or s.n * s.inner != x.shape[d]:
            raise SplitEnds("query, key or value is not split along its heads dim")
    q = splits[0]
    assert q is not None
    return q


# ---- running the model ---------------------------------------------------------------------
# What a linear layer written by hand may do besides its one matrix product with the weight.
_LINEAR_OPS = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand",
    "clone", "contiguous", "_to_copy", "alias", "detach", "add", "sym_size", "sym_numel",
    "sym_stride", "dim", "is_contiguous", "lift_fresh", "device",
}  # fmt: skip
_PRODUCTS = {"mm", "addmm", "bmm", "matmul", "linear"}


class _OpLog(TorchDispatchMode):
    """Which ops a probe forward ran, and how the weight met the matrix product."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.flipped = {id(weight): False}  # weight and its transposes -> transposed?
        self.held: list[Any] = []  # keeps the transposes' ids unique while the probe runs
        self.others: set[str] = set()
        self.products: list[bool] = []  # per product with the weight: weight used as (in, out)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        ids = [id(a) for a in args if isinstance(a, torch.Tensor)]
        if name in ("t", "transpose", "permute") and ids and ids[0] in self.flipped:
            self.flipped[id(out)] = not self.flipped[ids[0]]
            self.held.append(out)
        elif name in _PRODUCTS:
            # mm(x, W) computes x @ W: W is stored (in, out); linear(x, W) and mm(x, W.t()) not
            second = args[2] if name == "addmm" else args[1]
            if id(second) in self.flipped:
                flipped = self.flipped[id(second)]
                self.products.append(flipped if name == "linear" else not flipped)
            else:
                self.others.add(name)
        elif name not in _LINEAR_OPS:
            self.others.add(name)
        return out


@contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """A probe that fails is an answer, not an error: fake tensors log failing kernels with
    their traceback, which would read as a crash to the user."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _plain_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    """The module runs `base`'s own forward (its class, or a subclass that keeps it)."""
    cls = type(module)
    for klass in cls.__mro__:
        if "forward" in vars(klass):
            return klass is base
    return False


def _linear_like(module: nn.Module, fake: FakeTensorMode) -> bool | None:
    """Whether `module` (not an nn.Linear) computes a linear layer of its own 2-D weight:
    None if not, else whether the weight is stored (in, out) as in GPT-2's Conv1D. Decided by
    running it once on a fake input and watching its ops, not by its type or name."""
    weight = module._parameters.get("weight")
    bias = module._parameters.get("bias")
    if weight is None or weight.dim() != 2 or next(module.children(), None) is not None:
        return None
    if bias is not None and bias.dim() != 1:
        return None
    rows, cols = weight.shape
    for d_in, d_out in dict.fromkeys([(rows, cols), (cols, rows)]):
        if bias is not None and bias.shape[0] != d_out:
            continue
        with fake:
            x = torch.empty(2, 3, d_in, device=weight.device)
        log = _OpLog(weight)
        try:
            with torch.no_grad(), log, _quiet_fake_tensor_log():
                out = module(x)
        except Exception:
            continue
        if (
            isinstance(out, torch.Tensor)
            and tuple(out.shape) == (2, 3, d_out)
            and not log.others
            and len(log.products) == 1
            and (rows == cols or (rows == d_in) == log.products[0])
        ):
            return log.products[0]
    return None


class _LookupSlot(nn.Embedding):
    """nn.Embedding's place in a traced table's class order: says when a lookup runs there."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        slots, name = self.__dict__["_tpplan_slot"]
        slots.append(name)
        try:
            return nn.Embedding.forward(self, input)
        finally:
            slots.pop()


def _watch_lookup_slots(copy_: nn.Module, tracer: _Tracer) -> None:
    """Give each Embedding subclass with a forward of its own (in the traced copy) a class
    with `_LookupSlot` where nn.Embedding was: the place `SumAtLookup` takes when applied,
    so the trace sees whether every lookup goes there (a `super().forward(ids)`) or around
    it (an `F.embedding` of its own)."""
    for name, m in copy_.named_modules():
        if isinstance(m, nn.Embedding) and type(m).forward is not nn.Embedding.forward:
            put_in_lookup_place(m, _LookupSlot)
            m.__dict__["_tpplan_slot"] = (tracer.slots, name)
            tracer.slotted.add(name)


def _hook(tracer: _Tracer, name: str, module: nn.Module) -> None:
    trace = tracer.trace
    arrived: list[Split | None] = []  # the split of each call's input, until the call returns

    def before(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        trace.layers.called.add(name)
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(module, nn.Embedding):
            tracer.embedding_calls.append(name)  # its lookups are judged as they happen
            tracer.looked_up.append(({}, []))
            s = tracer.split_of(x)
            if s is not None:
                trace.regions.break_(s.sources, "it is used as indices of an embedding lookup")
        else:
            p = tracer.partial_of(x)
            if p:
                trace.regions.break_(p, "a Linear takes the experts' partial sums")
            s = tracer.split_of(x)
            role = "opener" if s is None else "closer"
            if s is not None and x is not None and (s.dim != x.dim() - 1 or s.outer != 1):
                trace.regions.break_(
                    s.sources, "it reaches a Linear along a dim the Linear does not contract"
                )
                trace.regions.misfits[name] = (
                    "its input arrives split along a dim it does not contract"
                )
            elif s is not None:
                if name in trace.regions.closers and not trace.regions.closers[name].same_cut(s):
                    trace.regions.misfits[name] = "it is called twice with inputs split differently"
                trace.regions.closers[name] = s
                trace.regions.links.add(s.sources | {name})
            if (role == "opener" and name in trace.regions.closers) or (
                role == "closer" and name in trace.regions.openers
            ):
                trace.regions.misfits[name] = "it is called both on split and on unsplit inputs"
        tracer.quiet += 1
        arrived.append(tracer.split_of(x))

    def after(mod: nn.Module, args: Any, out: Any) -> None:
        tracer.quiet -= 1
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            tracer.carrying[id(out)] = out  # computed from the module's weight
        if isinstance(module, nn.Embedding):
            tracer.embedding_calls.pop()
            rows, bent = tracer.looked_up.pop()
            if bent or not (isinstance(out, torch.Tensor) and rows.get(id(out)) is out):
                trace.lookups.not_linear.setdefault(name, bent[0] if bent else "an op")
        unsplit = arrived.pop() is None
        if name in trace.layers.linears and unsplit and isinstance(out, torch.Tensor):
            features = trace.layers.linears[name][1]
            trace.regions.openers[name] = features
            if name in tracer.whole:
                # its split ends anyway: its output is whole, so it ties no one to it
                for reason in tracer.whole[name]:
                    trace.regions.break_(frozenset({name}), reason)
                return
            tracer.mark(out, Split(out.dim() - 1, 1, features, 1, frozenset({name})), "linear")
        elif (
            isinstance(module, nn.Embedding)
            and trace.lookups.token_ids.get(name) is False
            and isinstance(out, torch.Tensor)
            and out.shape[-1] == module.embedding_dim
        ):
            # A table looked up at computed positions (T5's relative position bias, one
            # column per head) may be split by its columns like a Linear's outputs.
            trace.regions.openers[name] = module.embedding_dim
            tracer.mark(
                out,
                Split(out.dim() - 1, 1, module.embedding_dim, 1, frozenset({name})),
                "embedding",
            )

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name.startswith(f"{p}.") for p in prefixes)


def _experts(
    tracer: _Tracer,
    name: str,
    module: nn.Module,
    *,
    sums: bool = True,
    holders: Iterable[str] = (),
) -> None:
    """Watch a module holding 3-D expert weights: what comes in (routing, for expert
    parallel), whether what goes out is the sum of partial sums, which attribute holds its
    number of experts. With `sums` false its parent, holding more expert weights in other
    children, is the one whose output sums the partial sums; for that parent, `holders`
    are those children."""
    trace = tracer.trace
    # its own parameters, and those of children holding expert weights for it
    own = {f"{name}.{p}" if name else p for p, _ in module.named_parameters()}
    experts = {p.shape[0] for p in module.parameters() if p.dim() == 3}

    def before(mod: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        tracer.running.append(name)
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(tracer.split_of(t) is not None for t in leaves):
            trace.experts.exits[name] = "its input arrives split"
        ids = [t for t in leaves if not t.is_floating_point()]
        weights = [t for t in leaves if t.is_floating_point() and ids and t.shape == ids[0].shape]
        if len(ids) == 1 and len(weights) == 1:
            tracer.routing[id(weights[0])] = weights[0]
        trace.experts.routing.setdefault(
            name,
            None
            if len(ids) == 1 and len(weights) == 1
            else "it does not take one integer tensor of chosen experts and one tensor of "
            "their weights shaped like it",
        )

    def after(mod: nn.Module, args: Any, out: Any) -> None:
        tracer.running.pop()
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        outs = [t for t in outs if t.is_floating_point()]
        partial = [tracer.partial_of(t) for t in outs]
        if not outs or not all(partial):
            trace.experts.exits.setdefault(
                name, "its output is not a sum of its experts' partial sums"
            )
        else:
            trace.experts.exits.setdefault(name, None)
        frame = tracer.reads[-1] if tracer.reads else []
        trace.experts.counts.setdefault(name, set()).update(
            (m, a, v) for m, a, v in frame if v in experts and m == name
        )
        if not sums:
            return
        for k, (_, sources) in list(tracer.partials.items()):
            if sources & own or not sources:
                del tracer.partials[k]  # summed by the all-reduce at the module's output
        for k, (_, children) in list(tracer.wholes.items()):
            if any(tracer.whole_owner.get(c) == name for c in children):
                del tracer.wholes[k]

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)
    for child, m in module.named_modules():
        full = f"{name}.{child}" if name else child
        # (one inside a child holding expert weights is that child's)
        if child and next(m.parameters(), None) is None and not _under(full, holders):
            _whole_output(tracer, full, name, m)


def _whole_output(tracer: _Tracer, name: str, owner: str, module: nn.Module) -> None:
    """Watch a parameter-free submodule of an experts module: an output it makes whole
    (not split, not a partial sum) is the same on every rank, and if it is added to the
    experts' partial sums, the plan scales it by 1/tp (`Trace.added_whole`)."""

    def after(mod: nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(tracer.whole_of(t) is not None for t in ins):
            return None  # made from another's whole output: that one is scaled already
        if tracer.split_of(out) is not None or tracer.partial_of(out) is not None:
            return None
        if any(out is t for t in ins):
            # an identity hands back its input: mark a view of it, so that other uses of
            # the input are not taken for uses of this output
            out = out.view_as(out)
        tracer.wholes[id(out)] = (out, frozenset({name}))
        tracer.whole_owner[name] = owner
        return out

    module.register_forward_hook(after, with_kwargs=True)


_READS = "_tpplan_reads"
_WATCHING: dict[type, type] = {}


def _watched(cls: type) -> type:
    """A subclass of `cls` that logs reads of integer attributes (see `_watch_reads`)."""
    sub = _WATCHING.get(cls)
    if sub is None:

        def __getattribute__(self: Any, attr: str) -> Any:
            value = super(sub, self).__getattribute__(attr)  # type: ignore[arg-type]
            if type(value) is int:
                log = object.__getattribute__(self, "__dict__").get(_READS)
                if log is not None:
                    log[0].reads[-1].append((log[1], attr, value))
                    log[0].trace.reads.ints.add((log[1], attr))
                    log[0].fresh.append((log[1], attr, value))
            return value

        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__})
        sub.__qualname__ = cls.__qualname__
        sub.__module__ = cls.__module__
        _WATCHING[cls] = sub
    return sub


def _watch_reads(model: nn.Module, tracer: _Tracer) -> None:
    """Make the modules of the traced copy log every integer attribute their forward reads
    into `tracer.reads`, so that a number given to an op can be traced to the attribute it
    came from (`view(B, T, self.n_head, hd)`, `split(self.split_size)`), and a number that
    only happens to equal some attribute is not mistaken for it."""
    for name, m in model.named_modules():
        m.__dict__[_READS] = (tracer, name)
        m.__class__ = _watched(type(m))


def _track(tracer: _Tracer, name: str, module: nn.Module) -> None:
    """Give each running forward its own frame of attribute reads (`tracer.reads`)."""

    def enter(mod: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        tracer.reads.append([])
        tracer.trace.layers.ran.add(name)
        if name not in tracer.trace.layers.entries:
            # where its first tensor input came in, and which tensor it was
            found: list[tuple[int | str, torch.Tensor]]
            found = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            found += [(k, a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)]
            if found:
                where, tensor = found[0]
                tracer.trace.layers.entries[name] = (where, id(tensor))
                tracer.held.append(tensor)

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        tracer.reads.pop()

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, always_call=True)


def _structure(module: nn.Module) -> tuple[Any, ...]:
    """What two blocks must share to be traced once: module types and parameter shapes."""
    mods = tuple((n, type(m).__qualname__) for n, m in module.named_modules())
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    return mods, params


_WHOLE_STACK = 8  # stacks this short are traced block by block (see `_repeats`)


def _repeats(model: nn.Module) -> dict[int, tuple[str, int, dict[int, int]]]:
    """Outermost ModuleLists worth shortening: id -> (name, blocks kept, {block: first twin}).

    A shortened stack assumes that blocks of one structure behave alike, which a forward
    that hands some layers extra inputs by index breaks (NeoMME gives its value embeddings
    to its first and last global layers only). Stacks of up to 8 blocks, where tracing
    every block costs little, are traced whole for that reason."""
    found: dict[int, tuple[str, int, dict[int, int]]] = {}
    taken: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) <= _WHOLE_STACK:
            continue
        if any(name.startswith(p + ".") for p in taken):
            continue
        shapes = [_structure(c) for c in m]
        first: dict[Any, int] = {}
        for i, s in enumerate(shapes):
            first.setdefault(s, i)
        keep = max(2, max(first.values()) + 1)
        if keep >= len(m):
            continue
        found[id(m)] = (
            name,
            keep,
            {i: first[shapes[i]] for i in range(len(m)) if first[shapes[i]] != i},
        )
        taken.append(name)
    return found


def _fake_copy(
    model: nn.Module, fake: FakeTensorMode, trace: Trace, *, shorten: bool, real: bool = False
) -> nn.Module:
    """A copy of `model` whose parameters and buffers are fake tensors (no storage copied);
    with `real`, the model's own tensors (shared, not copied)."""
    memo: dict[int, Any] = {}
    repeats = _repeats(model) if shorten else {}
    # Tensors of blocks left out are never copied; making fakes of them would cost the most.
    skipped = {
        id(t)
        for m in model.modules()
        if id(m) in repeats
        for block in list(m.children())[repeats[id(m)][1] :]
        for t in [*block.parameters(), *block.buffers()]
    }
    for p in model.parameters():
        if id(p) not in skipped:
            memo[id(p)] = p if real else nn.Parameter(fake.from_tensor(p), p.requires_grad)
    for b in model.buffers():
        if id(b) not in skipped:
            memo[id(b)] = b if real else fake.from_tensor(b)
    for m in model.modules():
        if id(m) in repeats:
            name, keep, twin = repeats[id(m)]
            prefix = f"{name}." if name else ""
            blocks = list(m.children())
            memo[id(m)] = nn.ModuleList([copy.deepcopy(blocks[i], memo) for i in range(keep)])
            trace.stacks.traced.extend(f"{prefix}{i}" for i in range(keep))
            for i, j in twin.items():
                into = trace.stacks.untraced if i >= keep else trace.stacks.twins
                into[f"{prefix}{i}"] = f"{prefix}{j}"
    return copy.deepcopy(model, memo)


def _example_inputs(
    model: nn.Module, example_inputs: Any, device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) for the traced forward, from the caller or from the forward signature."""
    if example_inputs is not None:
        if isinstance(example_inputs, dict):
            return (), dict(example_inputs)
        if isinstance(example_inputs, (tuple, list)):
            return tuple(example_inputs), {}
        return (example_inputs,), {}
    # Batch 2, sequence 16: distinct sizes, so a broadcast batch dim is never taken for a split.
    kwargs: dict[str, Any] = dict(_derived_inputs(model, batch=2, seq=16, device=device))
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        kwargs["use_cache"] = False  # no cache to fill: its writes are not part of the math
    return (), kwargs


def idle_roots(
    names: Iterable[str], ran: Iterable[str], traced: Callable[[str], str] = str
) -> list[str]:
    """The largest parts that hold one of `names` and nothing in `ran` (the modules that ran,
    named as `traced` maps a name: an untraced repeat to the block traced in its place). A
    container such as a ModuleList never runs itself, but holds what did."""
    busy = {""}
    for name in ran:
        parts = name.split(".")
        busy.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    roots = set()
    for name in names:
        parts = name.split(".")
        prefixes = (".".join(parts[:k]) for k in range(1, len(parts) + 1))
        root = next((p for p in prefixes if traced(p) not in busy), None)
        if root is not None:
            roots.add(root)
    return sorted(roots)


def trace_model(model: nn.Module, *, example_inputs: Any = None, shorten: bool = True) -> Trace:
    """Run `model` once on fake tensors and return the data-flow facts.

    `shorten` traces long stacks of identical blocks through a prefix (see the module
    docstring); pass False to trace every block.
    """
    # once, on fake tensors: not once per rank when every rank is simulated in this process
    with outside_simulation():
        return _trace(model, example_inputs, shorten)


def _trace(model: nn.Module, example_inputs: Any, shorten: bool) -> Trace:
    try:
        return _trace_once(model, example_inputs, shorten, real=False)
    except TraceError as e:
        if shorten and _repeats(model):
            # a forward that indexes its blocks by the config's layer count (Gemma 3n's
            # per-layer inputs) fails on a shortened copy: trace every block instead
            try:
                return _trace(model, example_inputs, shorten=False)
            except TraceError:
                pass
        # Routing that depends on the values (`nonzero`, `.item()`) cannot run on fake
        # tensors; a model whose weights are in memory is traced on them instead (the
        # tracer watches the same ops; the weights are shared, not copied).
        data_dependent = isinstance(
            e.__cause__, (DataDependentOutputException, DynamicOutputShapeException)
        )
        on_meta = any(p.device.type == "meta" for p in model.parameters())
        if not data_dependent or on_meta:
            if data_dependent:
                raise TraceError(
                    f"{e} Its forward depends on the values (routing by `nonzero` or `.item()`), "
                    "which a model on the meta device cannot provide: infer the plan from a "
                    "small copy of the model built on the CPU (a config with fewer layers and "
                    "narrower widths), and use that plan for the big one."
                ) from e.__cause__
            raise
        return _trace_once(model, example_inputs, shorten, real=True)


def _trace_once(model: nn.Module, example_inputs: Any, shorten: bool, *, real: bool) -> Trace:
    """Trace until the regions settle: a layer whose split ends somewhere is kept whole or
    gathered by any plan, so its output is whole, but in the pass that found it, it may
    already have reached other layers and tied them into its dead region (ALBERT's shared
    layer, called first on the split output of the embedding projection). Those layers are
    traced again with it whole from the start: the next pass judges them on what the
    sharded model will compute. infer_plan and check_plan both see the settled trace."""
    whole: dict[str, list[str]] = {}
    for _ in range(3):
        trace = _trace_pass(model, example_inputs, shorten, real=real, whole=whole)
        tied = {
            src: reasons
            for src, reasons in trace.regions.broken.items()
            if src in trace.regions.openers
            and src not in whole
            and any(src in group and len(group) > 1 for group in trace.regions.links)
        }
        if not tied:
            break
        whole = {**whole, **tied}
    return trace


def _trace_pass(
    model: nn.Module,
    example_inputs: Any,
    shorten: bool,
    *,
    real: bool,
    whole: dict[str, list[str]],
) -> Trace:
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    trace = Trace()
    copy_ = _fake_copy(model, fake, trace, shorten=shorten, real=real)
    copy_.eval()
    params = {id(p): n for n, p in copy_.named_parameters(remove_duplicate=False)}
    tracer = _Tracer(trace, params)
    tracer.whole = whole
    for name, m in copy_.named_modules():
        if isinstance(m, nn.Linear) and _plain_forward(m, nn.Linear):
            trace.layers.linears[name] = (m.in_features, m.out_features, False)
        elif not isinstance(m, nn.Embedding):
            # a Linear subclass with a forward of its own (a block-diagonal grouped product,
            # say) is judged by what it computes, like any other module
            stored_in_out = _linear_like(m, fake)
            if stored_in_out is not None:
                rows, cols = m.weight.shape
                trace.layers.linears[name] = (
                    (rows, cols, True) if stored_in_out else (cols, rows, False)
                )
    # after the probes: reads made by a probe's forward are no evidence of the traced one
    _watch_reads(copy_, tracer)
    _watch_lookup_slots(copy_, tracer)
    holders = {
        name: m
        for name, m in copy_.named_modules()
        if not isinstance(m, (nn.Linear, nn.Embedding))
        and name not in trace.layers.linears
        and any(p.dim() == 3 for p in m.parameters(recurse=False))
    }
    # experts whose weights two children hold (JetMoE's block: one child's per-expert matmuls
    # open the split, another's close it) are judged at that parent, which sums them
    parents = {
        name: m
        for name, m in copy_.named_modules()
        if name not in holders
        and not isinstance(m, (nn.ModuleList, nn.ModuleDict))  # a container, never called
        and sum(f"{name}.{c}".lstrip(".") in holders for c, _ in m.named_children()) >= 2
    }
    for name, m in holders.items():
        tracer.expert_params |= {
            f"{name}.{p}" if name else p
            for p, w in m.named_parameters(recurse=False)
            if w.dim() >= 2
        }
        _experts(tracer, name, m, sums=name.rpartition(".")[0] not in parents)
    for name, m in parents.items():
        _experts(tracer, name, m, holders=[h for h in holders if _under(h, [name])])
    for name, m in copy_.named_modules():
        _track(tracer, name, m)
        if name in trace.layers.linears or isinstance(m, nn.Embedding):
            _hook(tracer, name, m)
    args, kwargs = _example_inputs(model, example_inputs, device)
    if not real:
        with fake:
            args, kwargs = pytree.tree_map(
                lambda x: fake.from_tensor(x) if isinstance(x, torch.Tensor) else x,
                (args, kwargs),
            )
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            tracer.inputs[id(x)] = x
    try:
        with torch.no_grad(), fake if not real else nullcontext(), tracer, _Attention(tracer):
            out = copy_(*args, **kwargs)
    except TpplanError:
        raise
    except Exception as e:
        raise TraceError(
            f"could not run {type(model).__name__} on fake tensors to trace it ({type(e).__name__}: {e}). "
            "Pass example_inputs that its forward accepts, or write the plan by hand."
        ) from e
    for t in tensor_leaves(out):
        s = tracer.split_of(t)
        if s is not None:
            trace.regions.at_output |= s.sources
    return trace
