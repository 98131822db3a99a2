"""Tied weights: a parameter held by several modules (tied input and output embeddings)
stays one tensor only when every module that computes with it splits it alike.

Start at `untie_unalike`, called once the regions, tables and head are decided.
"""

from __future__ import annotations

from torch import nn

from .._runtime.facts import tied_groups, weight_split
from ..plan.styles import ReplicateRule
from .context import Context, Decided, Found
from .decision import reasoned
from .names import join

__all__ = ["untie_unalike"]


def untie_unalike(ctx: Context, so_far: Decided) -> Found:
    """A parameter held by several modules (tied input and output embeddings) stays one
    tensor only when every module that computes with it splits it alike (the vocab rows,
    for a token lookup and a head); otherwise they all stay whole. Holders that only
    keep a reference (BERT's prediction head holds its decoder's bias) do not count."""
    groups = tied_groups(ctx.model)
    found = Found()
    rules = dict(so_far.decisions)  # as this step leaves them
    changed = True
    while changed:
        changed = False
        for group in groups:
            users = _users(ctx, group)
            splits = {(m, p): weight_split(rules.get(m), ctx.modules[m], p) for m, p in users}
            if len(set(splits.values())) < 2:
                continue
            changed = True
            names = sorted({m for m, _ in group})
            for m, _ in users:
                if rules.pop(m, None) is not None:
                    found.withdrawn.add(m)
                    others = join([n for n in names if n != m])
                    found.kept[m] = (
                        f"kept whole: its weight is shared with {others} (tied), which "
                        "cannot split it the same way"
                    )
    for group in groups:
        for m, p in group:
            d = rules.get(m)
            if p == "weight" and d is not None and not isinstance(d, ReplicateRule):
                others = join(sorted({n for n, _ in group if n != m}))
                why = f"{d.why}; its weight is tied with {others}, split the same way"
                rules[m] = found.rules[m] = reasoned(d, why)
    return found


def _users(ctx: Context, group: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (module, parameter) holders of a tied parameter that compute with it: a called
    Linear or Embedding, or a module whose forward uses the parameter directly."""
    t = ctx.trace
    return [
        (m, p)
        for m, p in group
        if (
            m in t.layers.called
            and (m in t.layers.linears or isinstance(ctx.modules[m], nn.Embedding))
        )
        or f"{m}.{p}".lstrip(".") in t.params.outside
    ]
