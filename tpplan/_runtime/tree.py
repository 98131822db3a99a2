"""Tensors inside a model's output: plain tensors, tuples, lists, dicts and Hugging Face
ModelOutput objects (dicts), in order; and what one rank holds of a (D)Tensor. Shared by
the tracer, verify, stats and checkpoints."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["first_tensor", "local_bytes", "local_tensor", "tensor_leaves"]


def tensor_leaves(out: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `out`, depth first, in order."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, dict):
        for v in out.values():
            yield from tensor_leaves(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            yield from tensor_leaves(v)


def first_tensor(out: Any) -> torch.Tensor | None:
    """The first tensor in `out` (an LM's logits, an encoder's last hidden state), or None."""
    return next(tensor_leaves(out), None)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(t: torch.Tensor) -> int:
    """The bytes of this rank's part of `t`."""
    local = local_tensor(t)
    return local.numel() * local.element_size()
