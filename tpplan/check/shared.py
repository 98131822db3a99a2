"""What the checks of check/ share: how a Problem names the rule it is about, which rule
treats each module, the tp sizes that divide a size, which rules open and close a region,
and where a module of an untraced repeated block is found in a trace. Start at
`rule_label`.

The words are the tracer's (tpplan/trace/record.py): an opener is a layer whose output
features are split (colwise, its output left sharded), a closer one whose input arrives
split on the dim it contracts (rowwise, its input taken sharded), and a region is the
openers and closers that hand split tensors to each other, sharded as one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..plan.patterns import match_names
from ..plan.schema import AttributeRule, Plan, Rule

if TYPE_CHECKING:
    from ..trace import Trace

__all__ = [
    "Match",
    "attribute_label",
    "legal_sizes",
    "rule_label",
    "rules_by_module",
    "traced_name",
]

Match = tuple[int, str]
"""(index of a rule, name of a module its pattern matches)."""


def rule_label(i: int, rule: Rule) -> str:
    """How every Problem names a rule: `rules[i] (match: pattern)`."""
    return f"rules[{i}] (match: {rule.match})"


def attribute_label(i: int, rule: AttributeRule) -> str:
    """How every Problem names an attribute fix: `attributes[i] (match: pattern)`."""
    return f"attributes[{i}] (match: {rule.match})"


def legal_sizes(n: int) -> str:
    """The tp sizes up to 64 (what machines offer) that divide n."""
    return ", ".join(str(d) for d in range(1, min(n, 64) + 1) if n % d == 0)


def traced_name(trace: Trace, name: str) -> str:
    """The name under which the trace knows a module: a long stack of identical blocks is
    traced through its first blocks, and a module of a block left out is checked through the
    module of the traced block it copies (`trace.stacks.untraced`)."""
    for block, copied in trace.stacks.untraced.items():
        if name == block or name.startswith(block + "."):
            return copied + name[len(block) :]
    return name


def rules_by_module(
    plan: Plan, names: list[str]
) -> tuple[dict[str, tuple[str, Rule | None]], dict[str, tuple[str, Rule | None]]]:
    """({module: (rule label, rule)}, {module: (attribute rule label, None)}): the first
    rule and the first attribute fix that match each module."""
    styled: dict[str, tuple[str, Rule | None]] = {}
    for i, rule in enumerate(plan.rules):
        for name in match_names(rule.match, names):
            styled.setdefault(name, (rule_label(i, rule), rule))
    divided: dict[str, tuple[str, Rule | None]] = {}
    for i, attrs in enumerate(plan.attributes):
        for name in match_names(attrs.match, names):
            divided.setdefault(name, (attribute_label(i, attrs), None))
    return styled, divided
