"""Grouped-query attention past its key/value heads: whether a span's key/value openers may
give each head whole to the tp/K ranks whose query heads it serves (colwise
`replicate_heads`, compile/shared_heads.py), and what the plan then divides.

Start at `kv_sharing`. The trace (trace/attention.py) records a span's grouped-query
attention: K key/value heads for H query heads, each key/value head paired with H/K
consecutive query heads. Split by query heads over tp ranks, a tp that is a multiple of K
gives each rank query heads of one key/value head, so that head can live whole on those
ranks: attention and its cache shrink by tp, one all-reduce per block as before. What must
hold for it, each checked on the trace:

- the key/value openers are plain Linears of K whole heads; or the key and value pieces of
  one fused Linear (q|k|v of unequal pieces, `kv_parts` in the trace), told from its query
  piece where attention meets them, each of K whole heads (colwise `parts` with
  `replicate_heads`: each rank computes with a copy of its own rows);
- no parameter holds one entry per key/value head (it would be split, not shared);
- each count the forward reads to size the split features sizes one side only: a
  key/value count shrinks to the heads a rank holds (`by: shards`), a query count by tp;
- each count that repeats a key/value head to its query heads (`repeat_kv`'s n_rep) is an
  attribute read in forward, divided by the ranks sharing a head (`by: replicas`);
- a fused layer's sizes computed from its width (`qkv.shape[-1] // (self.groups + 2)`) give
  each rank its own pieces with some of their attributes divided by those ranks
  (`_width_cuts`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from ..compile.own_rows import own_order
from ..trace.counted import evaluate, render, values_read
from .context import Context
from .decision import Divided
from .names import inside, relative

__all__ = ["Sharing", "fused_query_unit", "kv_sharing", "piece_side", "summed_refusal"]


@dataclass
class Sharing:
    """A span's grouped-query attention: its key/value openers and whether they may share
    their heads among ranks."""

    kv: dict[str, int]
    """Key/value opener -> its K heads."""
    refused: str | None = None
    """Why the heads cannot be shared (None: they can)."""
    query_unit: int = 0
    """The gcd of the other openers' split units: tp must divide it in any case."""
    attributes: dict[str, list[Divided]] = field(default_factory=dict)
    """Module -> the counts sharing divides by a head's replicas or shards."""

    def divided(self) -> set[tuple[str, str]]:
        """(module, attribute) of each count sharing divides."""
        return {(m, a) for m, entries in self.attributes.items() for d in entries for a in d.attrs}

    def fits(self, tp: int) -> bool:
        """Whether the span splits at `tp` with the key/value heads shared past K."""
        return (
            self.refused is None
            and self.query_unit % tp == 0
            and all(k % tp == 0 or tp % k == 0 for k in self.kv.values())
        )


def kv_sharing(
    ctx: Context, openers: list[str], counts: set[tuple[str, str, int]]
) -> Sharing | None:
    """The grouped-query attention of the span with these openers (None where it has none),
    with the counts its views read (`counts`)."""
    spans = ctx.trace.spans
    kv = {o: spans.kv_heads[o] for o in openers if o in spans.kv_heads}
    if not kv:
        return None
    others = [o for o in openers if o not in kv]
    units = [spans.units.get(o, spans.openers[o]) for o in others]
    units += [fused_query_unit(ctx, o) for o in kv if o in spans.kv_parts]
    sharing = Sharing(kv, query_unit=math.gcd(*units) if units else 0)
    sharing.refused = (
        _refusal(ctx, openers, kv)
        or _divide(ctx, sharing, openers, counts)
        or _width_cuts(ctx, sharing)
    )
    return sharing


def piece_side(ctx: Context, piece: tuple[str, int, int]) -> str:
    """Which side of its fused opener's grouped-query attention a piece is: "kv" inside
    its key/value pieces, "q" apart from them, "both" across."""
    src, start, size = piece
    kv = [range(a, a + n) for a, n in ctx.trace.spans.kv_parts.get(src, ())]
    inside = sum(len(range(max(start, r.start), min(start + size, r.stop))) for r in kv)
    return "kv" if inside == size else "q" if inside == 0 else "both"


def _kv_features(ctx: Context, o: str) -> int:
    """The output features of fused opener `o`'s key/value pieces (0 where it has none)."""
    return sum(n for _, n in ctx.trace.spans.kv_parts.get(o, ()))


def fused_query_unit(ctx: Context, o: str) -> int:
    """The gcd of the split sizes a fused opener's query side met: its tensors holding no
    one piece, and those holding a query piece (its key/value pieces may be shared)."""
    spans = ctx.trace.spans
    features = spans.openers[o]
    queries = features - _kv_features(ctx, o)
    # the output as it came, and a view of every piece side by side counted as a sum
    # (`view(B, T, self.n_head + 2, D)`), hold each shared key/value piece whole on a rank:
    # tp need divide the query heads among them only
    units = [queries if n == features else n for n in spans.plain_units.get(o, {features})]
    units += [
        n * queries // features if (n * queries) % features == 0 else n
        for n in spans.summed_units.get(o, ())
    ]
    units += [n for p, n in spans.piece_units.items() if p[0] == o and piece_side(ctx, p) == "q"]
    return math.gcd(*units)


def _refusal(ctx: Context, openers: list[str], kv: dict[str, int]) -> str | None:
    """Why the key/value openers cannot share their heads, by the trace."""
    t = ctx.trace
    short = relative(sorted(kv))
    for o in sorted(kv):
        if o in t.spans.unshared:
            return f"{short[o]}: {t.spans.unshared[o]}"
        if o in t.spans.kv_parts:
            refused = _fused_refusal(ctx, o, kv[o], short[o])
            if refused:
                return refused
            continue
        if o not in t.layers.linears or t.layers.linears[o][2] or o in t.spans.parts:
            return f"{short[o]} is not a Linear of whole key/value heads alone"
        if t.spans.openers[o] % kv[o]:
            return f"{short[o]}'s {t.spans.openers[o]} features are not {kv[o]} whole heads"
    for o in openers:
        pairs = t.spans.query_heads.get(o)
        if pairs is not None and not pairs[1] <= kv.keys():
            return "a query's key/value heads come from outside the region"
    for p, sources in t.params.in_span.items():
        if sources & kv.keys() and p in t.params.split_vectors:
            return f"{p} holds one entry per head and meets the key/value heads"
    return None


def _fused_refusal(ctx: Context, o: str, heads: int, short: str) -> str | None:
    """Why a fused opener's key/value pieces cannot share their heads."""
    t = ctx.trace
    parts = t.spans.parts.get(o)
    if o not in t.layers.linears or t.layers.linears[o][2] or parts is None:
        return f"{short} is not a Linear whose fused pieces are its queries, keys and values"
    starts = {(sum(parts[:i]), n) for i, n in enumerate(parts)}
    if not t.spans.kv_parts[o] <= starts:
        return f"{short}'s key/value heads are not whole fused pieces"
    if any(n % heads for _, n in t.spans.kv_parts[o]):
        return f"{short}'s key/value pieces are not {heads} whole heads each"
    cut = any(p[0] == o for p in t.reads.width_cuts)
    if not cut and any(inside(o, m) for m, _ in t.reads.width_terms):
        return (
            f"{short} is cut at sizes computed from its width as read off the tensor, which "
            "shared key/value heads keep from shrinking by the tp size"
        )
    return None


def _sides(ctx: Context, o: str, count: tuple[str, str, int]) -> set[str]:
    """The sides of fused opener `o`'s attention whose pieces `count` sized."""
    reads = ctx.trace.reads
    by_product = {
        p for p, terms in reads.piece_products.items() if any(count in term for term in terms)
    }
    sides = {
        piece_side(ctx, p)
        for p in {*reads.piece_counts, *by_product}
        if p[0] == o and (count in reads.piece_counts.get(p, ()) or p in by_product)
    }
    return sides | summed_sides(ctx, o, count)


def summed_sides(ctx: Context, o: str, count: tuple[str, str, int]) -> set[str]:
    """The sides of fused opener `o`'s attention a count counts as a term of a view's sum
    (`view(B, T, self.n_head + 2 * self.n_kv, D)`): the query side where the term spans all
    the features outside the key/value pieces, the key/value side where it spans theirs."""
    spans = ctx.trace.spans
    kv_features = _kv_features(ctx, o)
    q_features = spans.openers[o] - kv_features
    sides = set()
    for terms, _, unit in ctx.trace.reads.view_sums.get(o, ()):
        for read, factor in terms:
            if read != count:
                continue
            spanned = factor * read[2] * unit
            sides.add("q" if spanned == q_features else "kv" if spanned == kv_features else "both")
    return sides


def summed_refusal(ctx: Context, o: str, kv: int | None) -> str | None:
    """Why a view of opener `o` counted as a sum with a constant (`self.num_heads + 2`)
    cannot be each rank's own: the constant must count its key/value pieces, each one head
    that every rank holds whole (multi-query attention, `kv` its key/value heads)."""
    kv_features = _kv_features(ctx, o)
    for terms, constant, unit in ctx.trace.reads.view_sums.get(o, ()):
        if not constant:
            continue
        written = " + ".join(
            [*(f"{f} * {a}" if f > 1 else a for (_, a, _), f in terms), str(constant)]
        )
        if kv != 1 or constant * unit != kv_features:
            return (
                f"a view counts its heads as {written}, whose {constant} is held by no "
                "attribute; only key and value pieces of one head each, whole on every "
                "rank, may be counted by a number"
            )
    return None


def _divide(
    ctx: Context, sharing: Sharing, openers: list[str], counts: set[tuple[str, str, int]]
) -> str | None:
    """Fill `sharing.attributes` with the counts sharing divides; why it cannot, if so."""
    t = ctx.trace
    divided: list[tuple[str, str, str, str]] = []  # (module, attribute, by, why)
    for module, attr, value in sorted(counts):
        count = (module, attr, value)
        sized = {
            o
            for o in openers
            if count in t.reads.counts.get(o, ())
            or any(count in term for term in t.reads.products.get(o, ()))
        }
        fused = {o for o in sized if o in t.spans.kv_parts}
        if fused:
            sides = set().union(*(_sides(ctx, o, (module, attr, value)) for o in fused))
            if not sides or "both" in sides or len(sides) > 1:
                said = "both the query and the key/value heads" if sides else "no one piece"
                return f"{attr} = {value} sizes {said} of a fused layer"
            if sides == {"q"} and sized == fused:
                continue  # a query count: divided by the tp size, as any
            if sides == {"q"} or not sized <= sharing.kv.keys():
                return f"{attr} = {value} sizes both the query and the key/value heads"
        elif not sized <= sharing.kv.keys():
            if sized & sharing.kv.keys():
                return f"{attr} = {value} sizes both the query and the key/value heads"
            continue  # a query count: divided by the tp size, as any
        divided.append(
            (
                module,
                attr,
                "shards",
                f"its forward reads {attr} = {value} to view the key/value heads of "
                f"{_label(sharing.kv, module)}; each rank holds min(tp, {_heads(sharing, sized)}) "
                "of them (the shards of the heads), so it is divided by that",
            )
        )
    repeats = {t.spans.repeats[o] for o in sharing.kv if o in t.spans.repeats}
    for times, read in sorted(repeats, key=str):
        if read is not None:
            module, attr, _ = read
            divided.append(
                (
                    module,
                    attr,
                    "replicas",
                    f"its forward reads {attr} = {times}, the query heads each key/value "
                    f"head of {_label(sharing.kv, module)} serves (it repeats the heads by "
                    f"it or groups them); past {min(sharing.kv.values())} ranks each head is "
                    "shared by tp/heads ranks, each with its own share of the query heads, "
                    "so it is divided by those",
                )
            )
    for module, attr, by, why in divided:
        refused = _add(sharing, module, attr, by, why)
        if refused:
            return refused
    query = {(m, a) for m, a, _ in counts} - {(m, a) for m, a, _, _ in divided}
    return _computed_repeats(ctx, sharing, query, {(m, a): by for m, a, by, _ in divided})


def _computed_repeats(
    ctx: Context, sharing: Sharing, query: set[tuple[str, str]], shared: dict[tuple[str, str], str]
) -> str | None:
    """A repeat count the code computes from attributes (`self.n_head // self.n_kv`): with
    the counts the plan divides (`query` by tp, `shared` by a head's shards or replicas), the
    formula must give each rank its own repeat, (H/K) / (tp/K), at every tp the sharing
    takes; why not, where it does not."""
    t = ctx.trace
    k = min(sharing.kv.values())
    for o in sorted(sharing.kv):
        formula = t.spans.repeat_formulas.get(o)
        if formula is None:
            continue
        times = t.spans.repeats[o][0]
        for tp in range(2, times * k + 1):
            if (times * k) % tp or not (k % tp == 0 or tp % k == 0):
                continue
            shards, replicas = min(tp, k), max(1, tp // k)
            divisor = {"tp": tp, "shards": shards, "replicas": replicas, None: 1}
            local = {
                read: value // divisor[shared.get(read, "tp" if read in query else None)]
                for read, value in values_read(formula).items()
            }
            got, want = evaluate(formula, local), times // replicas
            if got != want:
                return (
                    f"it repeats the key/value heads by {render(formula)} = {times}, which "
                    f"comes to {got} per rank at tp {tp} where {want} is needed"
                )
    return None


def _add(sharing: Sharing, module: str, attr: str, by: str, why: str) -> str | None:
    """One count divided by `by` of the key/value opener under `module`."""
    under = sorted(o for o in sharing.kv if inside(o, module) and o != module)
    if not module or not under:
        return (
            f"{attr} is read by {module or 'the model'}, which holds no key/value layer "
            "to name whose heads it counts"
        )
    of = under[0][len(module) + 1 :]
    entries = sharing.attributes.setdefault(module, [])
    entries.append(Divided((attr,), why, by=by, of=of))
    return None


def _width_cuts(ctx: Context, sharing: Sharing) -> str | None:
    """A fused opener cut at sizes computed from the width read off its output
    (`qkv.shape[-1] // (self.groups + 2)`): with key/value heads shared, a rank's width is
    not the whole's over tp, so each formula must give the rank its own piece's size at every
    tp past the key/value heads, with some of its attributes divided by the heads' replicas
    (a count of query heads per key/value head). Those are added to `sharing`; why not, if
    no such choice serves every formula."""
    t = ctx.trace
    for o in sorted(sharing.kv):
        cuts = {p: c for p, c in t.reads.width_cuts.items() if p[0] == o}
        if not cuts or o not in t.spans.kv_parts:
            continue
        k, parts = sharing.kv[o], t.spans.parts[o]
        unit = min(n for _, n in t.spans.kv_parts[o]) // k
        heads = t.spans.query_heads.get(o, (0,))[0]
        tps = [tp for tp in range(k + 1, heads + 1) if tp % k == 0 and heads % tp == 0]
        reads = sorted({r for expr, *_ in cuts.values() for r in values_read(expr)})
        found = None
        for n in range(len(reads) + 1):
            for chosen in itertools.combinations(reads, n):
                if all(
                    _gives_own(c, p, parts, unit, tp, k, chosen)
                    for p, c in cuts.items()
                    for tp in tps
                ):
                    found = chosen
                    break
            if found is not None:
                break
        if found is None:
            return (
                f"{relative([o])[o]} is cut at sizes computed from its width as read off the "
                "tensor, which no division of their attributes makes each rank's own with the "
                "key/value heads shared"
            )
        done = sharing.divided()
        for module, attr in found:
            if (module, attr) in done:
                continue  # a repeat count, divided by the replicas already
            refused = _add(
                sharing,
                module,
                attr,
                "replicas",
                f"its forward reads {attr} to compute the sizes {relative([o])[o]}'s output is "
                "cut at from its width; past the key/value heads each rank holds one, so the "
                "count of query heads it serves is divided by the ranks sharing it",
            )
            if refused:
                return refused
    return None


def _gives_own(
    cut: tuple[Any, int, int, int],
    piece: tuple[str, int, int],
    parts: tuple[int, ...],
    unit: int,
    tp: int,
    k: int,
    divided: tuple[tuple[str, str], ...],
) -> bool:
    """Whether a width formula gives rank 0 its own rows of `piece` at `tp`, with `divided`
    attributes divided by the heads' replicas (tp / k)."""
    expr, width, start, size = cut
    rows = own_order(parts, tp, unit)[0]
    local = sum(1 for r in rows if start <= r < start + size)
    want = sum(1 for r in rows if piece[1] <= r < piece[1] + piece[2])
    values = {read: v // (tp // k) for read, v in values_read(expr).items() if read in divided}
    return evaluate(expr, values, width=(width, local)) == want


def _heads(sharing: Sharing, sized: set[str]) -> int:
    """The key/value head count of the openers a count sized."""
    return min(sharing.kv[o] for o in sized if o in sharing.kv)


def _label(kv: dict[str, int], module: str) -> str:
    names = sorted(o[len(module) + 1 :] if module else o for o in kv if inside(o, module))
    return " and ".join(names) or "the region"
