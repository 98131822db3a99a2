"""The plan's attribute fixes (`attributes`: integer attributes divided by tp on matched
modules): each pattern matches a module, each attribute is an integer tp divides
(`check_attributes`, from the modules alone), and each is a count the traced forward's views
read to cut the split features (`check_divided`, which flow.py calls on each trace).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..compile.shard import attribute_divisor, attribute_value, own_attributes
from ..errors import Problem, TpplanError, did_you_mean
from ..plan.patterns import collapse, match_names
from ..plan.schema import AttributeRule, Plan
from ..trace.counted import values_read
from .shared import Match, attribute_label, legal_sizes, rule_label, traced_name

if TYPE_CHECKING:
    from ..trace import Trace

__all__ = ["check_attributes", "check_divided"]


def check_attributes(
    plan: Plan, names: list[str], modules: dict[str, nn.Module], tp: int
) -> list[Problem]:
    """Entry by entry: a pattern that matches nothing, then each attribute of each module it
    matches that is no integer or does not divide by tp."""
    out: list[Problem] = []
    for i, rule in enumerate(plan.attributes):
        where = attribute_label(i, rule)
        hits = match_names(rule.match, names)
        if not hits:
            out.append(
                Problem(
                    "no_match",
                    where,
                    None,
                    f"the pattern matches no module of the model.{did_you_mean(rule.match, collapse(names, names))}",
                    "correct the pattern or delete the entry.",
                )
            )
        for name in hits:
            if rule.uneven is not None:
                out += _check_uneven(plan, modules, rule, where, name, tp)
                continue
            try:
                by = attribute_divisor(plan, modules[""], rule, name, tp)
            except TpplanError as e:
                out.append(Problem("attribute", where, name, str(e), "see the message."))
                continue
            if by == 0:
                # the heads of `of` neither split over tp nor share ranks evenly at it: the
                # colwise rule that splits them has that problem already, told once there
                continue
            for attr in rule.divide:
                found = _check_attribute(where, name, modules[name], attr, by, rule.of, tp)
                if found is not None:
                    out.append(found)
    return out


def _check_uneven(
    plan: Plan,
    modules: dict[str, nn.Module],
    rule: AttributeRule,
    where: str,
    name: str,
    tp: int,
) -> list[Problem]:
    """Each rank's own value of every attribute an `uneven` rule names is a whole number
    (compile/shard.py's `own_attributes`)."""
    out: list[Problem] = []
    for attr in rule.divide:
        # an integer (divided by 1: no other problem)
        found = _check_attribute(where, name, modules[name], attr, 1)
        if found is not None:
            out.append(found)
            continue
        try:
            own_attributes(
                plan, modules[""], rule, name, attr, tp, attribute_value(modules[name], attr)
            )
        except TpplanError as e:
            out.append(Problem("attribute", where, name, str(e), "see the message."))
            break
    return out


def _check_attribute(
    where: str,
    name: str,
    module: nn.Module,
    attr: str,
    tp: int,
    of: str | None = None,
    tp_size: int = 0,
) -> Problem | None:
    """`tp` is what the attribute is divided by: the tp size, or with `of` the replicas or
    shards of that layer's heads at `tp_size`."""
    value = attribute_value(module, attr)
    if isinstance(value, bool) or not isinstance(value, int):
        return Problem(
            "attribute",
            where,
            name,
            f"the module has no integer attribute '{attr}' (found {value!r}).",
            "name an integer attribute the module's forward reads.",
        )
    if value % tp:
        return Problem(
            "divisibility",
            where,
            name,
            f"{attr} = {value} does not divide by tp size {tp}."
            if of is None
            else f"{attr} = {value} does not divide by {tp}, the ranks sharing each head of "
            f"{of} at tp size {tp_size}.",
            f"use a tp size among {legal_sizes(value)}."
            if of is None
            else "use a tp size that divides the query heads.",
        )
    return None


def check_divided(
    plan: Plan, openers: list[Match], divided: list[Match], trace: Trace
) -> list[Problem]:
    """An attribute a plan divides must be a count the model's views read to cut the split
    features, as the trace saw them (what infer divides); divided, any other size its
    forward reads (head_dim, a width) shrinks what every rank keeps whole. Judged only where
    the trace followed every split the plan opens to its end (a split it lost may have
    read counts it did not see); the dry run speaks for the rest.

    `divided` pairs index plan.attributes, not plan.rules."""
    if any(traced_name(trace, n) in trace.spans.broken for _, n in openers):
        return []
    out = _groups_undivided(plan, openers, divided, trace)
    counts = [*trace.reads.counts.values(), *trace.experts.counts.values()]
    legal = {(m, a) for found in counts for m, a, _ in found}
    # the counts that repeat shared key/value heads to their query heads (by: replicas)
    legal |= {read[:2] for _, read in trace.spans.repeats.values() if read is not None}
    # the terms of fused cut sizes computed from the width read off the output, which shared
    # key/value heads divide by their replicas (infer/shared_heads.py's `_width_cuts`)
    widths = {r for expr, *_ in trace.reads.width_cuts.values() for r in values_read(expr)}
    # the head count of a fused cut written as a product (`self.n_kv * self.head_dim`): the
    # factor no view keeps whole (infer/spans.py's `_product_counts`)
    legal |= {
        f[:2]
        for terms in trace.reads.products.values()
        for term in terms
        for f in term
        if f[:2] not in trace.reads.beside_sizes
    }
    for i, name in divided:
        rule, t = plan.attributes[i], traced_name(trace, name)
        for attr in rule.divide:
            if (t, attr) in legal or (t, attr) not in trace.reads.ints:
                continue
            if rule.by == "replicas" and (t, attr) in widths:
                continue
            read = sorted(a for m, a in legal if m == t)
            views = (
                f"its views read {', '.join(read)} for that"
                if read
                else "its views read no count for that (they size the split with -1 or off the tensor)"
            )
            out.append(
                Problem(
                    "attribute",
                    attribute_label(i, rule),
                    name,
                    f"its forward reads {attr}, but not as a count of the split features' "
                    f"heads: {views}. Divided, {attr} would shrink a size every rank keeps whole.",
                    f"remove {attr} from divide (the attributes `tpplan infer` writes are the "
                    "ones to divide).",
                )
            )
    return out


def _groups_undivided(
    plan: Plan, openers: list[Match], divided: list[Match], trace: Trace
) -> list[Problem]:
    """A GroupNorm over channels a rule splits must have its group count divided: left
    whole, each rank normalizes its share of the channels in as many groups as the whole
    had, groups of the wrong size, and nothing fails (a view of heads left undivided fails
    its shape in the dry run; this does not)."""
    done = {(n, a) for i, n in divided for a in plan.attributes[i].divide}
    out: list[Problem] = []
    told: set[tuple[str, str]] = set()
    for i, name in openers:
        t = traced_name(trace, name)
        for module, attr, value in sorted(trace.reads.counts.get(t, ())):
            if trace.reads.groups.get((module, attr)) != "norm":
                continue
            real = _untraced(trace, name, module)
            if (real, attr) in done or (real, attr) in told:
                continue
            told.add((real, attr))
            out.append(
                Problem(
                    "attribute",
                    rule_label(i, plan.rules[i]),
                    name,
                    f"{real} normalizes the channels this rule splits in {attr} = {value} "
                    f"groups (a group norm), and no entry of attributes divides {attr}: "
                    "each rank would normalize its share of the channels in groups of the "
                    "wrong size, without an error.",
                    f"add an entry to attributes: match: {real}, divide: [{attr}].",
                )
            )
    return out


def _untraced(trace: Trace, name: str, module: str) -> str:
    """`module`, a name in the trace, as the module of the block `name` is in: the reverse of
    `traced_name`, where the trace stands a block it left out by the traced block it copies."""
    for block, copied in trace.stacks.untraced.items():
        inside = name == block or name.startswith(block + ".")
        if inside and (module == copied or module.startswith(copied + ".")):
            return block + module[len(copied) :]
    return module
