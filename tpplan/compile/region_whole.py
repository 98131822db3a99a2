"""Whole tensors in a DTensor region: whole ones meeting split ones, reductions over the
split, and what a region hands back whole (regions.py applies them).

- `used_whole` and `own_entries`: a whole tensor (plain, or replicated) used beside split
  heads or features, its gradient summed over the ranks in the backward;
- `norm_over_split`: a RMSNorm or LayerNorm over split features, its statistics all-reduced;
- `made_whole`: a region's replicated or partial outputs handed back as plain tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .._runtime.torch_compat import tree_flatten, tree_unflatten
from .local_regions import contiguous_dtensor
from .params import own_start
from .region_rewrites import NORMS, SUMS

__all__ = [
    "ELEMENTWISE",
    "NORMS",
    "SUMS",
    "is_whole",
    "made_whole",
    "norm_over_split",
    "own_entries",
    "own_entries_beside",
    "reduced_over_split",
    "used_whole",
]

# element-wise ops of two tensors, where a whole tensor broadcast along the split dim (a
# bias, a scale of one entry per feature) meets each rank's features with its own entries
ELEMENTWISE = frozenset(
    getattr(torch.Tensor, f"__{op}__") for op in ("add", "radd", "sub", "rsub", "mul", "rmul")
) | frozenset(
    (torch.add, torch.sub, torch.mul, torch.Tensor.add, torch.Tensor.sub, torch.Tensor.mul)
)


def norm_over_split(
    func: Any,
    x: DTensor,
    normalized_shape: Any,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float | None = None,
) -> Any:
    """A RMSNorm or LayerNorm whose normalized dims hold the split (a q/k norm over every
    head's features) as out-of-place ops, whose statistics DTensor sums over the ranks: one
    all-reduce of a value per row for each mean, where torch's own kernels write them in
    place, which DTensor refuses on a partial sum. None where the split is elsewhere."""
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    dims = list(range(x.ndim - len(shape), x.ndim))
    split = [p.dim % x.ndim for p in x.placements if isinstance(p, Shard)]
    if x.device_mesh.ndim != 1 or not split or split[0] not in dims:
        return None
    if eps is None:
        eps = torch.finfo(x.dtype).eps if func is F.rms_norm else 1e-5
    count = math.prod(shape)

    def mean(t: torch.Tensor) -> Any:
        return _SummedWhole.apply(t.sum(dims, keepdim=True)) / count

    centred = x if func is F.rms_norm else x - mean(x)
    y = centred * torch.rsqrt(mean(centred.pow(2)) + eps)
    own = type(x.placements[0]) is Shard
    for t, combine in ((weight, torch.mul), (bias, torch.add)):
        if t is not None:
            y = combine(y, own_entries(t, x, split[0] - dims[0]) if own else t)
    return y


def reduced_over_split(func: Any, x: DTensor, *args: Any, **kwargs: Any) -> Any:
    """A sum or mean over dims that hold the split (a hand-written norm's statistics over
    every head's features, `x.pow(2).mean(-1, keepdim=True)`; an average over the heads):
    the partial sum made whole at once, one all-reduce of the reduced values, its gradient
    whole too. Left to DTensor it stays partial, and the backward reduce-scatters its
    gradient at the size of the features it summed, as a gather would move. None where the
    split is not reduced (or the call asks for more than dims and keepdim)."""
    dim = args[0] if args else kwargs.get("dim")
    keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
    if dim is None or len(args) > 2 or set(kwargs) - {"dim", "keepdim"}:
        return None
    if x.device_mesh.ndim != 1 or type(x.placements[0]) is not Shard:
        return None
    dims = [d % x.ndim for d in ([dim] if isinstance(dim, int) else dim)]
    if x.placements[0].dim % x.ndim not in dims or not x.dtype.is_floating_point:
        return None
    total = _SummedWhole.apply(x.sum(dims, keepdim=bool(keepdim)))
    if func in (torch.mean, torch.Tensor.mean):
        return total / math.prod(x.shape[d] for d in dims)
    return total


class _SummedWhole(torch.autograd.Function):
    """A partial sum made whole (one all-reduce), its gradient made whole too (one
    all-reduce of the same small size) before it goes back: left partial, DTensor would
    reduce-scatter it at the size of the features the sum read. A sum nobody uses gets no
    gradient (autograd's zeros for it would be a plain tensor)."""

    @staticmethod
    def forward(ctx: Any, t: DTensor) -> DTensor:
        ctx.set_materialize_grads(False)  # an unused sum (a head average dropped) gets none
        return t.redistribute(placements=[Replicate()] * t.device_mesh.ndim)

    @staticmethod
    def backward(ctx: Any, grad: DTensor | None) -> DTensor | None:
        if grad is None:
            return None
        return grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)


def own_entries_beside(t: torch.Tensor, x: DTensor) -> Any:
    """`t` as each rank's own entries where it broadcasts against `x` along the one dim
    `x` is split on at full size (`own_entries`); None otherwise."""
    if x.device_mesh.ndim != 1 or type(x.placements[0]) is not Shard or t.dim() > x.dim():
        return None
    dim = x.placements[0].dim % x.dim() - (x.dim() - t.dim())
    if dim < 0 or t.shape[dim] != x.shape[dim + x.dim() - t.dim()]:
        return None
    own = own_entries(t, x, dim)
    return own if isinstance(own, DTensor) else None


def is_whole(t: torch.Tensor) -> bool:
    """The same on every rank: a plain tensor, or a DTensor replicated on every axis."""
    return not isinstance(t, DTensor) or all(isinstance(p, Replicate) for p in t.placements)


def own_entries(t: torch.Tensor, x: DTensor, dim: int) -> Any:
    """A norm's whole weight or bias (one entry per normalized feature) as the DTensor of
    this rank's entries along `dim`, where `x` is split: each rank reads its own slice, and
    the whole tensor's gradient, each rank's slice filled, is summed over the ranks in the
    backward (one all-reduce of the weight's size). Lifting it whole would gather that
    gradient instead. As it is where it is not whole or the split is uneven."""
    mesh, n = x.device_mesh, t.shape[dim] if t.dim() > dim else 0
    if not is_whole(t) or n == 0 or n % mesh.size():
        return t
    step = n // mesh.size()
    rows = own_start(n, mesh, t.device) + torch.arange(step, device=t.device)
    mine = used_whole(t, mesh).index_select(dim, rows)
    return contiguous_dtensor(mine, mesh, [Shard(dim)], t.shape)


def used_whole(t: torch.Tensor, mesh: Any) -> torch.Tensor:
    """A whole tensor (plain, or a replicated DTensor) used as it is beside each rank's own
    heads: the local tensor, whose gradient on each rank is its heads' share only, so it is
    summed over the ranks in the backward (one all-reduce, as DTensor's `from_local` does
    for a plain tensor lifted elsewhere in a region). Without that sum each rank would keep
    its share as the whole gradient, a wrong number with no error."""
    if not t.requires_grad:
        return t.to_local() if isinstance(t, DTensor) else t
    if not isinstance(t, DTensor):
        t = DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return t.to_local(grad_placements=[Partial()] * mesh.ndim)


def made_whole(out: Any) -> tuple[Any, bool]:
    """`out` with each partial DTensor in it (a reduction over the split heads that the
    module returns, such as attention weights averaged over heads, or what its own split
    weights contracted) summed over the ranks into a whole plain tensor, a replicated one
    made plain, and whether there was either. What leaves split stays split."""
    leaves, spec = tree_flatten(out)
    if not any(isinstance(t, DTensor) and _unsplit(t) for t in leaves):
        return out, False
    whole = [_Whole.apply(t) if isinstance(t, DTensor) and _unsplit(t) else t for t in leaves]
    return tree_unflatten(whole, spec), True


class _Whole(torch.autograd.Function):
    """A replicated or partial DTensor as the plain whole tensor (a partial one summed over
    the ranks, one all-reduce); its gradient, the same on every rank, goes back replicated.
    An output nobody uses gets no gradient at all (torch's own `full_tensor` would have
    autograd make zeros for it, a plain tensor DTensor's backward cannot take)."""

    @staticmethod
    def forward(ctx: Any, t: DTensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.mesh, ctx.shape, ctx.stride = t.device_mesh, t.shape, t.stride()
        return t.redistribute(placements=[Replicate()] * t.device_mesh.ndim).to_local()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> DTensor | None:
        if grad is None:
            return None
        return DTensor.from_local(
            grad,
            ctx.mesh,
            [Replicate()] * ctx.mesh.ndim,
            run_check=False,
            shape=ctx.shape,
            stride=ctx.stride,
        )


def _unsplit(t: DTensor) -> bool:
    """Whole on every rank, or a partial sum of it: handed back as a plain tensor."""
    return all(isinstance(p, (Partial, Replicate)) for p in t.placements)
