"""Probe runs on no storage: `meta_copy`, a model's copy on the meta device (or fake
tensors), and fake tensors whose failures are answers (a probe run that fails says what does
not fit). check/ runs plans on such copies; infer/ and diagnose/ probe with them too."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .torch_compat import FakeTensorMode

__all__ = ["meta_copy", "quiet_fake_tensor_log"]


@contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """A probe that fails is an answer, not an error: fake tensors log failing kernels with
    their traceback, which would read as a crash to the user."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def meta_copy(
    model: nn.Module,
    *,
    fake: FakeTensorMode | None = None,
    trainable: bool = False,
    keep: dict[int, int] | None = None,
) -> nn.Module:
    """The model with every parameter and buffer on the meta device, no storage copied (a
    plain deepcopy would copy every weight first). Tied parameters stay tied. With `fake`,
    they are that mode's fake tensors of meta tensors; with `trainable`, every
    floating-point parameter requires grad, so a backward reaches it; `keep` ({id of a
    ModuleList: n}) copies only the first n blocks of those stacks."""
    keep = keep or {}
    stacks = [m for m in model.modules() if id(m) in keep]
    # the tensors of blocks left out are never copied: making them would cost the most
    skipped = {
        id(t)
        for m in stacks
        for block in list(m.children())[keep[id(m)] :]
        for t in [*block.parameters(), *block.buffers()]
    }

    def empty(t: torch.Tensor) -> torch.Tensor:
        # a plain tensor whatever `t` is (a LocalTensor of simulated ranks, say)
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        return fake.from_tensor(meta) if fake is not None else meta

    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in skipped:
            grad = p.requires_grad or (trainable and p.is_floating_point())
            memo[id(p)] = nn.Parameter(empty(p), requires_grad=grad)
    for b in model.buffers():
        if id(b) not in skipped:
            memo[id(b)] = empty(b)
    for m in stacks:
        memo[id(m)] = nn.ModuleList(
            [copy.deepcopy(b, memo) for b in list(m.children())[: keep[id(m)]]]
        )
    return copy.deepcopy(model, memo)
