"""Splitting one parameter in place, and the two styles that only split or sum parameters.

Start at `split_param`, which every style of tpplan's uses to make a parameter a DTensor
whose full tensor is the original one (a fused weight of equal parts as a `_StridedShard`,
see strided.py). Then the styles for parameters a module uses outside any Linear-like
layer, inside a region the colwise layers around it split:
- `ReplicateGradSum` (`replicate_grad_sum`): kept whole, its gradient summed over the ranks;
- `SplitParams` (`split_params`): split, each rank's forward using its own part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from .._runtime.torch_compat import funcol_all_reduce, funcol_wait_tensor
from .strided import equal_parts, shard_step, split_parts, teach_checkpoint_chunks

__all__ = [
    "ReplicateGradSum",
    "SplitParams",
    "changeable",
    "local_during_calls",
    "own_start",
    "split_param",
]


def changeable(t: torch.Tensor) -> torch.Tensor:
    """A local output handed back as its own tensor while grad is recorded: torch hands back
    a DTensor's local tensor as a view through an autograd Function, and autograd forbids
    changing such a view in place, so a model that adds a residual in place (Falcon's
    `mlp_output += attention_output`) could not train. One copy, beside the collective that
    made the output."""
    return t.clone() if torch.is_grad_enabled() else t


def own_start(n: int, mesh: DeviceMesh, device: torch.device) -> torch.Tensor:
    """Where this rank's share of `n` entries split by `Shard` starts (a 1-element tensor;
    each rank's own without a collective, also on simulated ranks)."""
    step = shard_step(n, mesh.size())
    starts = torch.arange(mesh.size(), device=device) * step
    return distribute_tensor(starts, mesh, [Shard(0)], src_data_rank=None).to_local()


def split_param(
    module: nn.Module,
    name: str,
    mesh: DeviceMesh,
    dim: int,
    parts: tuple[int, ...] | None,
    src_data_rank: int | None,
) -> None:
    """Split the parameter (or buffer) `name` of `module` (dotted for a child's) along
    `dim`; with equal fused `parts`, as each rank's slice of each part (a `_StridedShard`,
    see strided.py), with unequal ones as a plain Shard. Either way the parameter's full tensor is the
    original one, so state dicts and checkpoints see the unsharded model's layout."""
    path, _, name = name.rpartition(".")
    module = module.get_submodule(path)
    param = getattr(module, name)
    if parts is not None and equal_parts(parts):
        teach_checkpoint_chunks()
        data = split_parts(param, mesh, dim, parts, src_data_rank)
    else:
        data = distribute_tensor(param, mesh, [Shard(dim)], src_data_rank=src_data_rank)
    if name in module._buffers:
        # a BatchNorm's running statistics: split with the channels, still a buffer (and
        # persistent as it was), so the state dict sees it whole
        persistent = name not in module._non_persistent_buffers_set
        module.register_buffer(name, data, persistent=persistent)
        return
    module.register_parameter(name, nn.Parameter(data, param.requires_grad))


class ReplicateGradSum(ParallelStyle):
    """Parameters kept whole on every rank, used inside a sharded region.

    Each rank sees only its own shard of the activations, so its gradient for such a
    parameter (a per-head q/k norm weight, say) is a partial sum; summing the gradients
    over the tp axis gives every rank the full gradient, so replicas never drift apart.
    The forward pass is untouched, and the parameters stay plain tensors.

    Example::
        >>> parallelize_module(attn, mesh, {"q_norm": ReplicateGradSum()})
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh

        def _sum(grad: Any) -> Any:
            return funcol_wait_tensor(funcol_all_reduce(grad, "sum", group))

        for p in module.parameters(recurse=False):
            if p.requires_grad:
                p.register_hook(_sum)
        return module

    def __repr__(self) -> str:
        return "ReplicateGradSum()"


class SplitParams(ParallelStyle):
    """Parameters of the module itself split along a dim, and used in its forward as each
    rank's own part: a per-head attention sink, met element by element by the heads the
    colwise layers around split, so rank r needs exactly its heads' entries.

    The local parts are put in the module's `__dict__` for the call (attribute lookup finds
    them before the DTensor parameters); their gradients flow back into the rank's shard.

    A fused parameter (a raw q|k|v weight, `fused`) holds its pieces of one size end to end
    along its split dim; each rank holds its slice of every piece (a `_StridedShard`), so
    what the module computes with it is its own q, k and v in order.

    Keyword Args:
        shard: parameter name (the module's own) -> the dim it is split on.
        fused: parameter name -> the sizes of its pieces (all one size).

    Example::
        >>> parallelize_module(model, mesh, {"layers.0.attn": SplitParams(shard={"sinks": 0})})
    """

    def __init__(self, *, shard: dict[str, int], fused: dict[str, list[int]] | None = None) -> None:
        super().__init__()
        self.shard = dict(shard)
        self.fused = {k: tuple(v) for k, v in (fused or {}).items()}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, dim in self.shard.items():
            split_param(module, name, device_mesh, dim, self.fused.get(name), 0)

        local_during_calls(module, tuple(self.shard), DTensor.to_local)
        return module

    def __repr__(self) -> str:
        fused = f", fused={self.fused}" if self.fused else ""
        return f"SplitParams(shard={self.shard}{fused})"


REGION_FLAG = "_tpplan_dtensor_region"
"""Set on a module whose forward runs on DTensors (regions.py's `hold_dtensors`)."""


def local_during_calls(
    module: nn.Module, names: tuple[str, ...], local: Callable[[DTensor], torch.Tensor]
) -> None:
    """Each call of `module` sees its DTensor parameters `names` as the tensors `local` makes
    of them (the rank's shard), put in its `__dict__` for the call, where attribute lookup
    finds them before the parameters; gradients flow back through `local` into the shard."""

    def before(mod: nn.Module, args: Any) -> None:
        if getattr(mod, REGION_FLAG, False):
            return  # a DTensor region's own code takes its parameters as DTensors
        for name in names:
            p = mod._parameters.get(name, mod._buffers.get(name))
            if isinstance(p, DTensor):
                # a buffer's local tensor is its storage: in-place updates (running
                # statistics while training) land in the rank's shard
                mod.__dict__[name] = local(p)

    def after(mod: nn.Module, args: Any, out: Any) -> None:
        for name in names:
            mod.__dict__.pop(name, None)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after, always_call=True)
