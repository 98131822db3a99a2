"""The plan's DTensor regions (`Plan.regions`): each pattern matches modules, and, once the
plan runs, no collective runs inside a region's forward outside its split layers' own calls
(else the region runs, at parity, but gathers: weights shrink, work does not). A backward
may gather the gradient of a whole tensor every split head shares (DeepSeek's rotary key),
as `stats` shows; that is not split work done again.

A key/value layer sharing whole heads that hands its output on to a region's code
(`replicate_heads` with `local_output: false`) computes only the rank's own head and shows
the code the whole width with that head in every head's place (compile/shared_heads.py).
That is right only where the code reads, for each rank's query heads, nothing of the other
heads: `one_head_per_rank` proves it by running the region once more on fake ranks at a tp
size of one key/value head per rank, the layer plain colwise. There DTensor must carry each
head through the code with no collective beyond the ones at the plan's tp (a reduction over
the query heads); so each group of ranks sharing a head computes its query heads from that
head alone, and the copies in the other places are never read.

Start at `check_dtensor_regions` (static) and `check_region_collectives` (after the dry run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from ..errors import Problem
from ..plan.patterns import match_names
from ..plan.schema import Plan
from ..plan.styles import ColwiseRule, ReplicateRule

if TYPE_CHECKING:
    from .run import Inside

__all__ = ["check_dtensor_regions", "check_region_collectives", "one_head_per_rank"]


def _label(i: int, plan: Plan) -> str:
    return f"regions[{i}] (match: {plan.regions[i].match})"


def _handed_whole(plan: Plan) -> list[tuple[int, ColwiseRule]]:
    """The rules of key/value layers sharing heads that hand their output to a region."""
    return [
        (i, r)
        for i, r in enumerate(plan.rules)
        if isinstance(r, ColwiseRule) and r.replicate_heads and r.local_output is False
    ]


def _in_regions(plan: Plan, names: list[str]) -> list[str]:
    return [m for region in plan.regions for m in match_names(region.match, names)]


def check_dtensor_regions(plan: Plan, names: list[str]) -> list[Problem]:
    """A region pattern that matches no module; a shared-heads layer handing its output on
    (`local_output: false`) outside every region."""
    problems = []
    regions = _in_regions(plan, names)
    for i, rule in _handed_whole(plan):
        label = f"rules[{i}] (match: {rule.match})"
        outside = [
            n
            for n in match_names(rule.match, names)
            if not any(n.startswith(f"{m}.") for m in regions)
        ]
        if outside:
            problems.append(
                Problem(
                    "dtensor_region",
                    label,
                    outside[0],
                    f"{outside[0]} shares whole key/value heads and hands its output on "
                    "(local_output: false), but no region of the plan holds it: each rank "
                    "hands on its own head in every head's place, which only a region's "
                    "proven code may read.",
                    "list the module whose code reads it in the plan's regions, or drop "
                    "local_output: false.",
                )
            )
    for i, region in enumerate(plan.regions):
        if not match_names(region.match, names):
            problems.append(
                Problem(
                    "no_match",
                    _label(i, plan),
                    None,
                    f"the region pattern {region.match!r} matches no module of the model.",
                    "correct the pattern (module names as model.named_modules() prints them) "
                    "or delete the region.",
                )
            )
    return problems


def check_region_collectives(plan: Plan, model: nn.Module, tp_size: int) -> list[Problem]:
    """Each region module whose forward ran collectives outside its split layers in the
    dry run."""
    if not plan.regions:
        return []
    from .run import collectives_inside, region_inputs

    names = [n for n, _ in model.named_modules() if n]
    split = {
        n
        for r in plan.rules
        if not isinstance(r, ReplicateRule)
        for n in match_names(r.match, names)
    }
    modules = {}
    label = {}
    for i, region in enumerate(plan.regions):
        if region.stream:
            continue  # its submodules gather the stream's shards inside it, by design
        for m in match_names(region.match, names):
            modules[m] = [n for n in split if n.startswith(f"{m}.")]
            label[m] = _label(i, plan)
    inputs = region_inputs(model, tp_size)
    if inputs is None:
        return []
    found = collectives_inside(
        plan, model, tp_size=tp_size, args=(), kwargs=inputs, modules=modules
    )
    if found is None:
        return []
    problems = [
        Problem(
            "dtensor_region",
            label[m],
            m,
            f"{n.gathers()} gathering collective(s) ran inside the region's forward outside its split "
            "layers' own calls: "
            "it runs, but gathers its split activations, so its work is not split.",
            "delete the region (its layers then split and gather, as `tpplan infer` "
            "writes where no region is proven), or rerun `tpplan infer`.",
        )
        for m, n in found.items()
        if n.gathers() > 0
    ]
    for m, why in one_head_per_rank(plan, model, tp_size, found).items():
        problems.append(
            Problem(
                "dtensor_region",
                label.get(m, m),
                m,
                f"{why}; a layer sharing whole heads hands the code its own head in every "
                "head's place (replicate_heads with local_output: false), which is right only "
                "where each rank reads its own head.",
                "keep the layer whole (style: replicate), or rerun `tpplan infer`.",
            )
        )
    return problems


def _heads(model: nn.Module, name: str, rule: ColwiseRule) -> int | None:
    """The heads a layer shares among ranks: its output's, or its fused pieces' fewest."""
    out = getattr(model.get_submodule(name), "out_features", None)
    sizes = rule.parts or ([out] if isinstance(out, int) else [])
    if not sizes or not rule.head_dim or any(n % rule.head_dim for n in sizes):
        return None
    return min(n // rule.head_dim for n in sizes)


def one_head_per_rank(
    plan: Plan,
    model: nn.Module,
    tp_size: int,
    at_tp: dict[str, Inside],
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> dict[str, str]:
    """{region: why its code may read other key/value heads than a rank's own}, for each
    region holding a layer that shares whole heads and hands its output on (`local_output:
    false`) at a tp size above its heads; a region missing is proven (see the module
    docstring). `at_tp`: what the region ran at `tp_size` ({region: Inside}, as
    collectives_inside counts it). The run at one head per rank takes `args` and `kwargs`
    (made up for that tp size where None)."""
    from .run import collectives_inside, region_inputs

    names = [n for n, _ in model.named_modules() if n]
    regions = _in_regions(plan, names)
    # {heads: {region: its layers sharing that many heads}}
    by_heads: dict[int, dict[str, list[str]]] = {}
    for _, rule in _handed_whole(plan):
        for n in match_names(rule.match, names):
            heads = _heads(model, n, rule)
            holder = next((m for m in regions if n.startswith(f"{m}.")), None)
            if holder is None:
                continue  # check_dtensor_regions' problem
            if heads is None or heads >= tp_size or tp_size % heads:
                continue  # plain colwise at this tp (or refused by the rule's own checks)
            by_heads.setdefault(heads, {}).setdefault(holder, []).append(n)
    out: dict[str, str] = {}
    for heads, held in by_heads.items():
        plain = [
            r.model_copy(update={"replicate_heads": None, "head_dim": None})
            if isinstance(r, ColwiseRule) and r.replicate_heads and r.local_output is False
            else r
            for r in plan.rules
        ]
        at_heads = plan.model_copy(update={"rules": plain})
        split = {
            n
            for r in plain
            if not isinstance(r, ReplicateRule)
            for n in match_names(r.match, names)
        }
        modules = {m: [n for n in split if n.startswith(f"{m}.")] for m in held}
        given = kwargs if kwargs is not None else region_inputs(model, heads)
        found = None
        if given is not None:
            found = collectives_inside(
                at_heads, model, tp_size=heads, args=args, kwargs=given, modules=modules
            )
        for m, layers in held.items():
            why = _one_head_why(found, at_tp, m, heads)
            if why is not None:
                out[m] = f"{', '.join(n[len(m) + 1 :] for n in layers)}: {why}"
    return out


def _one_head_why(
    found: dict[str, Inside] | None, at_tp: dict[str, Inside], m: str, heads: int
) -> str | None:
    """Why the run at one head per rank (`found`) does not prove region `m`; None: it does."""
    if found is None or m not in found:
        return f"the region did not run at tp {heads} (one key/value head per rank)"
    inside, mine = found[m], at_tp.get(m)
    moved = {**inside.forward, **{f"{op} (backward)": n for op, n in inside.backward.items()}}
    if inside.gathers() or any(not op.startswith("all_reduce") for op in inside.backward):
        ops = ", ".join(f"{n} {op}" for op, n in moved.items() if n)
        return (
            f"at tp {heads} (one key/value head per rank) its code ran {ops}: it reads other "
            "heads than the one its query heads use"
        )
    sums = sum(inside.forward.values())
    if mine is None or sums != sum(mine.forward.values()):
        return (
            f"at tp {heads} (one key/value head per rank) its code summed over the ranks "
            f"{sums} time(s), not as at the plan's tp: it reduces over the key/value heads"
        )
    return None
