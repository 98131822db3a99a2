"""`clip_grad_norm_` for a sharded model: torch's, over parameters that live on several meshes.

A plan's split layers hold DTensors on the tp mesh, and key/value heads shared past their
count (colwise `replicate_heads`) hold DTensors on a 2-D view of it; replicated layers hold
plain tensors. torch's `clip_grad_norm_` stacks every gradient's norm in one op, which
DTensor refuses across meshes (and across DTensors and plain tensors, unless under
`implicit_replication`). This one takes the norm of each mesh's gradients with torch's own
`get_total_norm` (DTensor reduces a split gradient's norm over its mesh), combines the
norms as plain tensors, and scales each mesh's gradients with torch's `clip_grads_with_norm_`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of a sharded model's parameters to a total norm of `max_norm`, as
    `torch.nn.utils.clip_grad_norm_` does on the unsharded model; returns the total norm
    (a plain tensor, the same on every rank).

    Example::
        >>> loss.backward()
        >>> tpplan.clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for group in groups.values():
        grads = [p.grad for p in group if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    total = torch.nn.utils.get_total_norm(
        [n.to(device) for n in norms], norm_type, error_if_nonfinite, foreach
    )
    with implicit_replication():  # the plain total scales DTensor gradients
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
    return total
