"""Plan rules -> torch ParallelStyle objects, plus the one style torch lacks.

`plan_to_torch` is what `Plan.to_torch` calls. Every style maps onto torch's own
(ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput/Output) except
`replicate_grad_sum`, implemented here as `ReplicateGradSum`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DeviceMesh, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from ._patterns import match_names
from .plan import parse_layout

if TYPE_CHECKING:
    from .plan import Plan, Rule

__all__ = ["ReplicateGradSum", "placement", "plan_to_torch", "rule_to_style"]


def placement(layout: str | None) -> Placement | None:
    """The DTensor placement a layout string names (None stays None)."""
    if layout is None:
        return None
    kind, dim = parse_layout(layout)
    if kind == "shard":
        assert dim is not None  # parse_layout always returns a dim for shard
        return Shard(dim)
    return Replicate() if kind == "replicate" else Partial()


def _placements(layouts: list[str | None] | None) -> tuple[Placement | None, ...] | None:
    return None if layouts is None else tuple(placement(x) for x in layouts)


class ReplicateGradSum(ParallelStyle):
    """Parameters kept whole on every rank, used inside a sharded region.

    Each rank sees only its own shard of the activations, so its gradient for such a
    parameter (a per-head q/k norm weight, say) is a partial sum; summing the gradients
    over the tp axis gives every rank the full gradient, so replicas never drift apart.
    The forward pass is untouched.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh

        def _sum(grad: Any) -> Any:
            return funcol.wait_tensor(funcol.all_reduce(grad, "sum", group))

        for p in module.parameters(recurse=False):
            if p.requires_grad:
                p.register_hook(_sum)
        return module

    def __repr__(self) -> str:
        return "ReplicateGradSum()"


def rule_to_style(rule: Rule) -> ParallelStyle | None:
    """The style object for one rule; None for `replicate` (the module is left alone)."""
    kw: dict[str, Any] = {}
    if rule.local_output is not None:
        kw["use_local_output"] = rule.local_output
    if rule.style in ("colwise", "rowwise", "vocab_parallel"):
        if rule.input is not None:
            kw["input_layouts"] = placement(rule.input)
        elif rule.style == "vocab_parallel":
            kw["input_layouts"] = Replicate()
        if rule.output is not None:
            kw["output_layouts"] = placement(rule.output)
        return ColwiseParallel(**kw) if rule.style == "colwise" else RowwiseParallel(**kw)
    if rule.style == "sequence_parallel":
        _, dim = parse_layout(rule.input or "shard(1)")
        return SequenceParallel(sequence_dim=dim if dim is not None else 1, **kw)
    if rule.style == "prepare":
        return _prepare(rule)
    if rule.style == "replicate_grad_sum":
        return ReplicateGradSum()
    return None  # replicate


def _prepare(rule: Rule) -> ParallelStyle:
    has_in = any(
        x is not None
        for x in (rule.inputs, rule.desired_inputs, rule.input_kwargs, rule.desired_input_kwargs)
    )
    has_out = rule.outputs is not None or rule.desired_outputs is not None
    ins: dict[str, Any] = {
        "input_layouts": _placements(rule.inputs),
        "desired_input_layouts": _placements(rule.desired_inputs),
        "input_kwarg_layouts": {k: placement(v) for k, v in (rule.input_kwargs or {}).items()}
        or None,
        "desired_input_kwarg_layouts": {
            k: placement(v) for k, v in (rule.desired_input_kwargs or {}).items()
        }
        or None,
    }
    outs: dict[str, Any] = {
        "output_layouts": _placements(rule.outputs),
        "desired_output_layouts": _placements(rule.desired_outputs),
    }
    local_out: dict[str, Any] = (
        {} if rule.local_output is None else {"use_local_output": rule.local_output}
    )
    if has_in and has_out:
        local_in: dict[str, Any] = (
            {} if rule.local_input is None else {"use_local_input": rule.local_input}
        )
        return PrepareModuleInputOutput(**ins, **outs, **local_in, **local_out)
    if has_out:
        return PrepareModuleOutput(**outs, **local_out)
    local_in_only: dict[str, Any] = (
        {} if rule.local_input is None else {"use_local_output": rule.local_input}
    )
    return PrepareModuleInput(**ins, **local_in_only)


def plan_to_torch(plan: Plan, model: nn.Module) -> dict[str, ParallelStyle]:
    """{full module name: style} in the model's module order, every rule expanded."""
    names = [n for n, _ in model.named_modules() if n]
    by_name: dict[str, ParallelStyle] = {}
    for rule in plan.rules:
        style = rule_to_style(rule)
        if style is None:
            continue
        for name in match_names(rule.match, names):
            by_name[name] = style
    return {n: by_name[n] for n in names if n in by_name}
