"""Grouped-query attention at a tp size above its key/value head count: each key/value head
goes whole to the tp/heads ranks whose query heads it serves (colwise `replicate_heads`).

Start at `SharedHeadsColwise`. With H query heads split over tp ranks (rank r holds query
heads [r*H/tp, (r+1)*H/tp)) and K key/value heads each serving g = H/K consecutive query
heads, a tp that is a multiple of K gives each rank query heads of one key/value head only:
head r // (tp/K). So the key/value projection's weight is laid out on the tp axis viewed as
(K, tp/K) (`heads_grid`): Shard(0) over the first axis, Replicate() over the second. Its
full tensor stays the original weight (state dicts, DCP and safetensors see the unsharded
layout), each rank holds and computes one head (its KV cache 1/K of the model's), and the
query and output projections stay plain colwise and rowwise: one all-reduce per block.

Each rank's gradient for its head comes from its own query heads only; `_SumOver` sums it
over the ranks sharing the head as the backward passes the weight, so the parameter's
gradient has the parameter's own layout, equal on the ranks that hold it.

Inside a DTensor region (`whole`, the rule's `local_output: false`) the region's code sizes
the key/value features by numbers no plan divides (`view(b, t, 2, 16)`), so it must see the
whole output: each rank computes its own head and hands on the whole width with that head in
every head's place (region_pieces.py's `Everywhere`). check proves on fake ranks, at a tp size of one head per
rank, that the region's code reads only the head its query heads use (check/regions_dtensor.py),
so the other places are never read. Their gradient arrives whole, summed over the ranks by
the region; the own place's share of it goes back to the head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle

from .._runtime.local import SOLO_AXIS, solo_fake_grid
from .._runtime.torch_compat import funcol_all_reduce, funcol_wait_tensor, unset_fake_temporarily
from ..errors import TpplanError
from .linear import Colwise
from .local_run import copy_to_ranks, group_name
from .params import local_during_calls
from .region_pieces import Everywhere

__all__ = ["SharedHeadsColwise", "head_replicas", "heads_grid"]

_GRIDS = "_tpplan_heads_grids"  # on a tp mesh: {heads: its (heads, replicas) view}


def head_replicas(heads: int, tp: int) -> int:
    """How many ranks share each of `heads` heads at tp size `tp` (1 where tp divides them)."""
    return 1 if heads % tp == 0 else tp // heads


def heads_grid(mesh: DeviceMesh, heads: int) -> DeviceMesh:
    """The 1-D tp `mesh` viewed as (heads, tp/heads): row h holds the ranks sharing head h
    (ranks h*tp/heads ... (h+1)*tp/heads - 1). One view per head count and mesh: each view
    makes process groups, on every rank of the world in the same order."""
    grids = mesh.__dict__.setdefault(_GRIDS, {})
    if heads not in grids:
        # the mesh's own bookkeeping runs on real rank tensors, also inside a fake-tensor
        # dry run (check's), where its index ops would have no fake kernel
        shape, names = (heads, mesh.size() // heads), ("tp_heads", "tp_head_replicas")
        with unset_fake_temporarily():
            if mesh.mesh_dim_names == (SOLO_AXIS,):
                # check's dry run: a fake mesh beside any process group (_runtime/local.py)
                grids[heads] = solo_fake_grid(shape, names)
            elif mesh.mesh_dim_names:
                # a named axis (maybe a slice of a dp x tp mesh): torch's unflatten makes the
                # groups of every slice, so all ranks of the world call the same new_groups
                grids[heads] = mesh._unflatten(0, shape, names)
            else:
                # an unnamed 1-D mesh is the whole world (apply_plan's tp_mesh)
                grids[heads] = DeviceMesh(
                    mesh.device_type, mesh.mesh.view(shape), mesh_dim_names=names
                )
    grid: DeviceMesh = grids[heads]
    return grid


class _SumOver(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over one axis of a mesh."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
        ctx.group = (mesh, axis)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return funcol_wait_tensor(funcol_all_reduce(grad, "sum", ctx.group)), None, None


class SharedHeadsColwise(ParallelStyle):
    """ColwiseParallel for a key/value projection whose heads tp may outnumber.

    Where tp divides the heads this is torch's ColwiseParallel. Where tp is a multiple of
    the heads, rank r holds head r // (tp/heads), whole, and its output is that head's
    features as a plain tensor; the weight's gradient is summed over the ranks sharing a
    head, and the input's gradient over the tp axis (as torch's colwise does).

    Keyword Args:
        head_dim: the size of one head of the output features.
        input_layouts: layout of the input as it arrives (default Replicate()).
        whole: inside a DTensor region: hand on the whole width, the rank's head in every
            head's place (a plain Colwise with DTensor outputs where tp divides the heads).

    Example::
        >>> parallelize_module(attn, mesh, {"k_proj": SharedHeadsColwise(head_dim=128)})
    """

    def __init__(
        self,
        *,
        head_dim: int,
        input_layouts: Placement | None = None,
        local_shards: bool = True,
        whole: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.input_layouts = input_layouts or Replicate()
        self.local_shards = local_shards
        self.whole = whole
        self.in_local_region = False
        """Inside a region that runs on local shards (compile/shard.py sets it)."""

    def _plain(self) -> Colwise:
        # where tp divides the heads; in a region on DTensors, handing them on to its code
        return Colwise(
            input_layouts=self.input_layouts,
            local_shards=self.local_shards,
            use_local_output=not self.whole or self.in_local_region,
        )

    def local_run_reason(self, module: nn.Module, tp: int) -> str | None:
        """Why `module` cannot run on its local shards (local_run.py); None: it can."""
        heads = int(module._parameters["weight"].shape[0]) // self.head_dim  # type: ignore[union-attr]
        if heads % tp == 0:
            return self._plain().local_run_reason(module, tp)
        if self.input_layouts != Replicate():
            return f"its input arrives as {self.input_layouts} (sequence parallel)"
        return None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight = module.get_parameter("weight")
        heads, tp = int(weight.shape[0]) // self.head_dim, device_mesh.size()
        if heads % tp == 0:
            return self._plain()._apply(module, device_mesh)
        if tp % heads:
            raise TpplanError(
                f"{heads} heads neither divide by nor divide tp size {tp}; replicate_heads "
                "gives each head to tp/heads ranks, so tp must be a multiple of the heads."
            )
        grid = heads_grid(device_mesh, heads)
        for name in ("weight", "bias"):
            p = getattr(module, name, None)
            if isinstance(p, nn.Parameter):
                data = distribute_tensor(p, grid, [Shard(0), Replicate()], src_data_rank=0)
                module.register_parameter(name, nn.Parameter(data, p.requires_grad))
        layout, fast = self.input_layouts, self.local_shards and self.input_layouts == Replicate()
        group = group_name(device_mesh)

        # this rank's head, its gradient summed over the ranks sharing it
        local_during_calls(
            module, ("weight", "bias"), lambda p: _SumOver.apply(p.to_local(), grid, 1)
        )

        def replicated(mod: nn.Module, args: Any) -> Any:
            x = args[0]
            if fast and not isinstance(x, DTensor):
                # a plain replicated input (local_run.py): its gradient summed over tp
                return (copy_to_ranks(x, group, tp), *args[1:])
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [layout], run_check=False)
            if x.placements != (Replicate(),):
                x = x.redistribute(placements=[Replicate()])
            # each rank's heads give a part of the input's gradient: summed over tp
            return (x.to_local(grad_placements=[Partial()]), *args[1:])

        module.register_forward_pre_hook(replicated)
        if self.whole:
            coordinate = grid.get_coordinate()
            assert coordinate is not None  # a rank applying a plan is on its mesh
            at, replicas = coordinate[0], tp // heads

            def everywhere(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
                return Everywhere.apply(out, heads, at, replicas)

            module.register_forward_hook(everywhere)
        return module

    def __repr__(self) -> str:
        whole = ", whole=True" if self.whole else ""
        return (
            f"SharedHeadsColwise(head_dim={self.head_dim}, "
            f"input_layouts={self.input_layouts}{whole})"
        )
