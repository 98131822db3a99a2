"""How a step of infer_plan states one module's rule: `decided(StyleRule, why, ...)`, an
instance of the style's own class (plan/styles/) whose pattern api.py writes later.

Every step gives rules by full module name (`Decisions`); api.py groups equal ones and
writes each group's compact pattern in place of `UNPLACED`. `Attributes` holds the module
attributes a plan divides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from ..plan.rule import Rule

__all__ = [
    "NOT_CALLED",
    "UNPLACED",
    "Attributes",
    "Decisions",
    "Divided",
    "decided",
    "placed",
    "reasoned",
]

NOT_CALLED = "kept whole: it was not called in the traced forward"

UNPLACED = "<the module it was decided for>"
"""The pattern of a rule decided for one module, until api.py groups the modules that
decided alike and writes their pattern (no module name can hold spaces)."""

_R = TypeVar("_R", bound=Rule)

# full module name -> the rule decided for it (its pattern UNPLACED)
Decisions = dict[str, Rule]


def decided(style: type[_R], why: str, **fields: Any) -> _R:
    """One module's rule of the class `style`, its style named as a plan file names it; a
    field given None is left out (not set), so the plan states only what was decided and
    needs no newer schema than that."""
    given = {k: v for k, v in fields.items() if v is not None}
    return style(match=UNPLACED, style=style.model_fields["style"].default, why=why, **given)


def reasoned(rule: _R, why: str, **fields: Any) -> _R:
    """`rule` with another `why` (and the fields given changed), the rest as decided."""
    return rule.model_copy(update={"why": why, **fields})


def placed(rule: Rule, match: str) -> Rule:
    """`rule` under the pattern `match`, for the plan."""
    return rule.model_copy(update={"match": match})


@dataclass(frozen=True)
class Divided:
    """Integer attributes of one module a plan divides, by one divisor, and why (an
    attribute rule less its pattern)."""

    attrs: tuple[str, ...]
    why: str
    by: str | None = None
    """None: the tp size; "replicas" or "shards": of the heads of the layer `of`."""
    of: str | None = None
    uneven: str | None = None
    """The query layer whose heads split unevenly: each rank its own value."""


# module -> what its plan divides, one entry per divisor
Attributes = dict[str, tuple[Divided, ...]]
