"""Vocab-parallel embeddings checked against how the traced forward uses their looked-up
rows: each rank's rows are partial (its share of the vocab, zeros elsewhere) until they are
summed, so what the embedding's own forward does to them must be linear, or the rule must
sum them at the lookup (`sum_at: lookup`); parameters it writes over rows must be named
(`written`). Start at `check_lookups`; flow.py calls it on each trace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import Problem
from ..plan.schema import Plan
from ..plan.styles import VocabParallelRule
from .shared import Match, rule_label, traced_name

if TYPE_CHECKING:
    from ..trace import Trace

__all__ = ["check_lookups"]


def check_lookups(plan: Plan, embeddings: list[Match], trace: Trace) -> list[Problem]:
    """A vocab-parallel embedding whose own forward does what is not linear in the looked-up
    rows (a norm) must sum them at the lookup (`sum_at: lookup`); one that writes its own
    parameters over rows must name them (`written`) so each rank writes its share, or sum
    at the lookup. Both need its lookups made through nn.Embedding's forward."""
    out: list[Problem] = []
    for i, name in embeddings:
        rule, t = plan.rules[i], traced_name(trace, name)
        if not isinstance(rule, VocabParallelRule):  # `embeddings` are its rules' modules
            continue
        found = _sum_problem(rule, t, trace) or _written_problem(rule, t, trace)
        if found is not None:
            out.append(Problem("lookup", rule_label(i, rule), name, *found))
    return out


_WHOLE = "keep it whole (style: replicate)."


def _sum_problem(rule: VocabParallelRule, t: str, trace: Trace) -> tuple[str, str] | None:
    """(message, fix) where the rows of the embedding traced as `t` are summed too late or
    cannot be summed where the rule asks."""
    not_linear, at_place = trace.lookups.not_linear.get(t), trace.lookups.at_lookup_place.get(t)
    named = sorted(rule.written or ())
    if (rule.sum_at is not None or named) and at_place is False:
        how = "sum_at: lookup sums" if rule.sum_at is not None else "written looks up"
        return (
            "it looks its rows up with an embedding of its own, not through nn.Embedding's "
            f"forward (`super().forward(ids)`), where {how} them.",
            _WHOLE,
        )
    if not_linear and rule.sum_at is None:
        return (
            f"its forward applies {not_linear} to the looked-up rows, which is not linear in "
            "them, but "
            + (
                "written sums the rows only as the forward returns"
                if named
                else "a vocab-parallel lookup's partial rows are summed only after the forward"
            )
            + ", so it would act on partial rows.",
            (
                "replace written with `sum_at: lookup`."
                if named
                else "add `sum_at: lookup` to the rule."
            )
            if at_place
            else _WHOLE,
        )
    return None


def _written_problem(rule: VocabParallelRule, t: str, trace: Trace) -> tuple[str, str] | None:
    """(message, fix) where the rule's `written` is not what the forward of the embedding
    traced as `t` writes over its looked-up rows."""
    seen = sorted(trace.lookups.written_rows.get(t, ()))
    named = sorted(rule.written or ())
    if rule.sum_at is not None or named == seen:
        if named and trace.written_elsewhere(t, named):
            return (
                f"its forward uses {', '.join(named)} otherwise than by writing it over "
                "looked-up rows, so it cannot be split as written asks.",
                "replace written with `sum_at: lookup`.",
            )
        return None
    listed = f"[{', '.join(seen)}]"
    if not seen:
        return (
            f"written names {', '.join(named)}, but its forward writes no parameter of its "
            "own over the looked-up rows.",
            "drop written from the rule.",
        )
    if not named:
        return (
            f"its forward writes {', '.join(seen)} over some of the looked-up rows, but a "
            "vocab-parallel lookup's rows are partial sums there, so each rank would write "
            "the whole of it and the sum would count it once per rank.",
            f"add `written: {listed}` to the rule (or `sum_at: lookup`).",
        )
    return (
        f"its forward writes {', '.join(seen)} over looked-up rows, but written names "
        f"{', '.join(named)}.",
        f"set `written: {listed}`.",
    )
