"""infer_plan: a tensor-parallel plan from a model's data flow.

Start at `infer_plan`. `tpplan/trace/` runs the model once on fake tensors and returns facts
(which Linear's split features reach which Linear, through which ops, and what stopped them);
this module groups those facts into regions and decides each module's style:

- a region is the openers and closers that exchanged split tensors; it is sharded when every
  split ended at a closer that contracts it, nothing broke it, no weight in it is shared, and
  tp divides its smallest head count: openers colwise, closers rowwise, and modules whose
  parameters act on the split tensors (per-head norms) replicate_grad_sum;
- an Embedding looked up with the model's input ids is vocab_parallel;
- a Linear whose split output reaches the model output over the vocab is colwise, gathered;
- everything else stays replicated, with the reason in `why`.

Module names are used only to print patterns and to name partners in `why`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from torch import nn

from .._runtime.facts import fingerprint, parameter_shapes, tied_groups, weight_split
from ..errors import TpplanError
from ..plan.patterns import collapse
from ..plan.schema import AttributeRule, ModelInfo, Options, Plan, Rule
from ..trace import Trace, block_structure, trace_model
from .blocks import ran_modules, regions_within_blocks, spread_to_untraced
from .decision import NOT_CALLED, Attributes, Decision
from .names import (
    PLAIN_OPS,
    join,
    join_names,
    own_params,
    relative,
    shared_params,
)
from .regions import find_regions
from .uncalled import copy_from_alike, infer_uncalled_parts

__all__ = ["infer_plan"]

_ANY_TP = 8  # see infer_plan: the tp sizes a plan inferred without one should serve


def infer_plan(
    model: nn.Module,
    *,
    tp_size: int | None = None,
    example_inputs: Any = None,
    loss_parallel: bool = False,
    sequence_parallel: bool = False,
    experts: str = "tensor",
) -> Plan:
    """Infer a plan from the model's data flow.

    The model may be on the meta device; no weights are read. `example_inputs` (a tensor, a
    tuple of positional inputs, or a dict of keyword inputs) replaces the inputs guessed from
    the forward signature (`input_ids` of shape (2, 16) for Hugging Face models). With
    `tp_size`, regions it cannot split stay replicated; without, the plan is valid for tp 2
    and records head sizes so that `check_plan` can judge any other tp size.

    With `loss_parallel`, an output head split over the vocab hands back logits still split
    (a DTensor) instead of gathering them; compute the loss inside
    `torch.distributed.tensor.parallel.loss_parallel()`.

    With `sequence_parallel`, the activations between split regions (the residual stream)
    stay a DTensor split over the sequence (dim 1): each region all-gathers its input and
    reduce-scatters its output instead of one all-reduce, and the modules with parameters
    between regions (norms) run on sequence shards. DTensor computes every op on that
    stream, so a model this does not fit fails loudly rather than computing wrong numbers;
    `tpplan verify` checks the numbers.

    Mixture-of-experts layers (3-D expert weights used by batched per-expert matmuls) are
    split per expert like a dense MLP with `experts="tensor"`; with `experts="expert"` each
    rank holds num_experts/tp whole experts, where the trace shows the module takes the
    routing as inputs and reads its number of experts from an attribute (else tensor).
    """
    if experts not in ("tensor", "expert"):
        raise ValueError(f"experts must be 'tensor' or 'expert', got {experts!r}.")
    if tp_size is not None and (
        isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1
    ):
        raise ValueError(f"tp_size must be a positive integer or None, got {tp_size!r}.")
    tp = tp_size or 2
    # A plan inferred for no particular tp size serves tp 2, 4 and 8 where its heads allow:
    # the layers it gathers must divide by 8 too (a router over 6 experts stays whole).
    gather_tp = tp_size or _ANY_TP
    decisions, attributes = _infer_decisions(
        model, example_inputs, tp, loss_parallel, sequence_parallel, experts, gather_tp
    )
    plan = Plan(
        model=ModelInfo(
            class_=type(model).__name__,
            fingerprint=fingerprint(model),
            parameters=parameter_shapes(model),
        ),
        options=Options(loss_parallel=loss_parallel, sequence_parallel=sequence_parallel),
        rules=_rules(model, decisions),
        attributes=_attribute_rules(model, attributes),
    )
    if sequence_parallel:
        _try_sequence_parallel(model, plan, tp, example_inputs)
    return plan


def _infer_decisions(
    model: nn.Module,
    example_inputs: Any,
    tp: int,
    loss_parallel: bool,
    sequence_parallel: bool,
    experts: str,
    gather_tp: int,
) -> tuple[dict[str, Decision], dict[str, tuple[tuple[str, ...], str]]]:
    trace = trace_model(model, example_inputs=example_inputs)
    decisions, attributes = _decide(
        model, trace, tp, loss_parallel, sequence_parallel, experts, gather_tp
    )
    if trace.stacks.traced:
        spread = spread_to_untraced(trace, decisions), spread_to_untraced(trace, attributes)
        if not regions_within_blocks(trace) or spread[0] is None or spread[1] is None:
            # a region crossed blocks, or twins disagreed: trace every block
            trace = trace_model(model, example_inputs=example_inputs, shorten=False)
            decisions, attributes = _decide(
                model, trace, tp, loss_parallel, sequence_parallel, experts, gather_tp
            )
        else:
            decisions, attributes = spread  # type: ignore[assignment]
    ran = ran_modules(trace)
    shared = shared_params(model)
    copy_from_alike(model, decisions, attributes, trace, ran, shared)
    used = trace.params.outside | set(trace.params.in_region)

    def infer_part(part: nn.Module, inputs: Any) -> tuple[dict[str, Decision], Attributes]:
        return _infer_decisions(part, inputs, tp, False, False, experts, gather_tp)

    infer_uncalled_parts(model, decisions, attributes, ran, shared, used, infer_part)
    return decisions, attributes


def _bent_lookup(op: str) -> str:
    return (
        f"kept whole: its forward applies {op} to the looked-up rows, which is not linear in "
        "them; a vocab-parallel lookup's partial rows are summed only after the forward"
    )


def _try_sequence_parallel(model: nn.Module, plan: Plan, tp: int, example_inputs: Any) -> None:
    """Run the plan once as check_plan does (a meta copy over fake ranks): a stream the model
    mixes with plain tensors (positions added to it, a gathered layer's output) fails here,
    with a message, rather than in the user's first forward."""
    from ..check.run import run_plan

    if example_inputs is not None:
        return  # the inputs are the caller's: their first forward tells
    for problem in run_plan(plan, model, tp_size=tp):
        raise TpplanError(
            f"sequence parallel does not fit {type(model).__name__}: its forward mixes the "
            f"sequence-split stream with whole tensors ({problem.message.rstrip('.')}). "
            "Infer without sequence parallel, or write those rules by hand."
        )


class _Decider:
    """The decisions for one traced model; see the module docstring for the rules."""

    def __init__(
        self, model: nn.Module, trace: Trace, tp: int, loss_parallel: bool, gather_tp: int = 2
    ) -> None:
        self.loss_parallel = loss_parallel
        self.gather_tp = gather_tp
        self.modules = dict(model.named_modules())
        self.trace = trace
        self.tp = tp
        self.tied = shared_params(model)
        self.decisions: dict[str, Decision] = {}
        self.attributes: dict[str, tuple[tuple[str, ...], str]] = {}  # module -> (attrs, why)
        self.kept: dict[str, str] = {}  # module -> why it stays replicated
        self.kept_experts: dict[str, str] = {}  # expert-holding module -> why it stays whole
        self.split_regions: list[tuple[list[str], list[str]]] = []  # (openers, closers)
        # modules that must stay whole even as gathered layers: tied or shared weights
        self.blocked: set[str] = {n for n in self.tied if n in trace.layers.linears}
        self.blocked |= {n for n in trace.layers.linears if self.used_outside(n)}
        # experts module -> the experts modules of its structure, itself included (see
        # `pool_experts`)
        self.alike: dict[str, list[str]] = {}
        groups: dict[Any, list[str]] = {}
        for owner in sorted(trace.experts.exits):
            if owner in self.modules:
                groups.setdefault(block_structure(self.modules[owner]), []).append(owner)
        for group in groups.values():
            self.alike.update(dict.fromkeys(group, group))

    def used_outside(self, name: str) -> bool:
        params = own_params(self.modules[name], name)
        return any(
            p in self.trace.params.outside or p in self.trace.params.in_region for p in params
        )

    def region(self, members: list[str]) -> None:
        t = self.trace
        openers = [m for m in members if m in t.regions.openers]
        closers = [m for m in members if m in t.regions.closers]
        short = relative(members)
        reasons: list[str] = []
        for m in members:
            for r in t.regions.broken.get(m, []):
                reasons.append(f"{short[m]}'s split ends at {r}")
            if m in t.regions.misfits:
                reasons.append(f"{short[m]}: {t.regions.misfits[m]}")
            if m in self.tied:
                reasons.append(
                    f"{short[m]}'s weight is shared with {join(self.tied[m])} (tied); sharding would untie it"
                )
            elif self.used_outside(m):
                reasons.append(f"{short[m]}'s weight is also used outside its own forward")
        if any(o in t.regions.at_output for o in openers):
            reasons.append("the split reaches the model output")
        if openers and not closers and not reasons:
            reasons.append("no Linear contracts its output features")
        units = (
            math.gcd(*(t.regions.units.get(o, t.regions.openers[o]) for o in openers))
            if openers
            else 0
        )
        if openers and units % self.tp:
            reasons.append(
                f"its features split into {units} indivisible blocks (heads), which tp {self.tp} does not divide"
            )
        helpers = self.helpers(set(openers), short, reasons)
        counts = {c for o in openers for c in t.reads.counts.get(o, ())}
        for module, attr, value in sorted(counts):
            if (module, attr) in t.reads.unsplit_sizes:
                reasons.append(
                    f"{attr} = {value} sizes the split features and also tensors that are not "
                    "split, so it cannot be divided"
                )
            elif not module:
                reasons.append(
                    f"the model's own forward reads {attr} = {value} to size the split features, "
                    "and a plan divides attributes of submodules only"
                )
            elif value % self.tp:
                reasons.append(
                    f"a view reads the head count {attr} = {value}, which tp {self.tp} does not divide"
                )
        if reasons:
            for m in members:
                self.kept[m] = f"kept whole: {'; '.join(dict.fromkeys(reasons))}"
            return
        self.split_regions.append((openers, closers))
        self.open(openers, closers, short, units)
        self.close(openers, closers, short)
        for module, attr, _ in sorted(counts):
            attrs = tuple(sorted({*self.attributes.get(module, ((), ""))[0], attr}))
            self.attributes[module] = (
                attrs,
                f"its forward reads {', '.join(attrs)} to view or cut the split features of "
                f"{join(sorted(short[o] for o in openers))} (with -1 or the rest for other "
                "dims); each rank must use its own share, so it is divided by the tp size",
            )
        for h in helpers:
            own = own_params(self.modules[h], h)
            by = join_names([short[o] for o in openers])
            if any(p in self.trace.params.split_vectors for p in own):
                names = [p.rpartition(".")[2] for p in own]
                self.decisions[h] = Decision(
                    "split_params",
                    f"{join(names)} {'holds' if len(names) == 1 else 'hold'} one entry per "
                    f"head (per element of the dim split by {by}) and meets them element by "
                    "element (a per-head sink); split alike, each rank holds its own heads' "
                    "entries",
                    shard=tuple((n, 0) for n in names),
                )
                continue
            self.decisions[h] = Decision(
                "replicate_grad_sum",
                f"its parameters act on the split features of {by} inside the region; each "
                "rank's gradient is a partial sum, summed over the tp axis",
            )

    def helpers(self, openers: set[str], short: dict[str, str], reasons: list[str]) -> list[str]:
        """Modules (not Linear) whose parameters meet this region's split tensors."""
        t = self.trace
        owners = {p.rpartition(".")[0] for p, srcs in t.params.in_region.items() if srcs & openers}
        out = []
        for owner in sorted(owners):
            module = self.modules.get(owner)
            label = owner.rpartition(".")[2] or type(module).__name__
            if not owner:
                # rules style submodules (parallelize_module matches child names): nothing
                # can split or sum the gradient of the root's own parameters
                reasons.append(
                    "the model's own parameters (not a submodule's) meet its split tensors, "
                    "and a plan styles submodules only"
                )
                continue
            if module is None or owner in t.layers.linears or isinstance(module, nn.Embedding):
                reasons.append(
                    f"the weight of {label} is used inside the region outside its own call"
                )
                continue
            own = own_params(module, owner)
            if any(
                p in t.params.outside or not (t.params.in_region.get(p, openers) <= openers)
                for p in own
            ):
                reasons.append(f"{label}'s parameters are used both inside and outside the region")
                continue
            split = [p for p in own if p in t.params.split_vectors]
            if split and (len(split) < len(own) or any(p in t.params.whole_vectors for p in split)):
                reasons.append(f"{label}'s parameters are used both split with the heads and whole")
                continue
            out.append(owner)
        return out

    def open(
        self, openers: list[str], closers: list[str], short: dict[str, str], units: int
    ) -> None:
        t = self.trace
        to = join_names([short[c] for c in closers])
        # `to` names the closers: the evidence a reviewer checks against the model's forward
        verb = "contracts" if len(closers) == 1 else "contract"
        inners = {t.regions.closers[c].inner for c in closers}
        for o in openers:
            out = t.regions.openers[o]
            ops = sorted(t.regions.ops.get(o, set()) - PLAIN_OPS)
            path = f"through {', '.join(ops)} to {to}" if ops else f"to {to}"
            partners = [short[p] for p in openers if p != o]
            mates = f" (with the outputs of {join_names(partners)})" if partners else ""
            heads = t.regions.heads.get(o)
            head_dim = out // heads if heads and out % heads == 0 else None
            parts = t.regions.parts.get(o)
            if parts is not None:
                # the pieces are cut apart before any view, so their head size shows where
                # they meet again: the closer's input, merged from (heads, head_dim)
                (inner,) = inners if len(inners) == 1 else (1,)
                head_dim = inner if inner > 1 and all(p % inner == 0 for p in parts) else None
                what, it = (
                    f"its {out} output features are {len(parts)} fused pieces "
                    f"({' | '.join(map(str, parts))}), cut apart in forward; each rank holds its "
                    "own slice of every piece, and they flow",
                    "them",
                )
            elif head_dim is not None:
                (inner,) = inners if len(inners) == 1 else (head_dim,)
                pieces = head_dim // inner if inner > 1 and head_dim % inner == 0 else 1
                per_head = (
                    f", each head's {pieces} fused pieces of {inner} side by side"
                    if 2 <= pieces <= 4
                    else ""
                )
                what, it = (
                    f"output split into {heads} heads of {head_dim} by a view{per_head}; it flows",
                    "it",
                )
            else:
                what, it = f"its {out} output features flow", "them"
            need = (
                f"; tp must divide {units} (the region's smallest head count)"
                if heads and units < heads
                else ""
            )
            self.decisions[o] = Decision(
                "colwise",
                f"{what} {path}{mates}, which {verb} {it} on its input dim (rowwise){need}",
                head_dim=head_dim,
                parts=parts,
                transposed=o in t.layers.linears and t.layers.linears[o][2],
            )

    def close(self, openers: list[str], closers: list[str], short: dict[str, str]) -> None:
        by = join_names([short[o] for o in openers])
        for c in closers:
            s = self.trace.regions.closers[c]
            head_dim = s.inner if s.inner > 1 else None
            what = f"{s.n} heads of {s.inner}" if head_dim else f"{s.n} features"
            self.decisions[c] = Decision(
                "rowwise",
                f"contracts the features split by {by} ({what}) on its input dim; its output is a "
                "partial sum, one all-reduce",
                head_dim=head_dim,
                transposed=self.trace.layers.linears[c][2],
            )

    def experts(self, members: list[str], mode: str) -> None:
        """A module's 3-D expert weights that open and close one region: split per expert
        like a dense MLP (mode tensor), or by experts (mode expert) where that is proven."""
        t = self.trace
        owners = {m.rpartition(".")[0] for m in members}
        owner = min(owners)
        parents = {o.rpartition(".")[0] for o in owners}
        if len(owners) > 1 and len(parents) == 1 and min(parents) in t.experts.exits:
            owner = min(parents)  # children hold the weights: judged where they meet
        module = self.modules.get(owner)
        short = {m: m.removeprefix(owner + ".") for m in members}
        openers = [m for m in members if t.experts.roles.get(m, ("",))[0] == "open"]
        closers = [m for m in members if t.experts.roles.get(m, ("",))[0] == "close"]
        reasons: list[str] = []
        one_place = owners == {owner} or parents == {owner}
        if not one_place or module is None or any(m not in t.experts.roles for m in members):
            reasons.append("its split features reach weights of other modules")
        for m in members:
            for r in t.regions.broken.get(m, []):
                reasons.append(f"{short[m]}'s split ends at {r}")
            if m in t.regions.misfits:
                reasons.append(f"{short[m]}: {t.regions.misfits[m]}")
        if not openers or not closers:
            reasons.append("no expert matmul contracts the split features")
        exit_ = t.experts.exits.get(owner, "it was not called")
        if exit_ is not None:
            reasons.append(exit_)
        units = (
            math.gcd(*(t.regions.units.get(o, t.regions.openers[o]) for o in openers))
            if openers
            else 0
        )
        if openers and units % self.tp:
            reasons.append(
                f"its experts' hidden features split into blocks of {units}, which tp {self.tp} does not divide"
            )
        if t.reads.counts.get(owner) or any(t.reads.counts.get(o) for o in openers):
            reasons.append("its forward reads attributes to size the split features")
        prefix = owner + "."
        # pooled over the modules of its structure (see `pool_experts`)
        alike = self.alike.get(owner, [owner])
        whole = sorted(
            {c.removeprefix(o + ".") for c, o in t.experts.added_whole.items() if o in alike}
        )
        for c in whole:
            bent = [
                t.experts.whole_used_otherwise[f"{o}.{c}"]
                for o in alike
                if f"{o}.{c}" in t.experts.whole_used_otherwise
            ]
            if bent:
                reasons.append(
                    f"{c}'s output is added whole to the experts' partial sums, but "
                    f"{bent[0]} too, so it cannot be scaled by 1/tp"
                )
        reasons += [t.experts.sum_breaks[o] for o in alike if o in t.experts.sum_breaks]
        if reasons:
            self.kept_experts[owner] = f"kept whole: {'; '.join(dict.fromkeys(reasons))}"
            return
        assert module is not None
        own = dict(module.named_parameters(recurse=owner not in owners))
        after = sorted(
            p.removeprefix(prefix)
            for p, o in t.experts.after_sum.items()
            if o == owner or o.startswith(prefix)  # (or a child holding weights for it)
        )
        n_experts = {own[m.removeprefix(prefix)].shape[0] for m in members}
        ops = sorted({op for o in openers for op in t.regions.ops.get(o, ())} - PLAIN_OPS)
        path = f" through {', '.join(ops)}" if ops else ""
        ep_why = self.expert_parallel_refusal(owner, n_experts, whole) if mode == "expert" else ""
        if mode == "expert" and not ep_why:
            ((attr_module, attr, value),) = t.experts.counts[owner]
            self.attributes[attr_module] = (
                (attr,),
                f"its forward reads {attr} = {value} (its number of experts); each rank holds "
                f"{value // self.tp} of them, so it is divided by the tp size",
            )
            by_experts = tuple(
                sorted((p, 0) for p, w in own.items() if w.dim() >= 2 and w.shape[0] == value)
            )
            self.decisions[owner] = Decision(
                "experts",
                f"{join(sorted(short[o] for o in openers))} and {join(sorted(short[c] for c in closers))} "
                f"hold {value} experts, used by per-expert matmuls{path}; its forward takes the "
                "chosen experts and their weights as inputs, so each rank keeps "
                f"{value // self.tp} whole experts, renumbers the routing to them and zeroes "
                "the weight of tokens routed elsewhere; one all-reduce sums the ranks' outputs",
                mode="expert",
                shard=by_experts,
            )
            return
        shard: dict[str, int] = {}
        fused: dict[str, tuple[int, ...]] = {}
        for m in members:
            shard[m.removeprefix(prefix)] = t.experts.roles[m][1]
            if m in t.regions.parts:
                fused[m.removeprefix(prefix)] = t.regions.parts[m]
        for b, (src, dim) in t.experts.biases.items():
            if src in openers:
                shard[b.removeprefix(prefix)] = dim
                if src in t.regions.parts:
                    fused[b.removeprefix(prefix)] = t.regions.parts[src]
        pieces = {o: t.regions.parts.get(o) for o in openers}
        what = "; ".join(
            f"{short[o]}'s {t.regions.openers[o]} output features per expert"
            + (
                f" are {len(p)} fused pieces ({' | '.join(map(str, p))}) cut apart in forward, each rank holding its slice of every piece"
                if p
                else ""
            )
            for o, p in pieces.items()
        )
        added = f"; {join(after)} is added after that sum, 1/tp on each rank" if after else ""
        if whole:
            added += (
                f"; {join(whole)}'s output (made without the split weights, the same on every "
                "rank) is added whole to that sum, so each rank scales it by 1/tp and the "
                "all-reduce counts it once"
            )
        refused = f" (not expert parallel: {ep_why})" if ep_why else ""
        self.decisions[owner] = Decision(
            "experts",
            f"per-expert matmuls on the unsplit tokens (the router's choice): {what}; they flow"
            f"{path} to {join(sorted(short[c] for c in closers))}, which contracts them, so every "
            "expert is split like a dense MLP and the experts' output is a partial sum, one "
            f"all-reduce{added}{refused}",
            mode="tensor",
            shard=tuple(sorted(shard.items())),
            fused=tuple(sorted(fused.items())),
            after_sum=tuple(after),
            added_whole=tuple(whole),
        )

    def expert_parallel_refusal(self, owner: str, n_experts: set[int], whole: list[str]) -> str:
        t = self.trace
        if whole:
            # made without any expert's weights, it belongs to no rank's experts; which
            # tokens reach it is decided inside forward, so with the routing renumbered per
            # rank several ranks might add it, or none
            return (
                f"{join(whole)}'s output is added whole to the experts' sum, made without any "
                "expert's weights: splitting by experts does not decide which one rank adds it"
            )
        if t.experts.routing.get(owner):
            return str(t.experts.routing[owner])
        counts = t.experts.counts.get(owner, set())
        if len(n_experts) != 1 or len(counts) != 1:
            return "its forward does not read its number of experts from one attribute of its own"
        (value,) = n_experts
        if value % self.tp:
            return f"its {value} experts do not divide by tp {self.tp}"
        late = sorted(
            b.rpartition(".")[2] for b in t.experts.after_weighting if b.startswith(owner + ".")
        )
        if late:
            return f"{join(late)} is added after the routing weights scale the experts' outputs"
        return ""

    def pool_experts(self) -> None:
        """A forward traced on the model's own weights runs only the code its routing
        reaches (an eager loop over the experts hit): one experts module may have sent no
        token to its experts with weights, another none to its identity experts. Modules of
        one structure (class, parameter shapes, submodules) run one forward, so what any of
        them shows holds for all: a reason one is kept whole for keeps all whole, and one
        whose experts with weights never ran takes the decision of one whose did. (`experts`
        pools the outputs added whole and their other uses the same way.)"""
        t = self.trace
        for group in {id(g): g for g in self.alike.values()}.values():
            for o in group:
                if (
                    o not in self.decisions
                    and o not in self.kept_experts
                    and o in t.experts.sum_breaks
                ):
                    self.kept_experts[o] = f"kept whole: {t.experts.sum_breaks[o]}"
            kept = [o for o in group if o in self.kept_experts]
            split = [o for o in group if o in self.decisions and o not in self.kept_experts]
            unseen = [o for o in group if o not in self.decisions and o not in self.kept_experts]
            if kept:
                why = self.kept_experts[kept[0]]
                for o in split + unseen:
                    if self.decisions.pop(o, Decision("replicate", "")).mode == "expert":
                        self.attributes.pop(o, None)  # its number of experts, divided
                    self.kept_experts[o] = f"{why} (seen in {kept[0]}, of the same structure)"
            elif split and unseen:
                first = self.decisions[split[0]]
                pooled = replace(
                    first,
                    why=f"{first.why}; the {len(group)} modules of this structure share it, "
                    f"{len(unseen)} of which ran no expert with weights on the traced tokens "
                    "(the routing decides)",
                )
                for o in split + unseen:
                    self.decisions[o] = pooled
                    if split[0] in self.attributes:
                        self.attributes[o] = self.attributes[split[0]]

    def unsplit_experts(self) -> None:
        """Modules holding expert weights that no region split: replicated, with the reason."""
        split = [d for d, dec in self.decisions.items() if dec.style == "experts"]
        for owner in sorted(set(self.trace.experts.exits) | set(self.kept_experts)):
            if owner in self.decisions or any(owner.startswith(f"{d}.") for d in split):
                continue  # (a child holding the weights of experts split at their parent)
            self.decisions[owner] = Decision(
                "replicate",
                self.kept_experts.get(
                    owner,
                    "kept whole: no per-expert matmul of its weights was seen to open and close a split",
                ),
            )

    def embeddings(self) -> dict[int, str]:
        """vocab_parallel for token lookups; returns {vocab size: embedding} for the head."""
        vocabs: dict[int, str] = {}
        for name, module in self.modules.items():
            if not isinstance(module, nn.Embedding) or name not in self.trace.layers.called:
                continue
            if name in self.decisions:
                continue  # split by its columns inside a region
            n = module.num_embeddings
            bent = self.trace.lookups.not_linear.get(name)
            written = () if bent else self.written(name, module)
            if written is None:
                bent = "index_put_"  # rows overwritten with a parameter that cannot be split
            if not self.trace.lookups.token_ids.get(name):
                self.kept[name] = (
                    "kept whole: its indices are computed inside forward (positions or types), not the input tokens"
                )
            elif self.used_outside(name):
                self.kept[name] = "kept whole: its weight is also used outside its own lookup"
            elif bent and not self.trace.lookups.at_lookup_place.get(name):
                self.kept[name] = (
                    _bent_lookup(bent) + ", and it looks its rows up with an embedding of its "
                    "own rather than through nn.Embedding's forward, where they could be "
                    "summed first"
                )
            elif module.max_norm is not None:
                self.kept[name] = "kept whole: max_norm renormalizes looked-up rows in place"
            elif n % self.tp:
                self.kept[name] = f"kept whole: its vocab of {n} does not divide by tp {self.tp}"
            else:
                vocabs.setdefault(n, name)
                why = (
                    f"token lookup (its indices are the model's input ids); vocab {n} splits "
                    "evenly, each rank looks up its rows and one all-reduce sums them"
                )
                if bent:
                    why += (
                        f", right where nn.Embedding's lookup returns them (sum_at: lookup): "
                        f"its own forward goes on to apply {bent} to the rows, which is not "
                        "linear in them"
                    )
                elif written:
                    what = " and ".join(written)
                    why += (
                        f" as its forward returns; that forward writes {what} over some of the "
                        f"rows (index_put_), so {what} is split along its "
                        f"{module.embedding_dim} features and each rank writes its share "
                        "padded with zeros, which the same sum adds up whole (written)"
                    )
                self.decisions[name] = Decision(
                    "vocab_parallel",
                    why,
                    sum_at="lookup" if bent else None,
                    written=written or (),
                )
        return vocabs

    def written(self, name: str, module: nn.Embedding) -> tuple[str, ...] | None:
        """The table's own parameters its forward writes over looked-up rows, when each can
        be split along the rows' features and written as each rank's share: every lookup
        made in nn.Embedding's place (where WrittenRows looks up local rows), the parameter
        used for nothing else and its width dividing by tp. None when one cannot."""
        t = self.trace
        written = tuple(sorted(t.lookups.written_rows.get(name, ())))
        if written and (
            not t.lookups.at_lookup_place.get(name)
            or module.embedding_dim % self.tp
            or t.written_elsewhere(name, written)
        ):
            return None
        return written

    def head(self, vocabs: dict[int, str]) -> None:
        """A lone opener whose split output is the model output over the vocab: gathered colwise."""
        t = self.trace
        for name in t.regions.at_output:
            linked = any(name in group for group in t.regions.links)
            if name not in t.layers.linears or linked or name in t.regions.misfits:
                continue
            _, out, transposed = t.layers.linears[name]
            if out not in vocabs or self.used_outside(name):
                continue
            self.kept.pop(name, None)
            if self.loss_parallel:
                self.decisions[name] = Decision(
                    "colwise",
                    f"its output ({out} features, the vocab of the token lookup) is the model "
                    "output; split over the vocab and left split (a DTensor) for the loss, "
                    "computed under loss_parallel()",
                    local_output=False,
                    transposed=transposed,
                )
                continue
            self.decisions[name] = Decision(
                "colwise",
                f"its output ({out} features, the vocab of the token lookup) is the "
                "model output; split over the vocab and gathered, so callers see full rows",
                output="replicate",
                transposed=transposed,
            )

    def tie(self, model: nn.Module) -> None:
        """A parameter held by several modules (tied input and output embeddings) stays one
        tensor only when every module that computes with it splits it alike (the vocab rows,
        for a token lookup and a head); otherwise they all stay whole. Holders that only
        keep a reference (BERT's prediction head holds its decoder's bias) do not count."""
        groups = tied_groups(model)
        changed = True
        while changed:
            changed = False
            for group in groups:
                users = [
                    (m, p)
                    for m, p in group
                    if (
                        m in self.trace.layers.called
                        and (
                            m in self.trace.layers.linears
                            or isinstance(self.modules[m], nn.Embedding)
                        )
                    )
                    or f"{m}.{p}".lstrip(".") in self.trace.params.outside
                ]
                splits = {
                    (m, p): weight_split(
                        self.decisions[m].rule(m) if m in self.decisions else None,
                        self.modules[m],
                        p,
                    )
                    for m, p in users
                }
                if len(set(splits.values())) < 2:
                    continue
                changed = True
                names = sorted({m for m, _ in group})
                for m, _ in users:
                    if self.decisions.pop(m, None) is not None:
                        others = join([n for n in names if n != m])
                        self.kept[m] = (
                            f"kept whole: its weight is shared with {others} (tied), which "
                            "cannot split it the same way"
                        )
        for group in groups:
            for m, p in group:
                d = self.decisions.get(m)
                if p == "weight" and d is not None and d.style != "replicate":
                    others = join(sorted({n for n, _ in group if n != m}))
                    why = f"{d.why}; its weight is tied with {others}, split the same way"
                    self.decisions[m] = replace(d, why=why)

    def gathered(self, name: str, why: str) -> Decision | None:
        """A layer whose output cannot stay split may still split its weight: colwise with
        the output gathered is exact whatever the model does next (the gathered output is the
        unsplit one), for one all-gather per call of its output features, and only when
        nothing but the data flow kept it whole. Small layers too (a linear attention's
        per-head gate inputs): the all-gather is of a few features per token, and the memory
        a plan saves should not depend on a size threshold of ours."""
        t = self.trace
        _, out, transposed = t.layers.linears[name]
        if (
            name in self.blocked
            or name in t.regions.misfits
            or name not in t.layers.called
            or out % self.gather_tp
        ):
            return None
        reason = why.removeprefix("kept whole: ")
        return Decision(
            "colwise",
            f"its output cannot stay split ({reason}); so its {out} output features are split "
            "and gathered right after (one all-gather per call), which splits its weight and "
            "leaves what follows unchanged",
            output="replicate",
            transposed=transposed,
        )

    def sequence_parallel(self) -> None:
        """Keep the stream between split regions split over the sequence (dim 1)."""
        t = self.trace
        scatter = "; sequence parallel: reduce-scattered onto sequence shards, left a DTensor"
        for name, d in list(self.decisions.items()):
            if d.sum_at is not None:
                # its rows are summed inside its forward, whole: nothing there to scatter
                bent = _bent_lookup(t.lookups.not_linear[name])
                self.decisions[name] = Decision(
                    "replicate", f"{bent} (where sequence parallel reduce-scatters them)"
                )
            elif d.style == "vocab_parallel" or (d.style == "rowwise" and d.output is None):
                self.decisions[name] = replace(
                    d, output="shard(1)", local_output=False, why=d.why + scatter
                )
            elif d.style == "colwise" and d.output == "replicate" and name in t.regions.at_output:
                self.decisions[name] = replace(
                    d,
                    input="shard(1)",
                    why=d.why
                    + "; sequence parallel: its input is gathered over the sequence first",
                )
        gather = "sequence parallel: all-gathers its input over the sequence, since {} need whole sequences"
        for openers, _ in self.split_regions:
            parent = _common_parent(openers)
            entry = t.layers.entries.get(parent)
            if (
                entry is not None
                and all(t.layers.entries.get(o, (0, -1))[1] == entry[1] for o in openers)
                and parent
                and parent not in openers
                and parent not in self.decisions
            ):
                self.decisions[parent] = Decision(
                    "prepare",
                    gather.format(
                        join(sorted(relative([*openers, parent]).get(o, o) for o in openers))
                    ),
                    prepared=entry[0],
                )
                continue
            for o in openers:  # each opener gathers its own input
                d = self.decisions[o]
                self.decisions[o] = replace(
                    d, input="shard(1)", why=d.why + "; " + gather.format("it")
                )
        for name, module in self.modules.items():
            if (
                name in self.decisions
                or name in t.layers.linears
                or isinstance(module, nn.Embedding)
            ):
                continue
            own = own_params(module, name)
            if own and name in t.layers.entries and any(p in t.params.outside for p in own):
                self.decisions[name] = Decision(
                    "sequence_parallel",
                    "its parameters act on the stream between split regions, which sequence "
                    "parallel keeps split over the sequence; they are replicated and it runs on "
                    "each rank's shard of the sequence",
                )

    def inside_experts(self) -> None:
        """Modules inside one split as experts stay whole: its forward runs on each rank's
        local tensors with every parameter but the expert weights whole (JetMoE's router)."""
        split = [n for n, d in self.decisions.items() if d.style == "experts"]
        for name, d in list(self.decisions.items()):
            owner = next((o for o in split if name.startswith(f"{o}.")), None)
            if owner is not None and d.style != "replicate":
                self.decisions[name] = Decision(
                    "replicate",
                    f"kept whole: inside {owner}, split as experts, whose forward runs on "
                    "each rank's local tensors with its other parameters whole",
                )

    def rest(self) -> None:
        for name, module in self.modules.items():
            linear = name in self.trace.layers.linears
            if not (linear or isinstance(module, nn.Embedding)) or name in self.decisions:
                continue
            if name in self.tied and name not in self.trace.layers.called:
                continue  # holds a tied weight it never uses: no rule; apply re-ties it
            if name not in self.trace.layers.called:
                why = NOT_CALLED
            else:
                why = self.kept.get(
                    name, "kept whole: its output is not split anywhere the tracer could follow"
                )
            self.decisions[name] = (linear and self.gathered(name, why)) or Decision(
                "replicate", why
            )


def _common_parent(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    k = 0
    while all(len(p) > k for p in parts) and len({p[k] for p in parts}) == 1:
        k += 1
    return ".".join(parts[0][:k])


def _decide(
    model: nn.Module,
    trace: Trace,
    tp: int,
    loss_parallel: bool,
    sequence_parallel: bool = False,
    experts: str = "tensor",
    gather_tp: int = 2,
) -> tuple[dict[str, Decision], dict[str, tuple[tuple[str, ...], str]]]:
    d = _Decider(model, trace, tp, loss_parallel, gather_tp)
    for members in find_regions(trace):
        if any(m in trace.experts.roles for m in members):
            d.experts(members, experts)
        else:
            d.region(members)
    d.pool_experts()
    d.unsplit_experts()
    d.head(d.embeddings())
    d.tie(model)
    d.rest()
    d.inside_experts()
    if sequence_parallel:
        d.sequence_parallel()
    return d.decisions, d.attributes


# ---- rules --------------------------------------------------------------------------------
def _rules(model: nn.Module, decisions: dict[str, Decision]) -> list[Rule]:
    """One rule per group of modules with equal decisions, as compact patterns, in module order."""
    names = [n for n, _ in model.named_modules() if n]
    groups: dict[Decision, list[str]] = {}
    for n in names:
        if n in decisions:
            groups.setdefault(decisions[n], []).append(n)
    return [d.rule(p) for d, members in groups.items() for p in collapse(members, names)]


def _attribute_rules(
    model: nn.Module, attributes: dict[str, tuple[tuple[str, ...], str]]
) -> list[AttributeRule]:
    names = [n for n, _ in model.named_modules() if n]
    groups: dict[tuple[tuple[str, ...], str], list[str]] = {}
    for n in names:
        if n in attributes:
            groups.setdefault(attributes[n], []).append(n)
    return [
        AttributeRule(match=p, divide=list(attrs), why=why)
        for (attrs, why), members in groups.items()
        for p in collapse(members, names)
    ]
