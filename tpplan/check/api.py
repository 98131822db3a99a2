"""check_plan, the driver of every check: it reads top to bottom, one step per module of
check/, and returns every problem at once. Start at `check_plan`.

First complete.py reads the sizes the plan's rules leave out (head_dim, fused pieces) from
a trace of the model; every check, and apply_plan, then uses the completed plan
(`complete_plan`). The steps, in the order their problems are reported:
- rules.py: each rule on the modules it matches (no match, overlap, a style that does not
  fit the module, sizes tp does not divide via sizes.py), then across rules (a split inside
  an experts module, a tied parameter split two ways); adapters.py: a LoRA adapter split
  unlike its base layer;
- flow.py: regions, heads, widths, vocab-parallel lookups and divided attributes, by a
  trace of the model's data flow (structure.py where it cannot be traced);
- attributes.py: the attribute fixes; fingerprint.py: the plan's model;
- run.py: only when all of these pass, one dry run of the sharded forward and backward.
None but the dry run touches torch.distributed, so they work on a model on the meta
device, of any size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from torch import nn

from ..errors import Problem, TpplanError
from ..plan.patterns import collapse
from ..plan.schema import Plan
from .adapters import check_adapters
from .attributes import check_attributes
from .complete import complete_sizes
from .fingerprint import check_fingerprint
from .flow import check_flow
from .regions_dtensor import check_dtensor_regions, check_region_collectives
from .rules import check_inside_experts, check_rules, check_tied, match_rules

if TYPE_CHECKING:
    from ..trace import Trace

__all__ = ["check_plan", "complete_plan", "splits_nothing"]


def check_plan(plan: Plan, model: nn.Module, *, tp_size: int) -> list[Problem]:
    """Every problem of `plan` for `model` at `tp_size`; an empty list when the plan is sound.

    Reported: patterns that match no module, modules matched by two rules, styles on module
    types they cannot apply to, split dims (features, heads, vocab) that tp_size does not
    divide, column-parallel regions no row-parallel module closes (and the reverse),
    attribute fixes that cannot be made, and a fingerprint that does not match the model.

    A plan with none of these is applied to a weightless copy of the model over `tp_size`
    fake ranks and run forward and backward (tpplan/check/run.py); a failure is one problem
    naming the rule, the module where torch raised and torch's error. Where no such run can
    be set up (inputs tpplan cannot make up, a model that does not run on meta tensors even
    unsharded, parameters that are already DTensors), the checks above stand alone.

    Sizes a rule leaves out (head_dim, fused parts) are read from the model first, and the
    checks judge the plan completed with them (`complete_plan`).
    """
    return complete_plan(plan, model, tp_size=tp_size)[1]


def complete_plan(plan: Plan, model: nn.Module, *, tp_size: int) -> tuple[Plan, list[Problem]]:
    """(`plan` with the sizes its rules leave out read from `model`, every problem of it at
    `tp_size`): what check_plan reports, and the plan apply_plan shards with (and keeps as
    `model._tpplan_plan`). A size a rule states stays; one the model contradicts is a
    problem, told once.

    Example::

        plan, problems = complete_plan(load_plan("llama"), model, tp_size=2)
        plan.rules[1].head_dim  # 64 for a model of head_dim 64
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}.")
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    matches = match_rules(plan, names)
    traced = _tracer(model)
    # first: every check after it judges the sizes the model has, so that a size stated
    # wrong is one problem (complete.py's), not again as heads or attributes that misfit
    plan, sized = _complete(plan, matches.by_rule, traced)
    problems = check_rules(plan, matches, modules, tp_size)
    problems += check_inside_experts(plan, matches.owner)
    problems += check_tied(plan, matches.owner, model)
    problems += check_adapters(plan, matches.owner, model)
    # after the rules' own checks: the heads check by flow names no module whose sizes
    # already failed, so that one mistake is told once
    undivided = {p.module for p in problems if p.kind == "divisibility" and p.module}
    flow, hints = check_flow(plan, matches.by_rule, model, tp_size, undivided, traced)
    problems += flow + sized
    problems = [
        replace(p, fix=p.fix.removesuffix(".") + hints[p.module] + ".")
        if p.kind == "divisibility" and p.module in hints
        else p
        for p in problems
    ]
    problems += check_attributes(plan, names, modules, tp_size)
    problems += check_fingerprint(plan, model)
    problems += check_dtensor_regions(plan, names)
    if problems:
        return plan, _merge_layers(problems, names)
    # Last, the proof: the plan applied to a meta copy runs a forward and a backward. Only
    # for a plan the checks above pass, so that one mistake is not told twice.
    from .run import run_plan

    problems = run_plan(plan, model, tp_size=tp_size)
    if problems:
        return plan, problems
    # a region that runs but gathers inside is sound, and does not split the work
    return plan, _merge_layers(check_region_collectives(plan, model, tp_size), names)


def _tracer(model: nn.Module) -> Callable[[], Trace]:
    """The model's trace, made once when first asked for (complete.py and flow.py share
    it); a model that cannot be traced raises its TpplanError each time, traced once."""
    from ..trace import trace_model

    got: list[Trace | TpplanError] = []

    def traced() -> Trace:
        if not got:
            try:
                got.append(trace_model(model))
            except TpplanError as e:
                got.append(e)
        if isinstance(got[0], TpplanError):
            raise got[0]
        return got[0]

    return traced


def _complete(
    plan: Plan, by_rule: dict[int, list[str]], traced: Callable[[], Trace]
) -> tuple[Plan, list[Problem]]:
    """complete_sizes on the model's trace; a plan that splits nothing is not traced for it."""
    if not any(r.sized for r in plan.rules):
        return plan, []
    try:
        return complete_sizes(plan, by_rule, traced())
    except TpplanError as e:
        return complete_sizes(plan, by_rule, None, str(e))


def splits_nothing(plan: Plan) -> bool:
    """Whether applying the plan leaves every parameter and activation whole on every rank
    (no rules, or only replicate ones): sound, but each rank then runs the whole model."""
    return not any(r.splits for r in plan.rules)


def _merge_layers(problems: list[Problem], names: list[str]) -> list[Problem]:
    """One problem per rule and message, its modules collapsed over repeated layers."""
    groups: dict[tuple[str, str, str, str], list[Problem]] = {}
    for p in problems:
        groups.setdefault((p.kind, p.rule, p.message, p.fix), []).append(p)
    out = []
    for (kind, rule, message, fix), same in groups.items():
        mods = [p.module for p in same if p.module is not None]
        module = ", ".join(collapse(mods, names)) if mods else None
        out.append(Problem(kind, rule, module, message, fix))  # type: ignore[arg-type]
    return out
