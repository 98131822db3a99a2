"""The sizes a tp size must divide: the dim each style splits (`split_dims`), and the Problem
of a size that does not divide, which lists the tp sizes that would (`check_size`). Start at
`check_size`; rules.py calls it for every dim a rule splits.
"""

from __future__ import annotations

from torch import nn

from ..errors import Problem
from ..plan.schema import Rule
from .shared import legal_sizes, rule_label

__all__ = ["check_size", "sharded_dim", "split_dims"]


def sharded_dim(rule: Rule, module: nn.Module) -> tuple[str, int] | None:
    """(what is split, its size) for a rule that splits a parameter dim."""
    weight = getattr(module, "weight", None)
    if rule.transposed and isinstance(weight, nn.Parameter):
        if rule.style == "colwise":
            return "out features (weight dim 1)", weight.shape[1]
        if rule.style == "rowwise":
            return "in features (weight dim 0)", weight.shape[0]
    if isinstance(module, nn.Linear):
        if rule.style == "colwise":
            return "out_features", module.out_features
        if rule.style == "rowwise":
            return "in_features", module.in_features
    if isinstance(module, nn.modules.conv._ConvNd):
        if rule.style == "colwise":
            return "out_channels", module.out_channels
        if rule.style == "rowwise":
            return "in_channels", module.in_channels
    if isinstance(module, nn.Embedding):
        if rule.style == "colwise":
            return "embedding_dim", module.embedding_dim
        if rule.style in ("rowwise", "vocab_parallel"):
            return "num_embeddings (the vocab)", module.num_embeddings
    if isinstance(module, nn.MultiheadAttention) and rule.style == "heads":
        return "embed_dim (its heads)", module.embed_dim
    return None


def split_dims(rule: Rule, module: nn.Module) -> list[tuple[str, int]]:
    """Each (what, size) the tp size must split: the whole dim, or each part of a fused one."""
    split = sharded_dim(rule, module)
    if split is None:
        return []
    if not rule.parts:
        return [split]
    what, _ = split
    return [(f"part {k} of the {what}", size) for k, size in enumerate(rule.parts)]


def _legal(heads: int, shared: bool) -> str:
    """The tp sizes up to 64 that divide `heads`; with replicate_heads, also its multiples
    (which the query heads, checked on their own rule, must be a multiple of)."""
    if not shared:
        return legal_sizes(heads)
    return f"{legal_sizes(heads)} or a multiple of {heads} dividing the query heads"


def check_size(i: int, rule: Rule, name: str, what: str, size: int, tp: int) -> list[Problem]:
    """The problem of a split dim (`what`, of `size`) tp does not divide; with a head_dim
    in the rule, the dim must be whole heads, and tp must divide their number."""
    out: list[Problem] = []
    if rule.head_dim is not None:
        if size % rule.head_dim:
            out.append(
                Problem(
                    "divisibility",
                    rule_label(i, rule),
                    name,
                    f"{what} = {size} is not a whole number of heads of head_dim {rule.head_dim}.",
                    "correct head_dim in the rule.",
                )
            )
        elif rule.replicate_heads and tp % (size // rule.head_dim) == 0:
            pass  # each head goes whole to tp/heads ranks (compile/shared_heads.py)
        elif (size // rule.head_dim) % tp:
            heads = size // rule.head_dim
            out.append(
                Problem(
                    "divisibility",
                    rule_label(i, rule),
                    name,
                    f"{heads} heads (of head_dim {rule.head_dim}) do not split evenly over tp size {tp}; "
                    "every rank must hold whole heads.",
                    f"use a tp size among {_legal(heads, bool(rule.replicate_heads))}, or keep "
                    "this module replicated.",
                )
            )
    elif size % tp:
        out.append(
            Problem(
                "divisibility",
                rule_label(i, rule),
                name,
                f"{what} = {size} does not divide by tp size {tp}.",
                f"use a tp size among {legal_sizes(size)}, or keep this module replicated.",
            )
        )
    return out
