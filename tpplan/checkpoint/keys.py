"""Matching a model's state-dict keys to a checkpoint's, and the wording that lists keys.

Start at `match_keys`: every key of the model must be in the checkpoint (itself, or a weight
tied to it), every stored key must be the model's (or one a Hugging Face model says it may
ignore), and every shape must agree; otherwise one CheckpointError names every mismatch at
once, before anything is loaded. Shared by the safetensors and DCP loaders.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from .safetensors_io import CheckpointError

__all__ = ["count", "match_keys", "names", "shape_text"]

_MAX_LISTED = 8  # keys named per kind of mismatch; the count says how many more


def match_keys(
    model: nn.Module, sd: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], path: Path
) -> dict[str, str]:
    """{model key: checkpoint key}, or a CheckpointError naming every mismatch at once."""
    aliases = _aliases(model, sd)
    source: dict[str, str] = {}
    missing = []
    for key in sd:
        found = next((k for k in [key, *aliases[key]] if k in shapes), None)
        if found is None:
            missing.append(key)
        else:
            source[key] = found
    ignored = _ignored_unexpected(model)
    unexpected = [k for k in shapes if k not in sd and not any(p.search(k) for p in ignored)]
    mismatched = [
        f"{k} is {shape_text(shapes[src])} in the checkpoint but "
        f"{shape_text(tuple(sd[k].shape))} in the model"
        for k, src in source.items()
        if shapes[src] != tuple(sd[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"{count(missing, 'key')} missing from the checkpoint: {names(missing)}")
    if unexpected:
        problems.append(
            f"{count(unexpected, 'key')} in the checkpoint but not in the model: "
            f"{names(unexpected)}"
        )
    if mismatched:
        problems.append(f"{count(mismatched, 'shape')} differ: {names(mismatched)}")
    if problems:
        raise CheckpointError(
            f"{path} does not fit this {type(model).__name__}: "
            + "; ".join(problems)
            + ". Nothing was loaded. Fix: load a checkpoint saved from a model with the same "
            "config (layer count, widths, vocab), or build the model from the checkpoint's "
            "config.json."
        )
    return source


def _aliases(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """{key: other keys holding the same tensor}: tied weights are saved once by
    save_pretrained, so any one of them satisfies the others."""
    by_id: dict[int, list[str]] = {}
    for n, t in sd.items():
        by_id.setdefault(id(t), []).append(n)
    out = {n: [m for m in by_id[id(t)] if m != n] for n, t in sd.items()}
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # transformers: {tied: source}
    for target, source in dict(tied).items():
        if target in out and source in sd:
            out[target].append(source)
    return out


def _ignored_unexpected(model: nn.Module) -> list[re.Pattern[str]]:
    """Keys a Hugging Face model says old checkpoints may carry and it does not need."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    return [re.compile(p) for p in patterns]


def shape_text(shape: tuple[int, ...]) -> str:
    """A shape as a message writes it: `(4, 8)`, `(4,)` as `(4)`, `()` for a scalar."""
    return "(" + ", ".join(str(s) for s in shape) + ")"


def count(items: list[str], noun: str) -> str:
    """`1 key`, `3 keys`."""
    return f"{len(items)} {noun}{'s' if len(items) != 1 else ''}"


def names(items: list[str]) -> str:
    """The first few items, comma-separated, and how many more there are."""
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return shown + (f" (and {more} more)" if more > 0 else "")
