"""Token lookups split over the vocab (vocab_parallel), and the output head over the same
vocab (colwise, gathered or left split for a parallel loss).

Start at `decide_embeddings`. A table is an Embedding module (trace/record.py): its weight is
the lookup table, its rows are looked up by token ids. Split over the vocab, each rank looks
up the rows it holds (zeros for the others) and one all-reduce sums them; that is right only
when what the table's forward returns is linear in the looked-up rows.
"""

from __future__ import annotations

from torch import nn

from ..compile.strided import shard_step
from ..plan.styles import ColwiseRule, VocabParallelRule
from .context import Context, Decided, Found
from .decision import decided

__all__ = ["decide_embeddings", "decide_head", "not_linear_lookup"]


def not_linear_lookup(op: str) -> str:
    """The `why` of a table whose forward applies `op` to the looked-up rows."""
    return (
        f"kept whole: its forward applies {op} to the looked-up rows, which is not linear in "
        "them; a vocab-parallel lookup's partial rows are summed only after the forward"
    )


def decide_embeddings(ctx: Context, so_far: Decided) -> Found:
    """vocab_parallel for token lookups."""
    found = Found()
    for name, module in ctx.modules.items():
        if not isinstance(module, nn.Embedding) or name not in ctx.trace.layers.called:
            continue
        if name in so_far.decisions:
            continue  # split by its columns inside a span
        n = module.num_embeddings
        not_linear = ctx.trace.lookups.not_linear.get(name)
        written = () if not_linear else _written(ctx, name, module)
        if written is None:
            not_linear = "index_put_"  # rows overwritten with a parameter that cannot be split
        kept = _kept_why(ctx, name, module, not_linear)
        if kept is not None:
            found.kept[name] = kept
            continue
        found.rules[name] = decided(
            VocabParallelRule,
            _vocab_parallel_why(n, ctx.tp, module.embedding_dim, not_linear, written or ()),
            sum_at="lookup" if not_linear else None,
            written=list(written) if written else None,
            uneven=bool(n % ctx.tp) or None,
        )
    return found


def _kept_why(ctx: Context, name: str, module: nn.Embedding, not_linear: str | None) -> str | None:
    """Why a table that was looked up stays whole; None when it splits over the vocab."""
    if not ctx.trace.lookups.token_ids.get(name):
        return "kept whole: its indices are computed inside forward (positions or types), not the input tokens"
    if ctx.used_outside(name):
        return "kept whole: its weight is also used outside its own lookup"
    if not_linear and not ctx.trace.lookups.at_lookup_place.get(name):
        return (
            not_linear_lookup(not_linear) + ", and it looks its rows up with an embedding of its "
            "own rather than through nn.Embedding's forward, where they could be "
            "summed first"
        )
    if module.max_norm is not None:
        return "kept whole: max_norm renormalizes looked-up rows in place"
    if module.num_embeddings % ctx.tp and (not_linear or ctx.trace.lookups.written_rows.get(name)):
        # split unevenly only as torch's own lookup (summed at the output) runs it
        return f"kept whole: its vocab of {module.num_embeddings} does not divide by tp {ctx.tp}"
    return None


def _vocab_parallel_why(
    n: int, tp: int, width: int, not_linear: str | None, written: tuple[str, ...]
) -> str:
    how = "evenly," if n % tp == 0 else f"{uneven_words(n, tp)};"
    why = (
        f"token lookup (its indices are the model's input ids); vocab {n} splits {how} each "
        "rank looks up its rows and one all-reduce sums them"
    )
    if not_linear:
        why += (
            f", right where nn.Embedding's lookup returns them (sum_at: lookup): "
            f"its own forward goes on to apply {not_linear} to the rows, which is not "
            "linear in them"
        )
    elif written:
        what = " and ".join(written)
        why += (
            f" as its forward returns; that forward writes {what} over some of the "
            f"rows (index_put_), so {what} is split along its "
            f"{width} features and each rank writes its share "
            "padded with zeros, which the same sum adds up whole (written)"
        )
    return why


def _written(ctx: Context, name: str, module: nn.Embedding) -> tuple[str, ...] | None:
    """The table's own parameters its forward writes over looked-up rows, when each can
    be split along the rows' features and written as each rank's share: every lookup
    made in nn.Embedding's place (where WrittenRows looks up local rows), the parameter
    used for nothing else and its width dividing by tp. None when one cannot."""
    t = ctx.trace
    written = tuple(sorted(t.lookups.written_rows.get(name, ())))
    if written and (
        not t.lookups.at_lookup_place.get(name)
        or module.embedding_dim % ctx.tp
        or t.written_elsewhere(name, written)
    ):
        return None
    return written


def uneven_words(n: int, tp: int) -> str:
    """How `n` entries split over tp ranks tp does not divide (`uneven`), as DTensor's Shard
    holds them."""
    step = shard_step(n, tp)
    sizes = [max(0, min(step, n - r * step)) for r in range(tp)]
    shares = sorted(set(sizes), reverse=True)
    return (
        f"unevenly, as tp {tp} does not divide it: ranks hold {' or '.join(map(str, shares))} "
        "entries each (uneven), the full tensor unchanged"
    )


def decide_head(ctx: Context, so_far: Decided) -> Found:
    """A lone opener whose split output is the model output over the vocab of a token
    lookup split over it: colwise, gathered (or left split for a parallel loss)."""
    t = ctx.trace
    found = Found()
    vocabs = {
        m.num_embeddings
        for n, r in so_far.decisions.items()
        if isinstance(r, VocabParallelRule) and isinstance(m := ctx.modules[n], nn.Embedding)
    }
    for name in t.spans.at_output:
        linked = any(name in group for group in t.spans.links)
        if name not in t.layers.linears or linked or name in t.spans.misfits:
            continue
        _, features, transposed = t.layers.linears[name]
        if features not in vocabs or ctx.used_outside(name):
            continue
        if features % ctx.tp and ctx.loss_parallel:
            continue  # a parallel loss takes no uneven split: the rest keeps it, with why
        found.unkept.add(name)
        if ctx.loss_parallel:
            found.rules[name] = decided(
                ColwiseRule,
                f"its output ({features} features, the vocab of the token lookup) is the model "
                "output; split over the vocab and left split (a DTensor) for the loss, "
                "computed under loss_parallel()",
                local_output=False,
                transposed=transposed or None,
            )
            continue
        how = f" {uneven_words(features, ctx.tp)}," if features % ctx.tp else ""
        found.rules[name] = decided(
            ColwiseRule,
            f"its output ({features} features, the vocab of the token lookup) is the "
            f"model output; split over the vocab{how} and gathered, so callers see full rows",
            output="replicate",
            transposed=transposed or None,
            uneven=bool(features % ctx.tp) or None,
        )
    return found
