"""diff_plans: what changes between two plans, semantically.

With a model, both plans are expanded to the modules they reach, so a renamed pattern that
means the same thing is no change; without one, rules are compared by pattern. Nothing here
imports torch. Start at `diff_plans`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .patterns import collapse, match_names
from .schema import Plan, Rule

__all__ = ["Change", "diff_plans"]

_IGNORED = {"match", "why"}  # the reason may be reworded; it does not change the sharding


@dataclass(frozen=True)
class Change:
    """One module (or pattern) whose treatment differs between plan A and plan B."""

    where: str
    before: str | None
    after: str | None

    def __str__(self) -> str:
        if self.before is None:
            return f"+ {self.where}: {self.after}"
        if self.after is None:
            return f"- {self.where}: {self.before}"
        return f"~ {self.where}: {self.before} -> {self.after}"


def _describe(rule: Rule) -> str:
    fields = rule.model_dump(exclude_none=True, exclude=_IGNORED)
    style = fields.pop("style")
    extra = ", ".join(f"{k}={v}" for k, v in fields.items())
    return f"{style} ({extra})" if extra else style


def _by_module(plan: Plan, names: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for rule in plan.rules:
        for name in match_names(rule.match, names):
            out.setdefault(name, _describe(rule))
    return out


def _options(a: Plan, b: Plan) -> list[Change]:
    da, db = a.options.model_dump(), b.options.model_dump()
    return [
        Change(f"options.{k}", str(da[k]).lower(), str(db[k]).lower()) for k in da if da[k] != db[k]
    ]


def diff_plans(a: Plan, b: Plan, *, module_names: Sequence[str] | None = None) -> list[Change]:
    """Changes from plan `a` to plan `b`; empty when they shard the same way.

    `module_names` (a model's `named_modules()` names) compares module by module; a module
    no rule matches counts as replicated.
    """
    changes = _options(a, b)
    if module_names is None:
        ra = {r.match: _describe(r) for r in a.rules}
        rb = {r.match: _describe(r) for r in b.rules}
        for k in ra.keys() | rb.keys():
            if ra.get(k) != rb.get(k):
                changes.append(Change(k, ra.get(k), rb.get(k)))
        return sorted(changes, key=lambda c: c.where)
    names = [n for n in module_names if n]
    ma, mb = _by_module(a, names), _by_module(b, names)
    groups: dict[tuple[Any, Any], list[str]] = {}
    for n in names:
        before, after = ma.get(n, "replicate"), mb.get(n, "replicate")
        if before != after:
            groups.setdefault((before, after), []).append(n)
    for (before, after), members in groups.items():
        changes.extend(Change(p, before, after) for p in collapse(members, names))
    return changes
