"""Spans checked by the traced data flow: a column-parallel output must reach row-parallel
layers only (and a row-parallel input come from column-parallel ones), and split into whole
heads as the model's own views cut them. Start at `check_spans`; flow.py calls it and
`check_heads` on each trace.

The words are the tracer's (tpplan/trace/record.py): opener, closer, span, whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import Problem
from ..plan.patterns import matches, wildcard
from ..plan.schema import Plan, Rule
from .shared import Match, legal_sizes, rule_label, traced_name

if TYPE_CHECKING:
    from ..trace import Trace

__all__ = ["check_heads", "check_spans"]


def check_spans(
    plan: Plan, openers: list[Match], closers: list[Match], trace: Trace
) -> list[Problem]:
    """Every opener's problems, then every closer's: a span the plan opens and does not
    close (or closes and does not open), as the trace links them."""
    return _check_openers(plan, openers, closers, trace) + _check_closers(
        plan, openers, closers, trace
    )


def _partners(trace: Trace, t: str, role: dict[str, Any]) -> set[str]:
    """The layers of `role` (the trace's openers or closers) in a span with `t`."""
    return {m for g in trace.spans.links if t in g for m in g if m in role and m != t}


def _check_openers(
    plan: Plan, openers: list[Match], closers: list[Match], trace: Trace
) -> list[Problem]:
    close_t = {traced_name(trace, n) for _, n in closers}
    out: list[Problem] = []
    for i, name in openers:
        rule, t = plan.rules[i], traced_name(trace, name)
        if t in trace.lookups.token_ids and t not in trace.spans.openers:
            out.append(_split_rows(i, rule, name))
        if t not in trace.spans.openers:
            continue  # not a Linear called on a whole input; the type check speaks for it
        missing = sorted(wildcard(c) for c in _partners(trace, t, trace.spans.closers) - close_t)
        if missing:
            out.append(
                Problem(
                    "unclosed_region",
                    rule_label(i, rule),
                    name,
                    f"its output is contracted by {', '.join(missing)}, which the plan does not make "
                    "rowwise, so that layer would read a shard as if it were the whole tensor.",
                    "make those layers rowwise, or gather this output with `output: replicate`.",
                )
            )
        elif (
            t in trace.spans.at_output
            and not _partners(trace, t, trace.spans.closers)
            and not plan.options.loss_parallel
        ):
            out.append(
                Problem(
                    "unclosed_region",
                    rule_label(i, rule),
                    name,
                    f"its output stays sharded ({rule.output_layout()}) up to the model's output.",
                    "gather it with `output: replicate`, or set options.loss_parallel and compute "
                    "the loss under torch.distributed.tensor.parallel.loss_parallel().",
                )
            )
    return out


def _check_closers(
    plan: Plan, openers: list[Match], closers: list[Match], trace: Trace
) -> list[Problem]:
    open_t = {traced_name(trace, n) for _, n in openers}
    out: list[Problem] = []
    for i, name in closers:
        rule, t = plan.rules[i], traced_name(trace, name)
        if t not in trace.spans.closers:
            # The trace saw no split arrive (or its split went through a reshape by stored
            # head counts, which the plan's attributes fix): nothing to pair it with.
            continue
        region = _region_of(plan, t)
        missing = sorted(
            wildcard(o)
            for o in _partners(trace, t, trace.spans.openers) - open_t
            # in a DTensor region a whole layer's output meets the split heads as a
            # replicated DTensor (key/value heads every rank's query heads share)
            if region is None or _region_of(plan, o) != region
        )
        if missing:
            out.append(
                Problem(
                    "unopened_region",
                    rule_label(i, rule),
                    name,
                    f"its input comes from {', '.join(missing)}, which the plan does not make colwise.",
                    "make those layers colwise too, or declare `input: replicate`.",
                )
            )
    return out


def _region_of(plan: Plan, name: str) -> str | None:
    """The DTensor region (a module `Plan.regions` names) `name` runs in, if any."""
    parts = name.split(".")
    for n in range(len(parts), -1, -1):
        module = ".".join(parts[:n])
        if any(matches(r.match, module) for r in plan.regions):
            return module
    return None


def _split_rows(i: int, rule: Rule, name: str) -> Problem:
    """colwise on an embedding whose rows are looked up (not one looked up at computed positions
    to open a split, as T5's relative position bias is) and whose output stays split."""
    return Problem(
        "unclosed_region",
        rule_label(i, rule),
        name,
        "colwise on an nn.Embedding gives each rank a slice of every looked-up row's "
        f"features and leaves its output split ({rule.output_layout()}), but the "
        "layers after a lookup take whole rows.",
        "colwise on an Embedding: use vocab_parallel (each rank holds a share of the vocab; "
        "one all-reduce) or replicate, or gather its rows with `output: replicate`.",
    )


def shared_units(trace: Trace, t: str, tp: int, shared: set[str]) -> int | None:
    """The blocks tp must divide for opener `t`: the trace's units (in grouped-query
    attention, each side's own heads), except for a key/value opener in `shared`
    (replicate_heads) at a tp that is a multiple of its heads: each rank's query heads then
    meet one of them, which tp/K ranks share, and it needs nothing more."""
    spans = trace.spans
    if t in shared and t in spans.kv_heads and tp % spans.kv_heads[t] == 0:
        return tp
    return spans.units.get(t)


def sharing_hint(trace: Trace, t: str, tp: int, shared: set[str]) -> str:
    """The end of a divisibility fix for traced opener `t`: where its heads are key/value
    heads that query heads share and tp is a multiple of them, replicate_heads would serve."""
    kv = trace.spans.kv_heads.get(t)
    if kv is None or t in shared or tp % kv or t in trace.spans.unshared:
        return ""
    return (
        f"; or, as its {kv} heads are key/value heads the query heads share, add "
        f"replicate_heads: true to the rule: each goes whole to the tp/{kv} ranks holding its "
        "query heads (`tpplan infer` writes it)"
    )


def check_heads(
    plan: Plan,
    openers: list[Match],
    trace: Trace,
    tp: int,
    undivided: set[str],
) -> tuple[list[Problem], dict[str, str]]:
    """Each split output must give every rank whole heads as the model's own views cut them
    (the trace's units), whatever head_dim the plan states: a plan whose head_dim is too
    small (or missing) would pass the rule's own check and cut heads in half mid-forward.
    A module in `undivided` has had its divisibility problem told already; where sharing
    its key/value heads would serve, the words to add to that problem's fix are returned
    beside the problems, by module."""
    out: list[Problem] = []
    hints: dict[str, str] = {}
    shared = {traced_name(trace, n) for i, n in openers if plan.rules[i].shares_heads()}
    for i, name in openers:
        t = traced_name(trace, name)
        units = shared_units(trace, t, tp, shared)
        hint = sharing_hint(trace, t, tp, shared)
        if name in undivided and hint:
            hints[name] = hint
        if name in undivided or t not in trace.spans.openers or units is None or units % tp == 0:
            continue
        if plan.rules[i].shares_heads() and plan.rules[i].hands_dtensors():
            # handed whole to a region's code, whose proof says each rank reads its own head
            # (regions_dtensor.py's one_head_per_rank)
            continue
        features, heads = trace.spans.openers[t], trace.spans.heads.get(t)
        size = features // heads if heads and features % heads == 0 else None
        if _whole_uneven_heads(plan.rules[i], features, units):
            continue  # whole heads split unevenly: each rank's are whole (compile/uneven_heads.py)
        what = f"{heads} heads of {size}" if size else f"{features} features"
        if heads != units:
            what += f", which must stay together in {units} groups"
        said = f"the model views its {features} output features as {what}: tp size {tp} would cut them."
        if trace.spans.groups.get(t) == units:
            said = (
                f"a GroupNorm normalizes its {features} output channels in {units} groups: "
                f"tp size {tp} would cut a group."
            )
        # a head_dim that disagrees with the model's is a problem of its own (widths.py)
        out.append(
            Problem(
                "divisibility",
                rule_label(i, plan.rules[i]),
                name,
                said,
                f"use a tp size among {legal_sizes(units)}, or keep this module replicated{hint}.",
            )
        )
    return out, hints


def _whole_uneven_heads(rule: Rule, features: int, units: int) -> bool:
    """A rule of heads split unevenly whose pieces (or whole features) are whole heads that
    the model's indivisible blocks (`units`, as the trace saw them) never cut: each rank's
    heads are then whole (compile/uneven_heads.py)."""
    head_dim, pieces = rule.head_size(), rule.part_sizes() or [features]
    return (
        rule.uneven_group() is not None
        and head_dim is not None
        and sum(pieces) == features
        and all(p % head_dim == 0 and (p // head_dim) % units == 0 for p in pieces)
    )
