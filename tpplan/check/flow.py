"""The checks by data flow, driven: trace the model once (tpplan/trace/), run every check of
a trace on it (spans.py, widths.py, lookups.py, attributes.check_divided), then trace on
their own the parts the model's forward never calls (idle parts, such as the vision tower
of a model traced on text alone), as infer_plan does. A model that cannot be traced gets
the structural check (structure.py). Start at `check_flow`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import nn

from ..compile.shard import attribute_divisor
from ..errors import Problem, TpplanError
from ..plan.patterns import match_names
from ..plan.schema import Plan
from ..plan.styles import VocabParallelRule
from .attributes import check_divided
from .lookups import check_lookups
from .shared import Match, traced_name
from .spans import check_heads, check_spans
from .structure import check_by_structure
from .widths import check_widths

if TYPE_CHECKING:
    from ..trace import Trace

__all__ = ["check_flow"]


def check_flow(
    plan: Plan,
    by_rule: dict[int, list[str]],
    model: nn.Module,
    tp: int,
    undivided: set[str],
    traced: Callable[[], Trace] | None = None,
) -> tuple[list[Problem], dict[str, str]]:
    """A column-parallel output must reach row-parallel layers only (and the reverse), and
    split into whole heads as the model itself views them; the heads and fused pieces a
    rule states must be the model's; a vocab-parallel embedding must sum where its rows are.

    `by_rule` is each rule's matched modules; `undivided`, the modules whose split sizes a
    divisibility problem already names (the heads check does not name them again). Returns
    the problems, and for modules of `undivided` where sharing key/value heads would serve,
    the words to add to that problem's fix. The
    model is traced (tpplan/trace/) to see where each layer's output goes; a model that
    cannot be traced (its inputs cannot be guessed) gets the structural check instead.
    Idle parts are traced on their own, as infer_plan splits them. `traced` gives the
    model's trace where the caller has one (check_plan shares it with complete.py).
    """
    from ..trace import idle_roots, trace_model

    targets = _targets(plan, by_rule, [n for n, _ in model.named_modules() if n])
    # an attribute divided by the ranks sharing a head where none share one is left as it is
    divided = [(i, n) for i, n in targets.divided if _divisor(plan, model, i, n, tp) != 1]
    targets = targets._replace(divided=divided)
    if not any(targets):
        return [], {}
    try:
        trace = traced() if traced is not None else trace_model(model)
    except TpplanError:
        return check_by_structure(plan, targets.openers, targets.closers, model), {}
    out, hints = _check_trace(plan, targets, trace, tp, undivided)
    named = (name for pairs in targets for _, name in pairs)
    for root in idle_roots(named, trace.layers.ran, lambda n: traced_name(trace, n)):
        out += _check_part(plan, targets, model, root, tp, undivided)
    return out, hints


class _Targets(NamedTuple):
    """The (rule index, module name) pairs each check of a trace looks at."""

    openers: list[Match]
    closers: list[Match]
    vocab_parallel: list[Match]
    widths: list[Match]
    """Modules whose rule states a head_dim, parts or fused pieces."""
    divided: list[Match]
    """(attribute rule index, module name): the rule indexes plan.attributes."""


def _targets(plan: Plan, by_rule: dict[int, list[str]], names: list[str]) -> _Targets:
    def having(keep: Any) -> list[Match]:
        return [(i, n) for i, r in enumerate(plan.rules) if keep(r) for n in by_rule[i]]

    return _Targets(
        openers=having(lambda r: r.opens_split()),
        closers=having(lambda r: r.closes_split()),
        vocab_parallel=having(lambda r: isinstance(r, VocabParallelRule)),
        # a colwise layer gathered right after is no opener, but its parts must still be right
        widths=having(lambda r: r.states_sizes()),
        divided=[
            (i, n) for i, a in enumerate(plan.attributes) for n in match_names(a.match, names)
        ],
    )


def _divisor(plan: Plan, model: nn.Module, i: int, name: str, tp: int) -> int:
    """What attribute rule `i` divides module `name`'s attributes by at `tp` (0 where it
    names no layer whose heads it counts: check_attributes says so)."""
    try:
        return attribute_divisor(plan, model, plan.attributes[i], name, tp)
    except TpplanError:
        return 0


def _check_trace(
    plan: Plan,
    targets: _Targets,
    trace: Trace,
    tp: int,
    undivided: set[str],
) -> tuple[list[Problem], dict[str, str]]:
    """Every check of one trace, in the order their problems are reported, and the heads
    check's words for the fixes of modules in `undivided` (`check_heads`)."""
    heads, hints = check_heads(plan, targets.openers, trace, tp, undivided)
    problems = (
        check_spans(plan, targets.openers, targets.closers, trace)
        + heads
        + check_widths(plan, targets.widths, trace)
        + check_lookups(plan, targets.vocab_parallel, trace)
        + check_divided(plan, targets.openers, targets.divided, trace)
    )
    return problems, hints


def _check_part(
    plan: Plan, targets: _Targets, model: nn.Module, root: str, tp: int, undivided: set[str]
) -> list[Problem]:
    """The checks on a trace of one idle part alone, on the inputs infer_plan traces it on;
    a part that cannot run alone is tried child by child, as infer_plan does. What nothing
    can run stays unchecked by flow (infer_plan keeps it whole)."""
    from .._runtime.inputs import example_inputs, part_inputs
    from ..trace import trace_model

    part = model.get_submodule(root)
    try:
        guess = part_inputs(part)
        inputs = guess if guess is not None else example_inputs(part, batch=2, seq=16)
        trace = trace_model(_placed(part, root), example_inputs=inputs)
    except TpplanError:
        out: list[Problem] = []
        for child, _ in part.named_children():
            below = f"{root}.{child}"
            if any(n == below or n.startswith(below + ".") for pairs in targets for _, n in pairs):
                out += _check_part(plan, targets, model, below, tp, undivided)
        return out
    return _check_trace(plan, targets, trace, tp, undivided)[0]


def _placed(part: nn.Module, root: str) -> nn.Module:
    """A module holding only `part`, at the same dotted path as in the model, whose forward
    is the part's: traced, the part's layers keep the names the plan's rules match (and
    layers outside it do not run, so the checks pass them by)."""

    class Placed(nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.get_submodule(root)(*args, **kwargs)

    shell = Placed()
    here: nn.Module = shell
    *path, last = root.split(".")
    for name in path:
        here.add_module(name, nn.Module())
        here = here.get_submodule(name)
    here.add_module(last, part)
    return shell
