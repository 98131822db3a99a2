"""`Experts`: mixture-of-experts modules, split per expert like a dense MLP.

Start at `Experts.on_op`. A module holding 3-D expert weights runs batched per-expert matmuls
(`grouped_mm`, `bmm`, or `mm` on one expert's 2-D view): one on an unsplit input opens a split
of its output features, like a Linear; one on an input split on its contracted dim closes it
and leaves each rank's partial sum. Partial sums stay partial through ops linear in them, up
to the module's output, where the plan's all-reduce adds them up (`follow_partial`). The hooks
call `enter` and `leave` around the module's forward; what is found goes to the trace's
`ExpertFacts` (and `SpanFacts`, for the weights' roles).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from ..._runtime.torch_compat import tree_leaves
from ..ops import ADDS, LINEAR_IN_PARTIAL, MADE_LIKE, METADATA, PASS_THROUGH, Op, linear_in
from ..record import AttributeRead, ExpertFacts, SpanFacts
from ..split import Split, norm_dim, permutation
from .dense import DenseSplits
from .origins import Origins
from .wholes import WholeOutputs

__all__ = ["ExpertWeights", "Experts"]

# Ops making an accumulator of nothing yet: zeros, or a buffer whose entries the forward
# writes before it reads them (torchtitan's `out.new_empty(shape)` then `buf[idx] = out`);
# where it read one it did not write, the unsharded model would read garbage as well.
ZEROS = {"zeros", "zeros_like", "new_zeros", "zero_", "empty", "empty_like", "new_empty"}

# Matrix products: one of a followed tensor with an unfollowed one computes something new.
_PRODUCTS = {"mm", "addmm", "bmm", "matmul", "linear", "baddbmm"}

# Why expert mode is refused to a module given tokens grouped by expert whose forward did
# not show the counts setting the groups (`Experts._follow_counts`).
_UNPROVEN_GROUPS = (
    "it takes tokens and one integer count per expert, but its forward did not show the "
    "counts' running sum setting the groups of a grouped matmul, so the tokens are not "
    "known to come grouped by expert"
)

# (expert parameter, the stored dim behind each dim of a view of it; None if new)
ExpertView = tuple[str, tuple[int | None, ...]]


class ExpertWeights:
    """Expert weights and views of them (transposed, one expert selected, gathered per
    token): id -> (view, parameter, the stored dim behind each dim of the view; None where
    the view made a dim of its own)."""

    def __init__(self, origins: Origins) -> None:
        self.origins = origins
        self.views: dict[int, tuple[torch.Tensor, str, tuple[int | None, ...]]] = {}

    def view_of(self, t: Any) -> ExpertView | None:
        """(expert parameter, stored dim behind each dim) when `t` is one or a view of one."""
        if not isinstance(t, torch.Tensor):
            return None
        view = self.views.get(id(t))
        if view is not None and view[0] is t:
            return view[1], view[2]
        name = self.origins.param_itself(t)
        if name is not None and name in self.origins.expert_params:
            return name, tuple(range(t.dim()))
        return None

    def note(self, op: Op) -> None:
        """Follow views of expert parameters (transposes, per-token gathers of experts)."""
        name, a, ins, outs = op.name, op.named, op.ins, op.outs
        if len(outs) != 1 or not ins:
            return
        found = self.view_of(ins[0])
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


class Experts:
    """Views of expert weights, the partial sums their matmuls leave, and the routing."""

    def __init__(
        self,
        facts: ExpertFacts,
        spans: SpanFacts,
        origins: Origins,
        splits: DenseSplits,
        whole_outputs: WholeOutputs,
    ) -> None:
        self.facts = facts
        self.spans = spans
        self.origins = origins
        self.splits = splits
        self.whole_outputs = whole_outputs
        self.weights = ExpertWeights(origins)
        # Tensors holding each rank's partial sum of expert outputs (closing expert matmuls
        # and what is linear in them): id -> (tensor, sources). Zeros are a partial sum of
        # nothing (empty sources): an accumulator they start may take partial sums.
        self.partials: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}
        self.running: list[str] = []  # experts modules whose forward is running, innermost last
        # Routing weights an experts module was given, and views of them; partial sums they
        # scaled (id -> tensor).
        self.routing: dict[int, torch.Tensor] = {}
        self.weighted: dict[int, torch.Tensor] = {}
        # Tensors computed from the outputs of layers whose split ended (id -> (tensor, those
        # layers)): one that reaches an integer input of an experts module made its routing.
        self.routed_by: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}
        # The counts of tokens per expert an experts module was given, and what was computed
        # from them (id -> (tensor, the module, "counts" or their running sum "ends")); and
        # per module running, whether those ends set a grouped matmul's groups.
        self.counted: dict[int, tuple[torch.Tensor, str, str]] = {}
        self.grouped: dict[str, bool] = {}

    # ---- what a tensor is -----------------------------------------------------------------
    def running_param(self, t: Any) -> ExpertView | None:
        """(name, ()) when `t` is a parameter of the innermost experts module running, held
        by that module itself (JetMoE's bias, added to the experts' partial sums)."""
        p = self.origins.param_of(t)
        if p is None or not self.running or p.rpartition(".")[0] != self.running[-1]:
            return None
        return p, ()

    def partial_of(self, t: Any) -> frozenset[str] | None:
        """The expert weights whose partial sums `t` holds (empty: zeros, a sum of none)."""
        entry = _held(self.partials, t)
        return entry[1] if entry is not None else None

    # ---- ops --------------------------------------------------------------------------------
    def on_op(self, op: Op) -> bool:
        """Follow expert views, partial sums, routing weights and whole outputs through one
        op; True when the op was the experts' own (no dense rule applies to it)."""
        name, ins, outs = op.name, op.ins, op.outs
        self.weights.note(op)
        if self.routed_by:
            self._follow_routing_source(op)
        if self.counted:
            self._follow_counts(op)
        # a tensor made like another reads nothing of its values (`out.new_zeros(...)` after
        # the experts' partial sums, torchtitan's padding row): it uses no partial sum
        partial = (
            []
            if name in MADE_LIKE
            else [p for p in (self.partial_of(t) for t in ins) if p is not None]
        )
        zeros = (
            name in ZEROS
            or (name in ("new_full", "full_like", "full") and op.named.get("fill_value") == 0)
            or (name in PASS_THROUGH and len(ins) == 1 and partial == [frozenset()])
        )
        # a sum is floating point: integer zeros start a count or a mask (`one_hot`)
        zeros = zeros and len(outs) == 1 and outs[0].is_floating_point()
        if zeros:
            self.partials[id(outs[0])] = (outs[0], frozenset())
        if (
            not any(partial)
            and name in LINEAR_IN_PARTIAL
            and len(outs) == 1
            and ins
            and self.routing.get(id(ins[0])) is ins[0]
        ):
            self.routing[id(outs[0])] = outs[0]
        # an accumulator of nothing yet (zeros) changed in place by anything but a zero
        # fill must be judged too: `acc.index_add_(0, i, x)` with a whole x first would
        # otherwise leave it looking like a sum of nothing
        into_empty = name.endswith("_") and not zeros and self.partial_of(ins[0]) == frozenset()
        if into_empty and not any(partial) and name in ("copy_", "fill_"):
            # overwritten with plain values (an empty buffer filled): no accumulator any more,
            # unless filled with zeros
            if not (name == "fill_" and op.named.get("value") == 0):
                self.partials.pop(id(ins[0]), None)
            into_empty = False
        if any(partial) or into_empty:
            self.follow_partial(op, frozenset().union(*partial))
            return True
        if self.whole_outputs.tensors and any(self.whole_outputs.of(t) is not None for t in ins):
            self.whole_outputs.follow(op)
        return name in ("_grouped_mm", "bmm", "mm") and self.product(op)

    # ---- tokens grouped by expert ----------------------------------------------------------
    def _follow_counts(self, op: Op) -> None:
        """Follow the count of tokens per expert an experts module was given: its running sum
        (`cumsum`, cast or viewed) used as a grouped matmul's group ends (`offs`) shows the
        tokens come grouped by expert in expert order, `counts[e]` rows each (torchtitan's
        GroupedExperts), which expert mode needs to hand each rank its experts' groups."""
        if op.name == "_grouped_mm":
            entry = _held(self.counted, op.named.get("offs"))
            if entry is not None and entry[2] == "ends":
                self.grouped[entry[1]] = True
            return
        found = [g for g in (_held(self.counted, t) for t in op.ins) if g is not None]
        if not found or len(op.outs) != 1:
            return
        (_, owner, kind), out = found[0], op.outs[0]
        if op.name == "cumsum" and kind == "counts":
            self.counted[id(out)] = (out, owner, "ends")
        elif op.name in ("_to_copy", "to", "view", "alias", "clone", "detach", "contiguous"):
            self.counted[id(out)] = (out, owner, kind)

    # ---- routers ----------------------------------------------------------------------------
    def split_ended(self, op: Op, sources: frozenset[str]) -> None:
        """The split of `sources` ended at `op`: what it computes from here on is followed,
        to see whether it chooses an experts module's routing (`ExpertFacts.routers`)."""
        for o in op.outs:
            self.routed_by[id(o)] = (o, sources)

    def _follow_routing_source(self, op: Op) -> None:
        found = [e[1] for e in (_held(self.routed_by, t) for t in op.ins) if e is not None]
        if found and op.name in _PRODUCTS and len(found) < len(op.ins):
            # a product with a matrix of its own (transformers' DeepSeek-V3 router, a
            # module with its own weight, not a Linear) computes anew: the layers before it
            # do not choose the routing, it does
            return
        if found:
            for o in op.outs:
                self.routed_by[id(o)] = (o, frozenset().union(*found))

    def product(self, op: Op) -> bool:
        """A batched per-expert matmul with an expert weight: opens a split of its output
        features (unsplit input) or closes one (input split on the contracted dim), leaving
        each rank's partial sum. False when no expert weight takes part."""
        name, out, spans, roles = op.name, op.out, self.spans, self.facts.roles
        first, second = op.named["self"], op.named["mat2"]
        if name in ("_grouped_mm", "mm") or self.weights.view_of(second) is not None:
            x, w = first, second
            x_in, w_in, w_out = first.dim() - 1, second.dim() - 2, second.dim() - 1
        else:
            x, w = second, first
            x_in, w_in, w_out = 1, 2, 1
        found = self.weights.view_of(w)
        # one expert's weight (a 2-D view) in `mm`, or all of them (3-D) batched
        if found is None or w.dim() != (2 if name == "mm" else 3):
            return False
        pname, dims = found
        if name == "_grouped_mm":
            self.facts.grouped_mm.add(pname)
        stored_in, stored_out = dims[w_in], dims[w_out]
        if stored_in in (None, 0) or stored_out in (None, 0):
            return False
        out_dim = out.dim() - 1 if w_out == w.dim() - 1 else 1
        s = self.splits.split_of(x)
        if s is None:
            if roles.get(pname, ("open",))[0] != "open":
                spans.misfits[pname] = "it is called both on split and on unsplit inputs"
            features = out.shape[out_dim]
            spans.openers[pname] = features
            roles[pname] = ("open", stored_out)
            self.splits.mark(out, Split(out_dim, 1, features, 1, frozenset({pname})), name)
        elif s.dim == x_in and s.outer == 1:
            if roles.get(pname, ("close",))[0] != "close" or (
                pname in spans.closers and not spans.closers[pname].same_cut(s)
            ):
                spans.misfits[pname] = "it is called both on split and on unsplit inputs"
            roles[pname] = ("close", stored_in)
            spans.closers[pname] = s
            spans.links.add(s.sources | {pname})
            self.partials[id(out)] = (out, s.sources | {pname})
        else:
            spans.break_(s.sources, f"{name}: an expert matmul takes it along another dim")
        return True

    def bias_alike(self, t: torch.Tensor, s: Split, nd: int) -> bool:
        """A per-expert bias gathered per token and added to an opening expert matmul's
        split output: split alike, with that weight."""
        found = self.weights.view_of(t)
        if found is None or len(s.sources) != 1:
            return False
        (src,) = s.sources
        k = s.dim - (nd - t.dim())
        if self.facts.roles.get(src, ("",))[0] != "open" or k < 0:
            return False
        stored = found[1][k]
        if stored in (None, 0) or t.shape[k] != s.outer * s.n * s.inner:
            return False
        self.facts.biases[found[0]] = (src, stored)
        return True

    # ---- partial sums -----------------------------------------------------------------------
    def follow_partial(self, op: Op, sources: frozenset[str]) -> None:
        """Partial sums stay partial through ops linear in them: the all-reduce after the
        experts then gives what the unsharded model computes. Anything else ends them."""
        name, ins, outs = op.name, op.ins, op.outs
        floats = [t for t in ins if t.is_floating_point()]
        partial = [t for t in floats if self.partial_of(t) is not None]
        others = [t for t in floats if self.partial_of(t) is None]
        made_whole = [self.whole_outputs.of(t) for t in others]
        if name in METADATA or op.func.namespace == "prim":
            return
        if name not in ADDS:
            self.whole_outputs.used_otherwise(
                made_whole, f"{name} combines it with the experts' partial sums"
            )
        ok: bool | None = linear_in(name, ins, partial, others, self._unsplit)
        if ok is not None:
            if ok and any(self.routing.get(id(t)) is t for t in others):
                self.weighted.update((id(o), o) for o in outs)
        elif name in ADDS:
            ok = self._add(name, partial, others, made_whole, sources)
            if ok is None:
                return
        elif name in ("masked_fill", "masked_fill_", "where"):
            value = op.named.get("value", op.named.get("other"))
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

    def _add(
        self,
        name: str,
        partial: list[torch.Tensor],
        others: list[torch.Tensor],
        made_whole: list[frozenset[str] | None],
        sources: frozenset[str],
    ) -> bool | None:
        """A sum with the partial sums: fine when all it adds besides them is added once,
        whole, by the plan (per-expert biases, outputs of parameter-free submodules). None
        when it has ended the partial sums itself."""
        biases = [self.weights.view_of(t) or self.running_param(t) for t in others]
        # per-expert biases and outputs of parameter-free submodules (identity experts)
        # are whole on every rank: the plan adds each as 1/tp per rank
        ok = len(partial) >= 1 and all(
            b is not None or w is not None for b, w in zip(biases, made_whole, strict=True)
        )
        for b in biases:
            if b is not None:
                self.facts.after_sum[b[0]] = b[0].rpartition(".")[0]
                if any(self.weighted.get(id(t)) is t for t in partial):
                    self.facts.after_weighting.add(b[0])
        if ok:
            for child in frozenset().union(*(w for w in made_whole if w is not None)):
                self.facts.added_whole[child] = self.whole_outputs.owner[child]
        elif others and all(self.splits.split_of(t) is None for t in others):
            self.end_partial(
                sources,
                partial,
                f"{name} adds to the experts' partial sums a tensor made without the split "
                "weights (the same on every rank, so the all-reduce would count it tp "
                "times), and not as the output of a parameter-free submodule, which the "
                "plan could scale by 1/tp",
            )
            return None
        return ok

    def end_partial(self, sources: frozenset[str], partial: list[torch.Tensor], why: str) -> None:
        """The partial sums of `sources` end here, for this reason."""
        self.spans.break_(sources, why)
        if not sources and self.running:
            # a sum no expert with weights has reached yet: no weight to blame, so the
            # experts module running holds the reason (`ExpertFacts.sum_breaks`)
            self.facts.sum_breaks.setdefault(self.running[-1], why)
        for t in partial:
            self.partials.pop(id(t), None)

    def _unsplit(self, t: torch.Tensor) -> bool:
        return self.splits.split_of(t) is None

    # ---- an experts module's forward ---------------------------------------------------------
    def enter(
        self, name: str, args: Any, kwargs: dict[str, Any], *, experts: Collection[int] = ()
    ) -> None:
        """An experts module's forward starts: what it is given tells whether it takes the
        routing (the chosen experts and their weights, or tokens grouped by expert and the
        count of each group, for `experts`: its numbers of experts) as inputs."""
        self.running.append(name)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(self.splits.split_of(t) is not None for t in leaves):
            self.facts.exits[name] = "its input arrives split"
        ids = [t for t in leaves if not t.is_floating_point()]
        for t in ids:
            found = _held(self.routed_by, t)
            if found is not None:
                for layer in found[1]:
                    self.facts.routers.setdefault(layer, name)
        weights = [t for t in leaves if t.is_floating_point() and ids and t.shape == ids[0].shape]
        if len(ids) == 1 and len(weights) == 1:
            self.routing[id(weights[0])] = weights[0]
        tokens = [t for t in leaves if t.is_floating_point()]
        # (tokens, tokens per expert): rows grouped by expert in order, counts[e] rows each
        by_counts = (
            len(ids) == 1
            and not weights
            and ids[0].dim() == 1
            and ids[0].shape[0] in experts
            and len(tokens) == 1
            and tokens[0].dim() == 2
        )
        if by_counts:
            # believed only once its forward shows it: the counts' running sum marks the
            # groups of a grouped matmul (`_grouped_mm`'s offs; see `_follow_counts`)
            self.counted[id(ids[0])] = (ids[0], name, "counts")
            self.grouped.setdefault(name, False)
        self.facts.routing.setdefault(
            name,
            None
            if (len(ids) == 1 and len(weights) == 1)
            else _UNPROVEN_GROUPS
            if by_counts
            else "it does not take one integer tensor of chosen experts and one tensor of "
            "their weights shaped like it, nor tokens grouped by expert and one integer "
            "count per expert",
        )

    def leave(
        self,
        name: str,
        out: Any,
        frame: list[AttributeRead],
        *,
        experts: set[int],
        own: set[str],
        sums: bool,
    ) -> None:
        """An experts module's forward returned `out`: it must be a sum of partial sums.
        `frame`: the attributes its forward read (one of them its number of experts, one
        of `experts`); `own`: its parameters and those of children holding expert weights
        for it; with `sums`, its output is where the all-reduce sums them."""
        self.running.pop()
        # its routing is made: what came of ended splits is not followed further (it would
        # otherwise hold every later activation of the trace)
        self.routed_by.clear()
        self.counted = {k: v for k, v in self.counted.items() if v[1] != name}
        if self.grouped.pop(name, False) and self.facts.routing.get(name) == _UNPROVEN_GROUPS:
            self.facts.by_counts.add(name)
            self.facts.routing[name] = None
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        outs = [t for t in outs if t.is_floating_point()]
        partial = [self.partial_of(t) for t in outs]
        if not outs or not all(partial):
            self.facts.exits.setdefault(
                name, "its output is not a sum of its experts' partial sums"
            )
        else:
            self.facts.exits.setdefault(name, None)
        self.facts.counts.setdefault(name, set()).update(
            (m, a, v) for m, a, v in frame if v in experts and m == name
        )
        # a child whose own per-expert matmuls both open and close the split sums its output
        # itself, though its parent holds 3-D weights in another child too (an attention's
        # raw `w_o` of (heads, head_dim, width) beside the experts): only partial sums begun
        # in a sibling (JetMoE's split handed from one child to the other) wait for the parent
        sums = sums or bool(outs and all(p and p <= own for p in partial))
        if not sums:
            return
        for k, (_, sources) in list(self.partials.items()):
            if sources & own or not sources:
                del self.partials[k]  # summed by the all-reduce at the module's output
        self.whole_outputs.drop_owned_by(name)


def _held(table: dict[int, Any], t: Any) -> Any:
    """`table`'s entry for tensor `t` ((t, ...), keyed by its id), if it is `t`'s: a tensor
    freed since may have left its id to another."""
    entry = table.get(id(t)) if isinstance(t, torch.Tensor) else None
    return entry if entry is not None and entry[0] is t else None
