"""The widths a rule states, checked against the traced model: its head_dim and its fused
parts must be the model's own, as its forward cuts the features. Start at `check_widths`;
flow.py calls it on each trace. The readers (`model_head_dim`, `model_pieces`) read the
model's own widths as infer reads them; complete.py fills a rule's missing widths with them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import Problem
from ..plan.schema import Plan, Rule
from .shared import Match, rule_label, traced_name

if TYPE_CHECKING:
    from ..trace import Trace

__all__ = [
    "check_widths",
    "head_dim_problem",
    "model_head_dim",
    "model_pieces",
    "parts_problem",
]


def check_widths(plan: Plan, modules: list[Match], trace: Trace) -> list[Problem]:
    """A rule's head_dim and fused parts must be the model's own, as its forward cuts the
    features. The rule's own checks only ask that the width be whole heads of the stated size
    and that the parts add up to it; but 32 heads of 64 are also 16 whole heads of 128, and
    768 | 768 | 768 add up like 512 | 1024 | 768: a plan written for another model would
    pass them. Wrong parts give each rank the wrong slices (wrong numbers); a wrong head_dim
    checks tp sizes against heads the model does not have."""
    out: list[Problem] = []
    for i, name in modules:
        rule, t = plan.rules[i], traced_name(trace, name)
        out += _check_parts(i, rule, name, t, trace)
        if rule.head_size() is not None:
            out += _check_head_dim(i, rule, name, t, trace)
    return out


def _check_parts(i: int, rule: Rule, name: str, t: str, trace: Trace) -> list[Problem]:
    """The rule's parts, and each of its fused parameters' pieces, against the pieces the
    model cuts the features of the module traced as `t` into."""
    stated = [(None, rule.part_sizes())] + [(p, sizes) for p, sizes in rule.fused_sizes().items()]
    out: list[Problem] = []
    for param, sizes in stated:
        pieces = model_pieces(trace, t, param)
        # (sizes that do not add up to the width are reported by the rule's own check)
        if not sizes or not pieces or sum(sizes) != sum(pieces) or sizes == [*pieces]:
            continue
        out.append(parts_problem(i, rule, name, param, sizes, pieces))
    return out


def parts_problem(
    i: int, rule: Rule, name: str, param: str | None, sizes: list[int], pieces: tuple[int, ...]
) -> Problem:
    """The Problem of stated fused sizes (`parts`, or `fused` of the expert parameter
    `param`) other than the pieces the model cuts the features into."""
    field, of, setting = (
        ("parts", "", "parts: {}")
        if param is None
        else (
            f"fused {param}",
            f" of {param}" + (" per expert" if rule.style == "experts" else ""),
            f"fused: {{{{{param}: {{}}}}}}",
        )
    )
    return Problem(
        "parts",
        rule_label(i, rule),
        name,
        f"the rule states {field} {sizes}, but the model cuts its "
        f"{sum(pieces)} output features{of} into the pieces {[*pieces]}.",
        f"set {setting.format([*pieces])} in the rule, or infer the plan again "
        "for this model (`tpplan infer`).",
    )


def _check_head_dim(i: int, rule: Rule, name: str, t: str, trace: Trace) -> list[Problem]:
    seen = model_head_dim(trace, t, closer=rule.closes_split())
    if seen is None or seen[0] == rule.head_size():
        return []
    return [head_dim_problem(i, rule, name, seen)]


def head_dim_problem(i: int, rule: Rule, name: str, seen: tuple[int, str]) -> Problem:
    """The Problem of a stated head_dim other than the model's (`seen`: its head size and
    how the model's views show it)."""
    head_dim, view = seen
    return Problem(
        "head_dim",
        rule_label(i, rule),
        name,
        f"the rule states head_dim {rule.head_size()}, but the model's head_dim is "
        f"{head_dim} ({view}).",
        f"set head_dim: {head_dim} in the rule, or infer the plan again for this model "
        "(`tpplan infer`).",
    )


def model_pieces(trace: Trace, t: str, param: str | None = None) -> tuple[int, ...] | None:
    """The fused pieces the model cuts the output features of the module traced as `t`
    into (of its expert parameter `param`, per expert), as infer writes a rule's parts and
    fused; None where the forward cuts none."""
    return trace.spans.parts.get(t if param is None else f"{t}.{param}")


def model_head_dim(trace: Trace, t: str, *, closer: bool) -> tuple[int, str] | None:
    """(head size, how the model's views show it) of a traced opener or closer, read as
    infer reads it when it writes a rule's head_dim; None where the flow shows no heads."""
    if closer:
        s = trace.spans.closers.get(t)
        if s is None or s.inner <= 1:
            return None
        return s.inner, f"its {s.n * s.inner} input features arrive as {s.n} heads of {s.inner}"
    if t not in trace.spans.openers:
        return None
    features, parts = trace.spans.openers[t], trace.spans.parts.get(t)
    if parts is not None:
        # fused pieces are cut apart before any view: their head size shows where they meet
        # again, at the closers' input, merged from (heads, head_dim)
        links = [g for g in trace.spans.links if t in g]
        inners = {
            trace.spans.closers[c].inner for g in links for c in g if c in trace.spans.closers
        }
        if len(inners) != 1 or (inner := inners.pop()) <= 1 or any(p % inner for p in parts):
            return None
        pieces = " | ".join(map(str, parts))
        return (
            inner,
            f"its {features} output features are fused pieces ({pieces}), each made of heads "
            f"of {inner}",
        )
    heads = trace.spans.heads.get(t)
    if not heads or features % heads:
        return None
    return (
        features // heads,
        f"it views its {features} output features as {heads} heads of {features // heads}",
    )
