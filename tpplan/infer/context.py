"""What the steps of infer_plan share: `Context`, what they read (the model, its trace, the
tp sizes), and `Decided`, what they write (decisions, and notes for later steps).

Start at api.py's `_decide`, which makes both and calls the steps in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..plan.rule import Rule
from ..trace import Trace, block_structure
from .decision import Attributes, Decisions
from .names import own_params, shared_params

__all__ = ["Context", "Decided"]


@dataclass
class Context:
    """The model, one trace of it and the sizes to decide for; no step changes these."""

    model: nn.Module
    trace: Trace
    tp: int
    """The tp size the regions must divide (2 when infer_plan was given none)."""
    gather_tp: int
    """The tp size a gathered layer's output features must divide (8 when infer_plan was
    given none: such a plan should serve tp 2, 4 and 8)."""
    loss_parallel: bool
    """Leave the output head's logits split over the vocab for a parallel loss."""
    modules: dict[str, nn.Module]
    """Full name -> module ("" is the model)."""
    tied: dict[str, list[str]]
    """Module -> the other modules holding one of its parameters (tied weights)."""
    alike_experts: dict[str, list[str]]
    """Module holding 3-D expert weights -> the modules of its structure (class, parameter
    shapes, submodules), itself included: one forward, so what one shows holds for all."""

    @classmethod
    def of(
        cls, model: nn.Module, trace: Trace, *, tp: int, gather_tp: int, loss_parallel: bool
    ) -> Context:
        modules = dict(model.named_modules())
        alike: dict[str, list[str]] = {}
        groups: dict[Any, list[str]] = {}
        for owner in sorted(trace.experts.exits):
            if owner in modules:
                groups.setdefault(block_structure(modules[owner]), []).append(owner)
        for group in groups.values():
            alike.update(dict.fromkeys(group, group))
        return cls(
            model=model,
            trace=trace,
            tp=tp,
            gather_tp=gather_tp,
            loss_parallel=loss_parallel,
            modules=modules,
            tied=shared_params(model),
            alike_experts=alike,
        )

    def used_outside(self, name: str) -> bool:
        """Whether the forward used a parameter of the module `name` outside its own call."""
        params = own_params(self.modules[name], name)
        return any(
            p in self.trace.params.outside or p in self.trace.params.in_region for p in params
        )


@dataclass
class Decided:
    """What the steps decided so far, and the notes they leave for later steps."""

    decisions: Decisions = field(default_factory=dict)
    """Full module name -> its decision."""
    attributes: Attributes = field(default_factory=dict)
    """Module -> the integer attributes a plan divides, and why."""
    kept: dict[str, str] = field(default_factory=dict)
    """Linear or Embedding -> why it stays whole; `decide_rest` turns it into a decision
    (or splits the layer's weight anyway, its output gathered)."""
    kept_experts: dict[str, str] = field(default_factory=dict)
    """Module holding 3-D expert weights -> why it stays whole."""
    routers: dict[str, Rule | None] = field(default_factory=dict)
    """Router kept whole -> its weight split with its output gathered, where it may be: what
    sequence parallel gives it instead (a whole router would meet the sequence-split stream
    as a plain weight)."""
    split_regions: list[tuple[list[str], list[str]]] = field(default_factory=list)
    """(openers, closers) of each region split; sequence parallel gathers their inputs."""
