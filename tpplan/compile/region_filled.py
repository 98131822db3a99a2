"""A RMSNorm over every key/value head's features in a DTensor region, where ranks share the
heads (grouped heads past their count, `replicate_heads` with `local_output: false`).

Start at `norm_over_filled`. Such a piece reaches the region's code as the whole width with
the rank's own head in every head's place (region_pieces.py's `FILLED`); a norm over all of
it would take its statistics from copies of one head. Here each rank sums its own head's
squares once per rank sharing it, one all-reduce over the ranks makes the sum over every
head, and the rank's head is normalized by it (placed again in every head's place). The
backward sums the other statistic the same way, and the weight's gradient of each head from
the ranks that hold it. Gradients follow the region's convention for such pieces: the one
arriving is the whole of every rank's, and the one handed back fills only the own place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from .._runtime.torch_compat import all_reduce_op, wait_tensor_op
from .local_run import group_name
from .region_pieces import FILLED, KEEPS, Filled, contiguous_dtensor, in_every_place

__all__ = ["kept_filled", "norm_over_filled"]


def _summed(t: torch.Tensor, group: str) -> torch.Tensor:
    return wait_tensor_op(all_reduce_op(t.contiguous(), "sum", group))


class _FilledRms(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        filled: Filled,
        group: str,
    ) -> torch.Tensor:
        features = local.shape[-1]
        size = features // filled.heads
        own = local.narrow(-1, filled.at * size, size)
        squares = own.pow(2).sum(-1, keepdim=True) / filled.replicas
        rstd = torch.rsqrt(_summed(squares, group) / features + eps)
        y = in_every_place(own * rstd, filled.heads)
        # the whole weight on every place: the own place's is right, the others unread (an
        # index by the rank, which simulated ranks hold per rank, would not take a plain one)
        ctx.save_for_backward(own, rstd, weight)
        ctx.filled, ctx.group, ctx.features = filled, group, features
        return y if weight is None else y * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        own, rstd, weight = ctx.saved_tensors
        filled: Filled = ctx.filled
        size = own.shape[-1]
        g = grad.narrow(-1, filled.at * size, size)
        wg = g if weight is None else (grad * weight).narrow(-1, filled.at * size, size)
        dots = (wg * own).sum(-1, keepdim=True) / filled.replicas
        total = _summed(dots, ctx.group)
        d_own = rstd * wg - own * rstd.pow(3) * total / ctx.features
        d_local = grad.new_zeros(grad.shape)
        d_local.narrow(-1, filled.at * size, size).copy_(d_own)
        d_weight = None
        if weight is not None:
            mine = (g * own * rstd).reshape(-1, size).sum(0) / filled.replicas
            d_weight = mine.new_zeros(ctx.features)
            d_weight.narrow(0, filled.at * size, size).copy_(mine)
            d_weight = _summed(d_weight, ctx.group)
        return d_local, d_weight, None, None, None


def norm_over_filled(func: Any, x: DTensor, *args: Any, **kwargs: Any) -> Any:
    """F.rms_norm over the last dim of a piece of shared heads (see the module docstring),
    as a replicated DTensor filled alike; None where `x` is no such piece, or the norm
    another (a LayerNorm: its mean too) or over other dims."""
    filled = FILLED.get(x) if FILLED else None
    if filled is None or func is not F.rms_norm:
        return None
    return _rms_over_filled(x, filled, *args, **kwargs)


def _rms_over_filled(
    x: DTensor,
    filled: Filled,
    normalized_shape: Any,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> Any:
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    if shape != [x.shape[-1]]:
        return None
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    w = weight.to_local() if isinstance(weight, DTensor) else weight
    mesh = x.device_mesh
    out = _FilledRms.apply(x.to_local(), w, eps, filled, group_name(mesh))
    y = contiguous_dtensor(out, mesh, [Replicate()], x.shape)
    FILLED[y] = filled
    return y


def kept_filled(func: Any, args: Any, kwargs: Any) -> Any:
    """`func(*args, **kwargs)` for a call that keeps every element where it is (region_pieces.py's
    `KEEPS`: a module's backward hooks hand its input on through `view_as`) on a filled
    piece, its result filled alike; None for any other call."""
    if not FILLED or func not in KEEPS or not args or not isinstance(args[0], DTensor):
        return None
    filled = FILLED.get(args[0])
    if filled is None:
        return None
    out = func(*args, **kwargs)
    if isinstance(out, DTensor) and out.shape == args[0].shape:
        FILLED[out] = filled
    return out
