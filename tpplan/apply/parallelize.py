"""parallelize: a plan on the mesh axis named "tp", and FSDP2 on the axis named "dp".

This is tensor parallelism beside data parallelism on one 2-D mesh, the layout torchtitan
uses: each block is wrapped by `fully_shard` over "dp" after its weights were split over
"tp". Start at `parallelize`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .._runtime.torch_compat import StridedShard, funcol_all_reduce, funcol_wait_tensor
from ..errors import MeshError
from ..plan.schema import Plan
from .api import apply_plan
from .trainers import prepare_for_trainers

__all__ = ["parallelize"]


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: members of every nn.ModuleList, outermost lists only."""
    blocks: list[nn.Module] = []
    seen: set[int] = set()
    for module in model.modules():
        if id(module) in seen:
            continue
        if isinstance(module, nn.ModuleList):
            for child in module:
                blocks.append(child)
                seen.update(id(m) for m in child.modules())
    return blocks


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: Plan | str | Path | None = None,
    *,
    dp: Literal["fsdp"] | None = "fsdp",
    check_inputs: bool | None = None,
) -> nn.Module:
    """Apply `plan` over mesh["tp"] and, with dp="fsdp", FSDP2 over mesh["dp"].

    The mesh names its axes ("dp", "tp") as in init_device_mesh(..., mesh_dim_names=...).
    A 1-D mesh named "tp" (or unnamed) gets tensor parallelism only. Each dp rank must then
    feed its own part of the batch; all tp ranks of one dp rank the same part.
    """
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1 and names in ((), ("tp",)):
        return apply_plan(model, mesh, plan, check_inputs=check_inputs)
    if "tp" not in names:
        raise MeshError(
            f"parallelize needs a mesh axis named 'tp' (this mesh's axes: {', '.join(names) or 'unnamed'}); "
            "build it with init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))."
        )
    apply_plan(model, mesh["tp"], plan, check_inputs=check_inputs)
    # what a trainer must know: the dp axis, and whether FSDP2 averages gradients over it
    dp_mesh = mesh["dp"] if "dp" in names else None
    prepare_for_trainers(model, mesh["tp"], dp_mesh, fsdp=dp == "fsdp" and dp_mesh is not None)
    if dp is None:
        return model
    if dp != "fsdp":
        raise ValueError(f"dp must be 'fsdp' or None, got {dp!r}.")
    if "dp" not in names:
        raise MeshError(
            f"dp='fsdp' needs a mesh axis named 'dp' (this mesh's axes: {', '.join(names)})."
        )
    from torch.distributed.fsdp import fully_shard

    # FSDP2 cannot shard the dim a fused layer is split on as strided pieces (it would label
    # the result as if the pieces were one): such a parameter is sharded over dp along
    # another dim, and one with no other dim (a fused bias) is kept whole over dp, its
    # gradient averaged over dp as FSDP averages the others'.
    whole = {p for p in model.parameters() if _strided_dim(p) is not None and p.dim() == 1}
    for p in whole:
        p.register_hook(partial(_average_over, mesh["dp"]))
    for block in [*_blocks(model), model]:
        fully_shard(
            block, mesh=mesh["dp"], shard_placement_fn=_fsdp_placement, ignored_params=whole
        )
    return model


def _strided_dim(p: nn.Parameter) -> int | None:
    """The dim of a parameter split as each rank's slice of each fused piece, if any."""
    if not isinstance(p, DTensor):
        return None
    return next((q.dim for q in p.placements if isinstance(q, StridedShard)), None)


def _fsdp_placement(p: nn.Parameter) -> Shard | None:
    """FSDP2's dim for `p`: dim 0 (None: its default) unless tp split dim 0 into pieces."""
    if _strided_dim(p) != 0:
        return None
    return Shard(1)


def _average_over(dp: DeviceMesh, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of a parameter FSDP does not manage, averaged over the dp ranks."""
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    mean = funcol_wait_tensor(funcol_all_reduce(local, "avg", dp))
    if isinstance(grad, DTensor):
        return DTensor.from_local(
            mean,
            grad.device_mesh,
            grad.placements,
            run_check=False,
            shape=grad.shape,
            stride=grad.stride(),
        )
    return mean
