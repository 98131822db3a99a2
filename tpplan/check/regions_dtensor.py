"""The plan's DTensor regions (`Plan.regions`): each pattern matches modules, and, once the
plan runs, no collective runs inside a region's forward outside its split layers' own calls
(else the region runs, at parity, but gathers: weights shrink, work does not). A backward
may gather the gradient of a whole tensor every split head shares (DeepSeek's rotary key),
as `stats` shows; that is not split work done again.

Start at `check_dtensor_regions` (static) and `check_region_collectives` (after the dry run).
"""

from __future__ import annotations

from torch import nn

from ..errors import Problem
from ..plan.patterns import match_names
from ..plan.schema import Plan
from ..plan.styles import ReplicateRule

__all__ = ["check_dtensor_regions", "check_region_collectives"]


def _label(i: int, plan: Plan) -> str:
    return f"regions[{i}] (match: {plan.regions[i].match})"


def check_dtensor_regions(plan: Plan, names: list[str]) -> list[Problem]:
    """A region pattern that matches no module."""
    problems = []
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
    return [
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
