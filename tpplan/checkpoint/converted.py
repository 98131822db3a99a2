"""Checkpoint keys stored in another layout than the model's: read piece by piece.

Hugging Face checkpoints of mixture-of-experts models usually keep one tensor per expert and
projection (`block_sparse_moe.experts.3.w1.weight`), while the model holds all experts in one
3-D parameter (`mlp.experts.gate_up_proj`); transformers converts them while loading, with the
conversion list it registers per model type. `virtual_tensors` reads that list (transformers'
own, never a table of ours) and describes each model key as a tree over stored tensors:

- a leaf: one stored tensor (a renamed key);
- `Stacked(dim, parts)`: the parts stacked along a new dim (transformers' MergeModulelist);
- `Joined(dim, parts)`: the parts concatenated along a dim (Concatenate, after
  MergeModulelist or on its own).

`read_slices` fills any rectangular region of such a tree by reading only the stored regions
it covers, so each rank still reads its own slices and never a whole tensor. A conversion made
of other operations (chunks, transposes, permutes) is reported, not guessed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Joined", "Stacked", "Unsupported", "read_slices", "shape_of", "virtual_tensors"]


@dataclass(frozen=True)
class Stacked:
    dim: int
    parts: tuple[Any, ...]


@dataclass(frozen=True)
class Joined:
    dim: int
    parts: tuple[Any, ...]


@dataclass(frozen=True)
class Unsupported:
    """A model key whose stored form needs operations tpplan does not read piecewise."""

    sources: tuple[str, ...]
    operations: str


Node = Any  # str (a stored key) | Stacked | Joined


def _natural(key: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key))


def virtual_tensors(model: nn.Module, stored: list[str]) -> dict[str, Node | Unsupported]:
    """{model key: how to read it from the stored keys} for keys transformers would convert
    or rename while loading; empty for models without a conversion list."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        return {}
    if not isinstance(model, PreTrainedModel):
        return {}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not transforms:
        return {}
    groups: dict[str, dict[str | None, list[str]]] = {}
    how: dict[str, Any] = {}
    for key in stored:
        target, pattern = rename_source_key(key, renamings, converters)
        if target == key and pattern is None:
            continue
        groups.setdefault(target, {}).setdefault(pattern, []).append(key)
        if pattern is not None:
            how[target] = next(c for c in converters if pattern in c.source_patterns)
    out: dict[str, Node | Unsupported] = {}
    for target, by_pattern in groups.items():
        converter = how.get(target)
        if converter is None:
            (keys,) = by_pattern.values()
            out[target] = keys[0] if len(keys) == 1 else Unsupported(tuple(keys), "renaming")
            continue
        ops = list(converter.operations)
        names = ", ".join(type(o).__name__ for o in ops)
        sources = tuple(k for ks in by_pattern.values() for k in ks)
        kinds = [type(o) for o in ops]
        if kinds == [Concatenate]:
            # one stored tensor per source pattern, laid end to end
            pieces = [by_pattern.get(p, []) for p in converter.source_patterns]
            if all(len(p) == 1 for p in pieces):
                out[target] = Joined(ops[0].dim, tuple(p[0] for p in pieces))
            else:
                out[target] = Unsupported(sources, names)
            continue
        if kinds not in ([MergeModulelist], [MergeModulelist, Concatenate]):
            out[target] = Unsupported(sources, names)
            continue
        stacks = tuple(
            Stacked(ops[0].dim, tuple(sorted(by_pattern.get(p, []), key=_natural)))
            for p in converter.source_patterns
        )
        if any(not s.parts for s in stacks):
            out[target] = Unsupported(sources, names)
            continue
        out[target] = Joined(ops[1].dim, stacks) if len(ops) == 2 else stacks[0]
    return out


def shape_of(node: Node, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape a tree gives, or None when its parts do not fit together."""
    if isinstance(node, str):
        return shapes[node]
    parts = [shape_of(p, shapes) for p in node.parts]
    if any(p is None or (p != parts[0] and isinstance(node, Stacked)) for p in parts):
        return None
    first = list(parts[0])  # type: ignore[arg-type]
    if isinstance(node, Stacked):
        return (*first[: node.dim], len(parts), *first[node.dim :])
    rest = [list(p[: node.dim]) + list(p[node.dim + 1 :]) for p in parts]  # type: ignore[index]
    if any(r != rest[0] for r in rest):
        return None
    first[node.dim] = sum(p[node.dim] for p in parts)  # type: ignore[index]
    return tuple(first)


Reader = Callable[[str, tuple[slice, ...], torch.Tensor], None]


def read_slices(
    node: Node,
    region: tuple[slice, ...],
    out: torch.Tensor,
    read: Reader,
    shapes: dict[str, tuple[int, ...]],
) -> None:
    """Fill `out` with `region` of the tree, reading only the stored regions it covers."""
    if isinstance(node, str):
        read(node, region, out)
        return
    d = node.dim
    lo, hi = region[d].start, region[d].stop
    if isinstance(node, Stacked):
        rest = region[:d] + region[d + 1 :]
        for i in range(lo, hi):
            read_slices(node.parts[i], rest, out.select(d, i - lo), read, shapes)
        return
    start = 0
    for part in node.parts:
        size = shape_of(part, shapes)[d]  # type: ignore[index]
        a, b = max(lo, start), min(hi, start + size)
        if a < b:
            sub = (*region[:d], slice(a - start, b - start), *region[d + 1 :])
            read_slices(part, sub, out.narrow(d, a - lo, b - a), read, shapes)
        start += size
