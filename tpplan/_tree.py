"""Tensors inside a model's output: plain tensors, tuples, lists, dicts and Hugging Face
ModelOutput objects (dicts), in order. Shared by the tracer, verify and stats."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["first_tensor", "tensor_leaves"]


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
