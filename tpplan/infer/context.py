"""What the steps of infer_plan share: `Context`, what they read (the model, its trace, the
tp sizes); `Decided`, what the steps before decided; and `Found`, what a step hands back.

Start at api.py's `_decide`, which makes the context, calls the steps in order and merges
what each found into what was decided (`Decided.merge`, where the precedence is).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..plan.rule import Rule
from ..trace import Trace, block_structure
from .decision import Attributes, Decisions
from .names import own_params, shared_params

__all__ = ["Context", "Decided", "Found"]


@dataclass
class Context:
    """The model, one trace of it and the sizes to decide for; no step changes these."""

    model: nn.Module
    trace: Trace
    tp: int
    """The tp size the spans must divide (2 when infer_plan was given none)."""
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
    sequence_parallel: bool = False
    """The stream between spans is to be split over the sequence (infer_plan's option)."""
    split_unevenly: bool = True
    """Heads tp does not divide may split unevenly (infer_plan's option)."""

    @classmethod
    def of(
        cls,
        model: nn.Module,
        trace: Trace,
        *,
        tp: int,
        gather_tp: int,
        loss_parallel: bool,
        sequence_parallel: bool = False,
        split_unevenly: bool = True,
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
            sequence_parallel=sequence_parallel,
            split_unevenly=split_unevenly,
        )

    def used_outside(self, name: str) -> bool:
        """Whether the forward used a parameter of the module `name` outside its own call."""
        params = own_params(self.modules[name], name)
        return any(p in self.trace.params.outside or p in self.trace.params.in_span for p in params)


@dataclass
class Found:
    """What one step decided, handed back to the driver (api.py's `_decide`), which merges it
    into what the steps before it decided (`Decided.merge`). A step fills one of these and
    reads the earlier steps' `Decided`; it changes neither."""

    rules: Decisions = field(default_factory=dict)
    """Full module name -> the rule this step decided for it."""
    withdrawn: set[str] = field(default_factory=set)
    """Modules whose rule, decided by an earlier step, no longer stands."""
    attributes: Attributes = field(default_factory=dict)
    """Module -> the integer attributes a plan divides, and why (all of that module's)."""
    attributes_withdrawn: set[str] = field(default_factory=set)
    """Modules whose divided attributes no longer stand."""
    kept: dict[str, str] = field(default_factory=dict)
    """Linear or Embedding -> why it stays whole; `decide_rest` turns it into a rule (or
    splits the layer's weight anyway, its output gathered)."""
    unkept: set[str] = field(default_factory=set)
    """Layers an earlier step kept whole that this one split after all."""
    kept_experts: dict[str, str] = field(default_factory=dict)
    """Module holding 3-D expert weights -> why it stays whole."""
    routers: dict[str, Rule | None] = field(default_factory=dict)
    """Router kept whole -> its weight split with its output gathered, where it may be: what
    sequence parallel gives it instead (a whole router would meet the sequence-split stream
    as a plain weight)."""
    split_spans: list[tuple[list[str], list[str]]] = field(default_factory=list)
    """(openers, closers) of each span split; sequence parallel gathers their inputs."""


@dataclass(frozen=True)
class Decided:
    """What the steps decided so far: each step reads it and hands back a `Found`, which
    `merge` adds to it. The one precedence: a later step's word on a module replaces an
    earlier step's (the steps run in the order api.py's `_decide` lists them, each deciding
    only what it has the evidence for)."""

    decisions: Decisions = field(default_factory=dict)
    """Full module name -> its rule."""
    attributes: Attributes = field(default_factory=dict)
    """Module -> the integer attributes a plan divides, and why."""
    kept: dict[str, str] = field(default_factory=dict)
    """Linear or Embedding -> why it stays whole (`Found.kept`)."""
    kept_experts: dict[str, str] = field(default_factory=dict)
    """Module holding 3-D expert weights -> why it stays whole."""
    routers: dict[str, Rule | None] = field(default_factory=dict)
    """Router kept whole -> what sequence parallel gives it (`Found.routers`)."""
    split_spans: tuple[tuple[list[str], list[str]], ...] = ()
    """(openers, closers) of each span split, in the order they were decided."""

    def merge(self, found: Found) -> Decided:
        """What was decided, with `found` (one step's word) over it."""

        def over(before: dict[str, Any], new: dict[str, Any], gone: set[str]) -> dict[str, Any]:
            out = {k: v for k, v in before.items() if k not in gone}
            out.update(new)
            return out

        return Decided(
            decisions=over(self.decisions, found.rules, found.withdrawn),
            attributes=over(self.attributes, found.attributes, found.attributes_withdrawn),
            kept=over(self.kept, found.kept, found.unkept),
            kept_experts=over(self.kept_experts, found.kept_experts, set()),
            routers=over(self.routers, found.routers, set()),
            split_spans=(*self.split_spans, *found.split_spans),
        )
