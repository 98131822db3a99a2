"""Plan rules -> torch ParallelStyle objects, plus what torch lacks.

`plan_to_torch` is what `Plan.to_torch` calls. Every style maps onto torch's own
(ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput/Output) except three
cases built here on the same classes:
- `replicate_grad_sum`: `ReplicateGradSum`;
- fused colwise layers (`parts`): `Colwise` stores each part's rank-r slice next to the
  others', so a rank's output is its own q, k and v (or gate and up) laid end to end;
- weights stored (in, out) (`transposed`, GPT-2's Conv1D): `Colwise` / `Rowwise` shard the
  other dim of the weight.

A fused parameter is a DTensor `Shard(dim)` of the weight with its rows (columns, when
transposed) reordered rank by rank; `fused_layouts` says which, and `unfuse` turns a gathered
tensor back into the original order (checkpoints use both).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
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

__all__ = [
    "Colwise",
    "ReplicateGradSum",
    "Rowwise",
    "fused_layouts",
    "fused_order",
    "placement",
    "plan_to_torch",
    "rule_to_style",
    "unfuse",
]


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


# ---- fused and transposed weights -----------------------------------------------------------
# On a module with fused parameters: {parameter name: (dim, parts, tp)}. Kept on the module,
# not the parameter, because module.to_empty() and friends replace parameters.
_FUSED = "_tpplan_fused"


def fused_order(parts: list[int] | tuple[int, ...], tp: int) -> list[int]:
    """Indices that put rank 0's slice of every part first, then rank 1's, and so on: a
    contiguous Shard of the reordered dim gives each rank its own slice of each part."""
    out: list[int] = []
    for r in range(tp):
        start = 0
        for size in parts:
            step = size // tp
            out.extend(range(start + r * step, start + (r + 1) * step))
            start += size
    return out


def fused_layouts(model: nn.Module) -> dict[str, tuple[int, tuple[int, ...], int]]:
    """{parameter name: (dim, parts, tp)} for every parameter a fused colwise style reordered
    (names as in model.named_parameters() and state_dict())."""
    out = {}
    for prefix, module in model.named_modules():
        for name, layout in module.__dict__.get(_FUSED, {}).items():
            out[f"{prefix}.{name}" if prefix else name] = layout
    return out


def unfuse(whole: torch.Tensor, layout: tuple[int, tuple[int, ...], int]) -> torch.Tensor:
    """A gathered fused tensor back in the original order of its parts."""
    dim, parts, tp = layout
    order = torch.tensor(fused_order(parts, tp), device=whole.device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=whole.device)
    return whole.index_select(dim, inverse)


def _distribute(
    module: nn.Module,
    name: str,
    mesh: DeviceMesh,
    dim: int,
    parts: tuple[int, ...] | None,
    src_data_rank: int | None,
) -> None:
    param = getattr(module, name)
    tp = mesh.size()
    data = param
    if parts is not None:
        index = torch.tensor(fused_order(parts, tp), device=param.device)
        data = param.detach().index_select(dim, index)
    new = nn.Parameter(
        distribute_tensor(data, mesh, [Shard(dim)], src_data_rank=src_data_rank),
        param.requires_grad,
    )
    if parts is not None:
        module.__dict__.setdefault(_FUSED, {})[name] = (dim, parts, tp)
    module.register_parameter(name, new)


def _output(
    layouts: tuple[Placement, ...],
    local: bool,
    parts: tuple[int, ...] | None,
    mod: nn.Module,
    out: DTensor,
    mesh: DeviceMesh,
) -> Any:
    if out.placements != layouts:
        out = out.redistribute(placements=layouts)
    if parts is not None and isinstance(layouts[0], Replicate):
        # gathered rank by rank: put the parts back in the order the model expects
        dim = out.dim() - 1
        whole = unfuse(out.to_local(), (dim, parts, mesh.size()))
        return whole if local else DTensor.from_local(whole, mesh, layouts, run_check=False)
    return out.to_local() if local else out


class Colwise(ColwiseParallel):
    """ColwiseParallel for fused layers (`parts`) and (in, out) weights (`transposed`).

    The output is split over its last dim like torch's: with parts, rank r's output holds
    rank r's slice of each part in order, which is what a model splitting the output into
    parts by sizes divided per rank (or into equal chunks) expects.
    """

    def __init__(
        self, *, parts: list[int] | None = None, transposed: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.parts = tuple(parts) if parts else None
        self.transposed = transposed

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        src = self.src_data_rank
        _distribute(module, "weight", mesh, 1 if self.transposed else 0, self.parts, src)
        if getattr(module, "bias", None) is not None:
            _distribute(module, "bias", mesh, 0, self.parts, src)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(_output, self.output_layouts, self.use_local_output, self.parts),
        )

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, parts={self.parts}, transposed={self.transposed})"


class Rowwise(RowwiseParallel):
    """RowwiseParallel for Linear-like layers, also with weights stored (in, out) (their dim
    0 is contracted), whose local output may be changed in place.

    torch hands back the local output of a DTensor through an autograd Function that returns
    it as a view, and autograd forbids changing such a view in place: a model that adds a
    residual in place (Falcon's `mlp_output += attention_output`) cannot train. While grad
    is recorded the output is handed back as its own tensor (one copy, beside the all-reduce
    that made it).
    """

    def __init__(self, *, transposed: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.transposed = transposed

    def _partition_linear_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _distribute(module, "weight", mesh, 0 if self.transposed else 1, None, self.src_data_rank)
        bias = getattr(module, "bias", None)
        if isinstance(bias, nn.Parameter):
            replicated = distribute_tensor(
                bias, mesh, [Replicate()], src_data_rank=self.src_data_rank
            )
            module.register_parameter("bias", nn.Parameter(replicated, bias.requires_grad))

    @staticmethod
    def _own_output(layouts: Any, local: bool, mod: nn.Module, out: DTensor, mesh: Any) -> Any:
        out = RowwiseParallel._prepare_output_fn(layouts, local, mod, out, mesh)
        return out.clone() if local and torch.is_grad_enabled() else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._own_output, self.output_layouts, self.use_local_output),
        )


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
        if rule.style == "colwise" and (rule.parts or rule.transposed):
            return Colwise(parts=rule.parts, transposed=bool(rule.transposed), **kw)
        if rule.style == "rowwise":
            return Rowwise(transposed=bool(rule.transposed), **kw)
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
