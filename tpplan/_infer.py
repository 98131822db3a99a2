"""infer_plan: placeholder until the tracer lands (issue: Tracer)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .plan import Plan

__all__ = ["infer_plan"]


def infer_plan(model: nn.Module, *, tp_size: int | None = None, example_inputs: Any = None) -> Plan:
    """Infer a plan from the model's data flow (not implemented yet)."""
    raise NotImplementedError(
        "tpplan cannot infer plans yet; pass a plan: apply_plan(model, mesh, plan='plan.yaml')."
    )
