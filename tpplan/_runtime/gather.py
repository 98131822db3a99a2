"""Whole tensors of a sharded model, as the unsharded model holds them.

`full_state_dict` is the state dict the unsharded model would have; `gather_named` the same
for chosen names of a state dict, `whole_tensor` for one tensor. Each is called on every
rank: each split tensor is one collective, in the state dict's order everywhere. Below apply/ and checkpoint/, which both
save whole tensors (apply/saving.py for `save_pretrained`, checkpoint/save.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from .local import rank_values
from .ranks import rank

__all__ = ["full_state_dict", "gather_named", "whole_tensor"]


def full_state_dict(
    model: nn.Module, *, rank0_only: bool = False, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """The state dict the unsharded model would have: original names, full shapes, plain tensors.

    Call it on every rank: each sharded tensor is gathered with one collective, in the same
    order everywhere. With `rank0_only`, ranks other than 0 drop each gathered tensor at
    once and get an empty dict, so only rank 0 ends up holding the whole model. With
    `trainable_only`, only parameters that require grad are gathered (a LoRA adapter beside
    its frozen base), never the base. Tied parameters stay one tensor under each name, as
    in the unsharded model's state dict, and are gathered once.
    """
    state = model.state_dict(keep_vars=True)
    names: Iterable[str] = state
    if trainable_only:
        wanted = {n for n, p in model.named_parameters() if p.requires_grad}
        names = [n for n in state if n in wanted]
    return gather_named(state, names, rank0_only=rank0_only)


def gather_named(
    state: Mapping[str, torch.Tensor], names: Iterable[str], *, rank0_only: bool = False
) -> dict[str, torch.Tensor]:
    """{name: the whole tensor} for `names` of `state`, in their order: a DTensor gathered
    (one collective), a plain tensor detached as it is. The same tensor under two names
    (tied weights) is gathered once and shared. `rank0_only`: an empty dict on other ranks."""
    keep = not rank0_only or rank() == 0
    seen: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name in names:
        t = state[name]
        whole = seen.get(id(t))
        if whole is None:
            whole = seen[id(t)] = whole_tensor(t)
        if keep:
            out[name] = whole
    return out


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor as a plain tensor (a collective for a DTensor). Under simulated ranks
    every rank's copy is equal after the gather; rank 0's stands for them."""
    return rank_values(t)[0].detach()
