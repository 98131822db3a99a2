"""Mixture-of-experts modules: 3-D expert weights used by batched per-expert matmuls
(trace/record.py's `ExpertFacts`), split per expert like a dense MLP (mode tensor) or by
experts (mode expert), at the module that holds them.

Start at `decide_experts`, called for each span of expert weights; then `pool_experts`
(modules of one structure decide alike), `keep_unsplit_experts` and, once every layer is
decided, `keep_inside_experts`. A module "split as experts" holds the expert weights of one
span; each rank's experts leave a partial sum that one all-reduce at its output adds up.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..plan.styles import ExpertsRule, ReplicateRule
from .context import Context, Decided, Found
from .decision import Divided, decided, reasoned
from .names import PLAIN_OPS, join
from .spans import split_unit

__all__ = ["decide_experts", "keep_inside_experts", "keep_unsplit_experts", "pool_experts"]


@dataclass
class _ExpertSpan:
    """One span of expert weights, and the module judged for it (its owner)."""

    owner: str
    """The module holding the weights, or the parent where its children's weights meet."""
    holders: set[str]
    """The modules holding the weights: the owner, or its children."""
    in_one_place: bool
    """Whether every weight is held by the owner, or by children of it."""
    members: list[str]
    openers: list[str]
    closers: list[str]

    def short(self, name: str) -> str:
        """A weight's (or bias's) name under the owner, as a rule names it."""
        return name.removeprefix(self.owner + ".")


def _expert_span(ctx: Context, members: list[str]) -> _ExpertSpan:
    t = ctx.trace
    holders = {m.rpartition(".")[0] for m in members}
    owner = min(holders)
    parents = {o.rpartition(".")[0] for o in holders}
    if len(holders) > 1 and len(parents) == 1 and min(parents) in t.experts.exits:
        owner = min(parents)  # children hold the weights: judged where they meet
    return _ExpertSpan(
        owner=owner,
        holders=holders,
        in_one_place=holders == {owner} or parents == {owner},
        members=members,
        openers=[m for m in members if t.experts.roles.get(m, ("",))[0] == "open"],
        closers=[m for m in members if t.experts.roles.get(m, ("",))[0] == "close"],
    )


def decide_experts(ctx: Context, members: list[str], mode: str) -> Found:
    """A module's 3-D expert weights that open and close one span: split per expert
    like a dense MLP (mode tensor), or by experts (mode expert) where that is proven."""
    t = ctx.trace
    r = _expert_span(ctx, members)
    # pooled over the modules of its structure (see `pool_experts`)
    alike = ctx.alike_experts.get(r.owner, [r.owner])
    added_whole = sorted(
        {c.removeprefix(o + ".") for c, o in t.experts.added_whole.items() if o in alike}
    )
    reasons = _reasons(ctx, r, alike, added_whole)
    found = Found()
    if reasons:
        found.kept_experts[r.owner] = f"kept whole: {'; '.join(dict.fromkeys(reasons))}"
        return found
    module = ctx.modules[r.owner]
    own = dict(module.named_parameters(recurse=r.owner not in r.holders))
    n_experts = {own[r.short(m)].shape[0] for m in members}
    ops = sorted({op for o in r.openers for op in t.spans.ops.get(o, ())} - PLAIN_OPS)
    path = f" through {', '.join(ops)}" if ops else ""
    refused = (
        _expert_parallel_refusal(ctx, r.owner, n_experts, added_whole) if mode == "expert" else ""
    )
    if mode == "expert" and not refused:
        _split_by_experts(ctx, found, r, own, path)
        return found
    narrow = _narrow_rows(ctx, r)
    if narrow and mode == "tensor":
        # each expert cannot be split: whole experts on each rank, where that is proven
        refused = _expert_parallel_refusal(ctx, r.owner, n_experts, added_whole)
        if not refused:
            _split_by_experts(ctx, found, r, own, path, instead=narrow)
            return found
    if narrow:
        found.kept_experts[r.owner] = f"kept whole: {narrow}{'; ' + refused if refused else ''}"
        return found
    _split_per_expert(ctx, found, r, added_whole, path, refused)
    return found


def _narrow_rows(ctx: Context, r: _ExpertSpan) -> str:
    """Why each rank's slice of the experts' features would be too narrow for torch's
    grouped matmul ("" when it is not): its kernel takes 16-bit operands only with rows of
    whole 16-byte runs, and a split makes a rank's rows 1/tp as long (fp32 runs any width)."""
    units = split_unit(ctx.trace, r.openers)
    for m in r.members:
        if m not in ctx.trace.experts.grouped_mm:
            continue
        holder, _, pname = m.rpartition(".")
        size = getattr(ctx.modules[holder], pname).dtype.itemsize
        share = units // ctx.tp
        if size < 4 and share * size % 16:
            return (
                f"torch's grouped matmul takes {8 * size}-bit rows of whole 16-byte runs only, "
                f"and each rank's share of its blocks of {units} features would be {share} "
                f"({share * size} bytes) at tp {ctx.tp}"
            )
    return ""


def _reasons(ctx: Context, r: _ExpertSpan, alike: list[str], added_whole: list[str]) -> list[str]:
    """Why the span cannot be split, in the order `why` lists them."""
    t = ctx.trace
    reasons: list[str] = []
    module = ctx.modules.get(r.owner)
    if not r.in_one_place or module is None or any(m not in t.experts.roles for m in r.members):
        reasons.append("its split features reach weights of other modules")
    for m in r.members:
        for b in t.spans.broken.get(m, []):
            reasons.append(f"{r.short(m)}'s split ends at {b}")
        if m in t.spans.misfits:
            reasons.append(f"{r.short(m)}: {t.spans.misfits[m]}")
    if not r.openers or not r.closers:
        reasons.append("no expert matmul contracts the split features")
    exit_ = t.experts.exits.get(r.owner, "it was not called")
    if exit_ is not None:
        reasons.append(exit_)
    units = split_unit(t, r.openers)
    if r.openers and units % ctx.tp:
        reasons.append(
            f"its experts' hidden features split into blocks of {units}, which tp {ctx.tp} does not divide"
        )
    if t.reads.counts.get(r.owner) or any(t.reads.counts.get(o) for o in r.openers):
        reasons.append("its forward reads attributes to size the split features")
    for c in added_whole:
        other_uses = [
            t.experts.whole_used_otherwise[f"{o}.{c}"]
            for o in alike
            if f"{o}.{c}" in t.experts.whole_used_otherwise
        ]
        if other_uses:
            reasons.append(
                f"{c}'s output is added whole to the experts' partial sums, but "
                f"{other_uses[0]} too, so it cannot be scaled by 1/tp"
            )
    reasons += [t.experts.sum_breaks[o] for o in alike if o in t.experts.sum_breaks]
    return reasons


def _expert_parallel_refusal(
    ctx: Context, owner: str, n_experts: set[int], added_whole: list[str]
) -> str:
    """Why the module cannot be split by experts ("" when it can)."""
    t = ctx.trace
    if added_whole:
        # made without any expert's weights, it belongs to no rank's experts; which
        # tokens reach it is decided inside forward, so with the routing renumbered per
        # rank several ranks might add it, or none
        return (
            f"{join(added_whole)}'s output is added whole to the experts' sum, made without any "
            "expert's weights: splitting by experts does not decide which one rank adds it"
        )
    if t.experts.routing.get(owner):
        return str(t.experts.routing[owner])
    counts = t.experts.counts.get(owner, set())
    # given counts per expert, a forward that reads no number of experts sizes its loop
    # by the counts and its weights, both each rank's own
    read_none = owner in t.experts.by_counts and not counts
    if len(n_experts) != 1 or (len(counts) != 1 and not read_none):
        return "its forward does not read its number of experts from one attribute of its own"
    (value,) = n_experts
    if value % ctx.tp:
        return f"its {value} experts do not divide by tp {ctx.tp}"
    late = sorted(
        b.rpartition(".")[2] for b in t.experts.after_weighting if b.startswith(owner + ".")
    )
    if late:
        return f"{join(late)} is added after the routing weights scale the experts' outputs"
    return ""


def _split_by_experts(
    ctx: Context,
    found: Found,
    r: _ExpertSpan,
    own: dict[str, nn.Parameter],
    path: str,
    *,
    instead: str = "",
) -> None:
    """Mode expert: each rank keeps num_experts/tp whole experts; the attribute holding the
    number of experts is divided. `instead`: why tensor mode, asked for, cannot split them."""
    counts = ctx.trace.experts.counts.get(r.owner)
    by_counts = r.owner in ctx.trace.experts.by_counts
    if counts:
        ((attr_module, attr, value),) = counts
        found.attributes[attr_module] = (
            Divided(
                (attr,),
                f"its forward reads {attr} = {value} (its number of experts); each rank "
                f"holds {value // ctx.tp} of them, so it is divided by the tp size",
            ),
        )
    else:
        (value,) = {own[r.short(m)].shape[0] for m in r.members}
    by_experts = dict(
        sorted((p, 0) for p, w in own.items() if w.dim() >= 2 and w.shape[0] == value)
    )
    found.rules[r.owner] = decided(
        ExpertsRule,
        (f"split by whole experts, not each expert: {instead}; " if instead else "")
        + f"{join(sorted(r.short(o) for o in r.openers))} and {join(sorted(r.short(c) for c in r.closers))} "
        f"hold {value} experts, used by per-expert matmuls{path}; "
        + (
            "its forward takes the tokens grouped by expert and the count of each group, so "
            f"each rank keeps {value // ctx.tp} whole experts and runs the group of tokens "
            "of each, the other rows of its output zeros"
            if by_counts
            else "its forward takes the chosen experts and their weights as inputs, so each "
            f"rank keeps {value // ctx.tp} whole experts, renumbers the routing to them and "
            "zeroes the weight of tokens routed elsewhere"
        )
        + "; one all-reduce sums the ranks' outputs",
        mode="expert",
        shard=by_experts or None,
    )


def _split_per_expert(
    ctx: Context,
    found: Found,
    r: _ExpertSpan,
    added_whole: list[str],
    path: str,
    refused: str,
) -> None:
    """Mode tensor: every expert split like a dense MLP, its output a partial sum."""
    t = ctx.trace
    prefix = r.owner + "."
    after = sorted(
        p.removeprefix(prefix)
        for p, o in t.experts.after_sum.items()
        if o == r.owner or o.startswith(prefix)  # (or a child holding weights for it)
    )
    shard, fused = _per_expert_splits(ctx, r)
    pieces = {o: t.spans.parts.get(o) for o in r.openers}
    what = "; ".join(
        f"{r.short(o)}'s {t.spans.openers[o]} output features per expert"
        + (
            f" are {len(p)} fused pieces ({' | '.join(map(str, p))}) cut apart in forward, each rank holding its slice of every piece"
            if p
            else ""
        )
        for o, p in pieces.items()
    )
    added = f"; {join(after)} is added after that sum, 1/tp on each rank" if after else ""
    if added_whole:
        added += (
            f"; {join(added_whole)}'s output (made without the split weights, the same on every "
            "rank) is added whole to that sum, so each rank scales it by 1/tp and the "
            "all-reduce counts it once"
        )
    not_expert = f" (not expert parallel: {refused})" if refused else ""
    found.rules[r.owner] = decided(
        ExpertsRule,
        f"per-expert matmuls on the unsplit tokens (the router's choice): {what}; they flow"
        f"{path} to {join(sorted(r.short(c) for c in r.closers))}, which contracts them, so every "
        "expert is split like a dense MLP and the experts' output is a partial sum, one "
        f"all-reduce{added}{not_expert}",
        mode="tensor",
        shard=dict(sorted(shard.items())) or None,
        fused={k: list(v) for k, v in sorted(fused.items())} or None,
        after_sum=after or None,
        added_whole=added_whole or None,
    )


def _per_expert_splits(
    ctx: Context, r: _ExpertSpan
) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """Each weight's (and opening bias's) split dim, and the fused pieces of those whose
    features are cut apart in forward, by their names under the owner."""
    t = ctx.trace
    shard: dict[str, int] = {}
    fused: dict[str, tuple[int, ...]] = {}
    for m in r.members:
        shard[r.short(m)] = t.experts.roles[m][1]
        if m in t.spans.parts:
            fused[r.short(m)] = t.spans.parts[m]
    for b, (src, dim) in t.experts.biases.items():
        if src in r.openers:
            shard[r.short(b)] = dim
            if src in t.spans.parts:
                fused[r.short(b)] = t.spans.parts[src]
    return shard, fused


def pool_experts(ctx: Context, so_far: Decided) -> Found:
    """A forward traced on the model's own weights runs only the code its routing
    reaches (an eager loop over the experts hit): one experts module may have sent no
    token to its experts with weights, another none to its identity experts. Modules of
    one structure (class, parameter shapes, submodules) run one forward, so what any of
    them shows holds for all: a reason one is kept whole for keeps all whole, and one
    whose experts with weights never ran takes the decision of one whose did.
    (`decide_experts` pools the outputs added whole and their other uses the same way.)"""
    t = ctx.trace
    found = Found()
    for group in {id(g): g for g in ctx.alike_experts.values()}.values():
        kept_why = {o: so_far.kept_experts[o] for o in group if o in so_far.kept_experts}
        for o in group:
            if o not in so_far.decisions and o not in kept_why and o in t.experts.sum_breaks:
                kept_why[o] = found.kept_experts[o] = f"kept whole: {t.experts.sum_breaks[o]}"
        kept = [o for o in group if o in kept_why]
        split = [o for o in group if o in so_far.decisions and o not in kept_why]
        unseen = [o for o in group if o not in so_far.decisions and o not in kept_why]
        if kept:
            why = kept_why[kept[0]]
            for o in split + unseen:
                gone = so_far.decisions.get(o)
                found.withdrawn.add(o)
                if isinstance(gone, ExpertsRule) and gone.mode == "expert":
                    found.attributes_withdrawn.add(o)  # its number of experts, divided
                found.kept_experts[o] = f"{why} (seen in {kept[0]}, of the same structure)"
        elif split and unseen:
            first = so_far.decisions[split[0]]
            pooled = reasoned(
                first,
                f"{first.why}; the {len(group)} modules of this structure share it, "
                f"{len(unseen)} of which ran no expert with weights on the traced tokens "
                "(the routing decides)",
            )
            for o in split + unseen:
                found.rules[o] = pooled
                if split[0] in so_far.attributes:
                    found.attributes[o] = so_far.attributes[split[0]]
    return found


def keep_unsplit_experts(ctx: Context, so_far: Decided) -> Found:
    """Modules holding expert weights that no span split: replicated, with the reason."""
    found = Found()
    split = [d for d, dec in so_far.decisions.items() if isinstance(dec, ExpertsRule)]
    for owner in sorted(set(ctx.trace.experts.exits) | set(so_far.kept_experts)):
        if owner in so_far.decisions or any(owner.startswith(f"{d}.") for d in split):
            continue  # (a child holding the weights of experts split at their parent)
        if _holds_none(ctx, owner) and any(d.startswith(f"{owner}.") for d in split):
            continue  # (a parent of experts that were split, and summed, in a child)
        found.rules[owner] = decided(
            ReplicateRule,
            so_far.kept_experts.get(
                owner,
                "kept whole: no per-expert matmul of its weights was seen to open and close a split",
            ),
        )
    return found


def _holds_none(ctx: Context, owner: str) -> bool:
    """`owner` holds no 3-D weights itself, only children that do (watched as the parent
    that might sum them)."""
    module = ctx.modules.get(owner)
    return module is not None and not any(p.dim() == 3 for p in module.parameters(recurse=False))


def keep_inside_experts(ctx: Context, so_far: Decided) -> Found:
    """Modules inside one split as experts stay whole: its forward runs on each rank's
    local tensors with every parameter but the expert weights whole (JetMoE's router)."""
    found = Found()
    split = [n for n, d in so_far.decisions.items() if isinstance(d, ExpertsRule)]
    for name, d in so_far.decisions.items():
        owner = next((o for o in split if name.startswith(f"{o}.")), None)
        if owner is not None and not isinstance(d, ReplicateRule):
            found.rules[name] = decided(
                ReplicateRule,
                f"kept whole: inside {owner}, split as experts, whose forward runs on "
                "each rank's local tensors with its other parameters whole",
            )
    return found
