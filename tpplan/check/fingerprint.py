"""The plan's fingerprint checked against the model: a plan written for one model (its
`model.fingerprint`) is refused for another, saying which parameters differ. Start at
`check_fingerprint`.
"""

from __future__ import annotations

from torch import nn

from .._runtime.facts import describe_mismatch, fingerprint
from ..errors import Problem
from ..plan.schema import Plan

__all__ = ["check_fingerprint"]


def check_fingerprint(plan: Plan, model: nn.Module) -> list[Problem]:
    """The problem of a plan whose fingerprint (or class) is not the model's; none for a
    plan without a fingerprint, which serves any model whose module names match."""
    info = plan.model
    if info is None or info.fingerprint is None:
        return []
    now = fingerprint(model)
    if now == info.fingerprint and info.class_ == type(model).__name__:
        return []
    cls = (
        f" It was written for {info.class_}, this is {type(model).__name__}."
        if info.class_ != type(model).__name__
        else ""
    )
    return [
        Problem(
            "fingerprint",
            "model",
            None,
            f"the plan was written for another model (fingerprint {info.fingerprint}, this model "
            f"has {now}).{cls} What differs: {describe_mismatch(info.parameters, model)}.",
            "regenerate the plan with `tpplan infer`, or delete model.fingerprint to use the "
            "plan for any model whose module names match.",
        )
    ]
