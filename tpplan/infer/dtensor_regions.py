"""Regions run on DTensors: attention and MLPs split the Megatron way where the local shapes
of a split cannot be proven from attributes tpplan may divide.

Start at `try_dtensor_regions`, which infer_plan calls once a plan is made. A layer whose
split ended at a view the trace could not size per rank (a head size computed as
`C // self.n_head` from `x.size()`, a literal in `reshape(B, N, 3, heads, hd)`, a count
read from a config object every layer shares) was split and gathered right after: weights
shrink, work does not. Here such layers get a second chance:

1. roles (region_cuts.py): a forward on fake tensors follows which of them read what the
   others made, in the module that holds them: a layer reading none of their outputs
   opens a split, a layer reading an opener's output closes it; where a closer's output
   is read by another closer, the layers it read stay whole and it opens instead; a
   module inside another whose outputs only the outer one's closers read is part of the
   outer one's region (Flux's single-stream attention);
2. candidate: in each module whose gathered layers all took a role, openers colwise with
   DTensor outputs (`local_output: false`; a fused one as its equal pieces, or every
   layer in pieces of one size where the code joins heads and MLP features with `cat`),
   closers rowwise, and the module a DTensor region (`Plan.regions`);
3. proof: the plan applied to a meta copy on fake ranks, one forward and backward counted
   (`check.run.collectives_inside`): a region is kept only where no collective ran in
   the module's forward outside its split layers' own calls, and in its backward only
   sums of whole tensors' gradients (a q/k norm's weight on split heads) and, where
   layers stay whole, the gather of the gradient the heads send back to what they share
   of them. So the split ran through every view, rotary embedding and attention
   untouched, and DTensor's own sharding propagation computed every op (its numbers are
   the unsplit model's by construction). Anything else keeps the split-and-gather rules,
   with their reasons;
4. key/value heads past their count (region_shared.py): layers a proven region keeps whole
   for every head, and fused openers no way split, hold one head per rank where a run at
   one head per rank proves the code reads no other.

A module's own raw weights (in its `x @ w` or einsum) are candidates too: raw_regions.py
finds them and makes their `split_params` rules.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..check.rules import match_rules
from ..plan.patterns import collapse
from ..plan.schema import Plan, RegionRule, Rule
from ..plan.styles import (
    ColwiseRule,
    ReplicateRule,
    RowwiseRule,
    SplitParamsRule,
)
from ..plan.versions import SCHEMA_VERSION
from .raw_regions import RAW_WAYS, raw_kept, raw_params, rewrite_raw
from .region_cuts import Cut, ParamDims, call_fake, cuts
from .region_rules import SHARED, UNEQUAL, rewrite
from .region_shared import Trial, share_fused, share_heads

if TYPE_CHECKING:
    from ..check.run import Inside

__all__ = ["call_fake", "collapsed", "example_call", "per_module", "try_dtensor_regions"]

# the ways to cut a region's layers, tried in turn: plain, in 3 equal fused pieces, in 2, in
# pieces of the size every opener's width shares (region_rules.py's `rewrite`); a region of raw weights is
# tried raw_regions.py's `RAW_WAYS`. Last, once every other way of every cut has failed, in
# the unequal pieces the code cuts an opener's features into (-1, `UNEQUAL`)
_PIECES = (1, 3, 2, 0)

# how rest.py words a layer whose output could not stay split (split and gathered)
_GATHERED = "its output cannot stay split ("


def try_dtensor_regions(model: nn.Module, plan: Plan, tp: int, example_inputs: Any) -> Plan:
    """`plan` with every region it can prove turned into a DTensor region (see the module
    docstring); `plan` itself when there is none."""
    names = [n for n, _ in model.named_modules() if n]
    rules = per_module(plan, names)
    gathered = {
        n
        for n, r in rules.items()
        if isinstance(r, ColwiseRule) and r.output == "replicate" and r.why.startswith(_GATHERED)
    }
    raw = raw_params(model, rules)
    if not gathered and not raw:
        return plan
    args, kwargs = example_call(model, example_inputs)
    dims: dict[str, ParamDims] = {}
    bounds: dict[str, set[int]] = {}
    candidates = cuts(model, gathered, args, kwargs, raw, dims, bounds)
    if candidates is None:
        return plan
    for ways in candidates.values():
        ways.extend(_shared(model, ways[0]))
    proven: dict[str, dict[str, Rule]] = {}
    sums: dict[str, int] = {}  # {region: the all-reduces its forward ran, a reduction's}
    improvable: set[str] = set()  # raw weights' regions: another dim may cost fewer sums
    # a cut whose openers' outputs leave the module is tried apart, after the others: a
    # use outside that fails on a DTensor fails the whole run, not only its module's
    attempts = range(max(len(_PIECES), len(RAW_WAYS)))
    tries = itertools.chain(
        itertools.product((False, True), (0, 1, 2), attempts),
        itertools.product((False, True), (0, 1, 2), [UNEQUAL]),
    )
    for leaky, variant, attempt in tries:
        trial = {
            m: c[variant]
            for m, c in candidates.items()
            if (m not in proven or m in improvable)
            and len(c) > variant
            and c[variant].leaky == leaky
        }
        made: dict[str, dict[str, Rule]] = {}
        for m, cut in trial.items():
            rewritten: dict[str, Rule] | None = None
            if not raw & {*cut.opens, *cut.closes}:
                if attempt == UNEQUAL:
                    rewritten = rewrite(model, rules, m, cut, UNEQUAL, tp, bounds)
                elif attempt < len(_PIECES):
                    rewritten = rewrite(model, rules, m, cut, _PIECES[attempt], tp, bounds)
            elif 0 <= attempt < len(RAW_WAYS):
                rewritten = rewrite_raw(model, m, cut, *RAW_WAYS[attempt], tp, dims)
            if rewritten is not None:
                made[m] = rewritten
        if not made:
            continue

        def prove(made: dict[str, dict[str, Rule]]) -> dict[str, Inside] | None:
            # the dry run (and compile/, which it shards with) loads only for a region to prove
            from ..check.run import collectives_inside

            return collectives_inside(
                _with(plan, rules, made, names, {}),
                model,
                tp_size=tp,
                args=args,
                kwargs=kwargs,
                modules={m: _split_inside(m, rules, made[m]) for m in made},
            )

        # a region proven already, tried another way, may fail the run: apart from the
        # first tries, whose proofs it would hide
        found: dict[str, Inside] = {}
        for again in (False, True):
            group = {m: r for m, r in made.items() if (m in improvable) == again}
            found.update(_each_proven(prove, group, lambda m: type(model.get_submodule(m))))
        for m in made:
            inside = found.get(m)
            if inside is None or not _clean(inside, trial[m]):
                continue
            count = sum(inside.forward.values())
            if m in improvable and sums[m] <= count:
                continue
            if count and _in_common_pieces(attempt, raw, trial[m]):
                # every layer cut in pieces of the width they all share, with all-reduces of
                # its own: the cut went inside heads (a multi-query attention's one key/value
                # head cut in two), the all-reduce summing each head's scores; another way
                # (its key/value layers whole) keeps its heads
                continue
            proven[m], sums[m] = made[m], count
            if raw & {*trial[m].opens, *trial[m].closes}:
                # another dim may split with fewer all-reduces (heads, not a head's features)
                improvable.add(m)
    # step 4: key/value heads past their count, one per rank (region_shared.py)
    step4 = Trial(
        model, tp, (args, kwargs), lambda made: _with(plan, rules, made, names, sums),
        lambda m, made: _split_inside(m, rules, made),
    )  # fmt: skip
    fused = {m: c[0] for m, c in candidates.items() if m not in proven and c}
    fused = {m: c for m, c in fused.items() if not raw & {*c.opens, *c.closes}}
    share_fused(step4, rules, fused, proven, sums, bounds)
    share_heads(step4, rules, proven, sums)
    # a region whose proof ran all-reduces may have split inside a head (one head's
    # features, the all-reduce summing its scores), and one with layers kept whole (or
    # sharing heads) must pass apply's checks on what reads them: the checks apply_plan
    # runs say so
    doubtful = {m for m, n in sums.items() if n} | {
        m
        for m, made in proven.items()
        if any(isinstance(r, ReplicateRule) or r.shares_heads() for r in made.values())
    }
    for m in _cut_heads(model, _with(plan, rules, proven, names, sums), tp, doubtful):
        proven.pop(m, None)
    kept = raw_kept(rules, candidates, raw, proven)
    if not proven and not kept:
        return plan
    return _with(plan, {**rules, **kept}, proven, names, sums)


def _each_proven(
    prove: Callable[[dict[str, dict[str, Rule]]], dict[str, Inside] | None],
    group: dict[str, dict[str, Rule]],
    kind: Callable[[str], object],
) -> dict[str, Inside]:
    """What one proof run of every candidate in `group` counted; where that run fails (one
    candidate's way stops the forward or backward), the candidates of each `kind` (module
    class: one code, one verdict) proven apart, so a way that fails in one module (an MLP
    tried in 3 pieces) does not hide a way that works in another (its attention in 3)."""
    if not group:
        return {}
    found = prove(group)
    kinds: dict[object, dict[str, dict[str, Rule]]] = {}
    for m, rules in group.items():
        kinds.setdefault(kind(m), {})[m] = rules
    if found is not None or len(kinds) == 1:
        return found or {}
    out: dict[str, Inside] = {}
    for alike in kinds.values():
        out.update(prove(alike) or {})
    return out


def _in_common_pieces(attempt: int, raw: set[str], cut: Cut) -> bool:
    """Whether `attempt` cut the layers of `cut` (not raw weights) in pieces of the width
    every opener shares (`_PIECES`' 0)."""
    if raw & {*cut.opens, *cut.closes}:
        return False
    return 0 <= attempt < len(_PIECES) and _PIECES[attempt] == 0


def _shared(model: nn.Module, cut: Cut) -> list[Cut]:
    """A way to cut with the openers narrower than the widest kept whole (`Cut.shared`):
    the key/value layers of multi-query attention, whose one head no rank may split, used
    whole by every rank's query heads. Their weights' sizes tell them apart; the proof says
    whether DTensor runs the rest with no gather. Empty where the openers are all alike."""
    if cut.kept:
        return []
    sizes = {o: _weights(model, o) for o in cut.opens}
    widest = max(sizes.values())
    narrow = sorted(o for o, n in sizes.items() if n < widest)
    if not narrow:
        return []
    opens = [o for o in cut.opens if o not in narrow]
    return [cut._replace(opens=opens, kept=narrow, readers={}, shared=True)]


def _weights(model: nn.Module, name: str) -> int:
    """How many weights a layer (its `weight`) or a raw parameter holds."""
    try:
        return model.get_parameter(name).numel()
    except AttributeError:
        w = getattr(model.get_submodule(name), "weight", None)
        return w.numel() if isinstance(w, torch.Tensor) else 0


def _cut_heads(model: nn.Module, plan: Plan, tp: int, doubtful: set[str]) -> set[str]:
    """The `doubtful` regions (proven with all-reduces in their forward, or with layers
    kept whole) whose layers `complete_plan` (what apply_plan checks) finds a problem with:
    heads tp would cut, say."""
    if not doubtful:
        return set()
    from ..check.api import complete_plan

    _, problems = complete_plan(plan, model, tp_size=tp)
    return {
        m
        for m in doubtful
        for p in problems
        if p.module is not None and (p.module == m or p.module.startswith(f"{m}."))
    }


def _split_inside(module: str, rules: dict[str, Rule], made: dict[str, Rule]) -> list[str]:
    """The layers inside `module` a rule splits, the region's own and others (a gathered
    modulation layer in Flux's single-stream block): their collectives are their calls'."""
    per = {**rules, **made}
    return [
        n for n, r in per.items() if n.startswith(f"{module}.") and not isinstance(r, ReplicateRule)
    ]


def _clean(inside: Inside, cut: Cut) -> bool:
    """No collective in the region's forward but all-reduces (a reduction over the split
    heads: a norm's statistics over every head, attention weights averaged over heads and
    summed at the exit), and, where an opener's output leaves the module and is used,
    nothing handed back split. In its backward only sums of the gradients
    of whole tensors the split heads use (a q/k norm's weight on split heads: each rank's
    gradient is its heads' share), and, where layers stay whole, the gather of the
    gradient of what every head shares of their output (DeepSeek's rotary key part,
    expanded to every head)."""
    if inside.gathers() or (cut.leaky and inside.returned_split):
        return False
    return all(
        op.startswith("all_reduce") or (cut.kept and op.startswith("all_gather"))
        for op in inside.backward
    )


def per_module(plan: Plan, names: list[str]) -> dict[str, Rule]:
    """{module: the rule that styles it} (the first that matches, as apply does)."""
    return {n: plan.rules[i] for n, i in match_rules(plan, names).owner.items()}


def collapsed(per: dict[str, Rule], names: list[str]) -> list[Rule]:
    """Rules from per-module ones: modules with equal rules under compact patterns, in
    module order (`names`)."""
    groups: dict[str, tuple[Rule, list[str]]] = {}
    for n in names:
        if n in per:
            key = per[n].model_copy(update={"match": "_"}).model_dump_json()
            groups.setdefault(key, (per[n], []))[1].append(n)
    return [
        r.model_copy(update={"match": p})
        for r, members in groups.values()
        for p in collapse(members, names)
    ]


def example_call(model: nn.Module, example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The (args, kwargs) the tracer calls the model with, as meta tensors."""
    from .._runtime.torch_compat import tree_map
    from ..trace.run import _example_inputs

    found = _example_inputs(model, example_inputs, torch.device("meta"))
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, found)


def _with(
    plan: Plan,
    rules: dict[str, Rule],
    regions: dict[str, dict[str, Rule]],
    names: list[str],
    sums: dict[str, int],
) -> Plan:
    """The plan with each region's rules in place of its layers' old ones, and the regions
    listed ({region: the all-reduces its forward ran besides its closers'} in `sums`);
    rules are collapsed to patterns again, in module order."""
    per = dict(rules)
    for new in regions.values():
        per.update(new)
    new_rules = collapsed(per, names)
    kinds: dict[str, list[str]] = {}
    for m, made in regions.items():
        opens = [n for n, r in made.items() if isinstance(r, ColwiseRule)]
        closes = [n for n, r in made.items() if isinstance(r, RowwiseRule)]
        own = made.get(m)
        if isinstance(own, SplitParamsRule):
            why = (
                "runs on DTensors: its own weights are split and its code computes with them "
                "on each rank's part (DTensor carries the split through every op); proven on "
                "fake ranks with no gather inside it, the partial sum it hands back summed "
                "over the ranks at its exit"
            )
            if sums.get(m, 0) > 1:
                why += (
                    f", and {sums[m] - 1} all-reduce(s) per call inside it of what its code "
                    "sums over the split heads (scores mixed across heads, a norm over every "
                    "head)"
                )
            else:
                why += " (1 all-reduce per call)"
            kinds.setdefault(why, []).append(m)
            continue
        span = (
            f"runs on DTensors from {', '.join(o[len(m) + 1 :] for o in opens)} to "
            f"{', '.join(c[len(m) + 1 :] for c in closes)}: "
        )
        if sums.get(m):
            why = span + (
                "its code reduces over the split features (a norm's statistics over every "
                "head, or what it averages over the heads), which DTensor sums over the ranks; "
                "proven on fake ranks with no gather inside it, only the closers' sums and "
                f"{sums[m]} all-reduce(s) of the reduced values per call"
            )
        else:
            why = span + (
                "its code sizes the split features by what no attribute a plan may divide "
                "holds, so it sees global shapes and DTensor carries the split; proven on fake "
                "ranks with no collective inside it but the closers' sums"
            )
        handed = [n for n, r in made.items() if r.shares_heads()]
        if handed:
            why += (
                f", {', '.join(k[len(m) + 1 :] for k in handed)} sharing whole key/value heads: "
                "each rank computes its own head and the code sees it in every head's place "
                "(proven at one head per rank to read only it)"
            )
        kept = [n for n, r in made.items() if isinstance(r, ReplicateRule)]
        shared = [k for k in kept if made[k].why.startswith(SHARED)]
        if shared:
            why += (
                f", {', '.join(k[len(m) + 1 :] for k in shared)} whole on every rank and used "
                "as each rank's own heads, their gradient summed over the ranks in the backward"
            )
        elif kept:
            why += (
                f", and in the backward a gather of the gradient of what "
                f"{', '.join(k[len(m) + 1 :] for k in kept)} (kept whole) shares with every head"
            )
        kinds.setdefault(why, []).append(m)
    region_rules = [
        RegionRule(match=p, why=why) for why, ms in kinds.items() for p in collapse(ms, names)
    ]
    return plan.model_copy(
        update={"rules": new_rules, "regions": region_rules, "tpplan": SCHEMA_VERSION}
    )
