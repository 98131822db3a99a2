"""The sizes a tp size must divide: the dim each style splits (`split_dims`), and the Problem
of a size that does not divide, which lists the tp sizes that would (`check_size`). Start at
`check_size`; rules.py calls it for every dim a rule splits.
"""

from __future__ import annotations

from torch import nn

from .._runtime.facts import weight_kind
from .._runtime.torch_compat import ConvNd
from ..compile.uneven_heads import uneven_rows
from ..errors import Problem, TpplanError
from ..plan.rule import Rule
from ..plan.styles import ColwiseRule, HeadsRule, RowwiseRule
from .shared import legal_sizes, rule_label

__all__ = ["check_size", "check_uneven_heads", "sharded_dim", "split_dims"]


# (what holds the weight, the dim of it a style splits) -> the attribute that sizes the dim
_SIZED_BY: dict[tuple[type[nn.Module], int], str] = {
    (nn.Linear, 0): "out_features",
    (nn.Linear, 1): "in_features",
    (ConvNd, 0): "out_channels",
    (ConvNd, 1): "in_channels",
    (nn.Embedding, 1): "embedding_dim",
    (nn.Embedding, 0): "num_embeddings",
}


def sharded_dim(rule: Rule, module: nn.Module) -> tuple[str, int] | None:
    """(what is split, its size) for a rule that splits a parameter dim."""
    weight = getattr(module, "weight", None)
    dim = rule.weight_dim(weight_kind(module))
    if rule.stored_transposed() and isinstance(weight, nn.Parameter) and dim is not None:
        return f"{'out' if dim == 1 else 'in'} features (weight dim {dim})", weight.shape[dim]
    for (holder, at), attr in _SIZED_BY.items():
        if isinstance(module, holder) and at == dim:
            words = " (the vocab)" if attr == "num_embeddings" else ""
            return attr + words, getattr(module, attr)
    if isinstance(module, nn.MultiheadAttention) and isinstance(rule, HeadsRule):
        return "embed_dim (its heads)", module.embed_dim
    return None


def split_dims(rule: Rule, module: nn.Module) -> list[tuple[str, int]]:
    """Each (what, size) the tp size must split: the whole dim, or each part of a fused one."""
    split = sharded_dim(rule, module)
    if split is None:
        return []
    parts = rule.part_sizes()
    if not parts:
        return [split]
    what, _ = split
    return [(f"part {k} of the {what}", size) for k, size in enumerate(parts)]


def _legal(heads: int, shared: bool) -> str:
    """The tp sizes up to 64 that divide `heads`; with replicate_heads, also its multiples
    (which the query heads, checked on their own rule, must be a multiple of)."""
    if not shared:
        return legal_sizes(heads)
    return f"{legal_sizes(heads)} or a multiple of {heads} dividing the query heads"


def _uneven_hint(rule: Rule, heads: int, tp: int) -> str:
    """Where each rank could hold at least one whole head of a Linear's: the plan `infer`
    writes for this very tp, which splits heads unevenly where the model allows."""
    if not isinstance(rule, (ColwiseRule, RowwiseRule)) or heads < tp:
        return ""
    return (
        f"; or write a plan for this tp (`tpplan infer MODEL --tp {tp}`), which splits the "
        "heads unevenly, whole heads per rank, where the model allows it"
    )


def check_size(
    i: int, rule: Rule, name: str, what: str, size: int, tp: int, also: str = ""
) -> list[Problem]:
    """The problem of a split dim (`what`, of `size`) tp does not divide; with a head_dim
    in the rule, the dim must be whole heads, and tp must divide their number. `also`: more
    words for the fix of a size tp does not divide."""
    out: list[Problem] = []
    head_dim = rule.head_size()
    if head_dim is not None:
        if size % head_dim:
            out.append(
                Problem(
                    "divisibility",
                    rule_label(i, rule),
                    name,
                    f"{what} = {size} is not a whole number of heads of head_dim {head_dim}.",
                    "correct head_dim in the rule.",
                )
            )
        elif rule.uneven_group() is not None:
            pass  # the rule's pieces as one (check_uneven_heads)
        elif rule.shares_heads() and tp % (size // head_dim) == 0:
            pass  # each head goes whole to tp/heads ranks (compile/shared_heads.py)
        elif (size // head_dim) % tp:
            heads = size // head_dim
            out.append(
                Problem(
                    "divisibility",
                    rule_label(i, rule),
                    name,
                    f"{heads} heads (of head_dim {head_dim}) do not split evenly over tp size {tp}; "
                    "every rank must hold whole heads.",
                    f"use a tp size among {_legal(heads, bool(rule.shares_heads()))}, or keep "
                    f"this module replicated{_uneven_hint(rule, heads, tp)}.",
                )
            )
    elif size % tp:
        out.append(
            Problem(
                "divisibility",
                rule_label(i, rule),
                name,
                f"{what} = {size} does not divide by tp size {tp}.",
                f"use a tp size among {legal_sizes(size)}, or keep this module replicated{also}.",
            )
        )
    return out


def check_uneven_heads(i: int, rule: Rule, name: str, sizes: list[int], tp: int) -> list[Problem]:
    """Heads split unevenly (compile/uneven_heads.py): for every rank whole heads of whole or
    shared key/value heads, in each of the rule's pieces (`sizes`, or the whole dim)."""
    group, head_dim = rule.uneven_group(), rule.head_size()
    assert group is not None and head_dim is not None
    if any(size % head_dim for size in sizes):
        return []  # told by check_size: not whole heads
    try:
        uneven_rows(sizes, head_dim, group, tp)
    except TpplanError as e:
        fix = "fix group (the query heads per key/value head), or keep this module replicated."
        return [Problem("divisibility", rule_label(i, rule), name, str(e), fix)]
    return []
