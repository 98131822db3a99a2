"""Reading a plan against a model: which rule each module gets (`expand_rules`, `rule_for`,
`styles`), and the hand-written plan of the tiny Llama (`LLAMA_PLAN`)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

import tpplan
from tpplan.plan import Plan
from tpplan.plan.patterns import match_names

__all__ = ["LLAMA_PLAN", "expand_rules", "rule_for", "styles"]

# written by hand for support/models.py's tiny_llama (and TINY_LLAMA_CONFIG)
LLAMA_PLAN = Path(__file__).parents[1] / "plans" / "llama.yaml"


def expand_rules(plan: Plan, model: nn.Module) -> dict[str, tpplan.Rule]:
    """{module name: its rule}, every pattern expanded (a later rule wins, as in apply)."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, tpplan.Rule] = {}
    for rule in plan.rules:
        for n in match_names(rule.match, names):
            out[n] = rule
    return out


def styles(
    plan: Plan, model: nn.Module, *, sharded_only: bool = True
) -> dict[str, tuple[str, str | None]]:
    """{module name: (style, output layout)} with every rule expanded."""
    names = [n for n, _ in model.named_modules() if n]
    out = {}
    for rule in plan.rules:
        if sharded_only and rule.style == "replicate":
            continue
        for n in match_names(rule.match, names):
            out[n] = (rule.style, getattr(rule, "output", None))
    return out


def rule_for(plan: Plan, model: nn.Module, name: str) -> tpplan.Rule:
    """The one rule whose pattern matches the module `name`."""
    names = [n for n, _ in model.named_modules() if n]
    (rule,) = [r for r in plan.rules if name in match_names(r.match, names)]
    return rule
