"""Spans of Linears: the openers and closers that exchanged split tensors (trace/record.py
defines the words), found from the trace's links and split or kept whole as one.

Start at `decide_span`. A span of 3-D expert weights is decided in experts.py instead;
the modules beside the Linears whose parameters meet the split (per-head norms) in
span_params.py; heads tp does not divide, split unevenly, in uneven_heads.py.
"""

from __future__ import annotations

import math

from torch import nn

from ..plan.styles import ColwiseRule, RowwiseRule
from ..trace import Trace
from ..trace.record import ChannelUse
from .context import Context, Decided, Found
from .decision import Divided, decided
from .names import PLAIN_OPS, join, join_names, relative
from .shared_heads import Sharing, kv_sharing, summed_refusal
from .span_params import param_holders, style_param_holders
from .uneven_heads import Uneven, split_unevenly, uneven_heads

__all__ = ["decide_span", "find_spans", "split_unit"]


def find_spans(trace: Trace) -> list[list[str]]:
    """Openers and closers joined by the split tensors they exchanged (union-find)."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for name in list(trace.spans.openers) + list(trace.spans.closers):
        root(name)
    for group in trace.spans.links:
        first, *rest = sorted(group)
        for other in rest:
            parent[root(other)] = root(first)
    out: dict[str, list[str]] = {}
    for name in parent:
        out.setdefault(root(name), []).append(name)
    return list(out.values())


def split_unit(trace: Trace, openers: list[str]) -> int:
    """The gcd of every split size the openers' features met (their heads, fused pieces);
    tp must divide it. 0 without openers."""
    if not openers:
        return 0
    return math.gcd(*(trace.spans.units.get(o, trace.spans.openers[o]) for o in openers))


def decide_span(ctx: Context, so_far: Decided, members: list[str]) -> Found:
    """A span of Linears is split when every split ended at a closer that contracts it,
    nothing broke it, no weight in it is shared, and tp divides its smallest head count:
    openers colwise, closers rowwise, the head counts its views read divided, and modules
    whose parameters act on the split tensors (per-head norms) replicate_grad_sum (or
    split_params, one entry per head). Else every member is kept whole, with the reasons."""
    t = ctx.trace
    openers = [m for m in members if m in t.spans.openers]
    closers = [m for m in members if m in t.spans.closers]
    short = relative(members)
    reasons = _member_reasons(ctx, members, short)
    if any(o in t.spans.at_output for o in openers):
        reasons.append("the split reaches the model output")
    if openers and not closers and not reasons:
        reasons.append("no Linear contracts its output features")
    units = split_unit(t, openers)
    counts = {c for o in openers for c in t.reads.counts.get(o, ())}
    product_counts, product_reasons = _product_counts(ctx, openers, counts)
    counts |= product_counts
    sharing = kv_sharing(ctx, openers, counts)
    shared = sharing if sharing is not None and sharing.refused is None else None
    uneven: Uneven | None = None
    if openers and units % ctx.tp and not (shared is not None and shared.fits(ctx.tp)):
        # heads (a model's views cut the features so) may split unevenly
        tried = uneven_heads(ctx, openers, closers, sharing, counts)
        if isinstance(tried, Uneven):
            uneven = tried
        else:
            unshared = (
                f"; its key/value heads cannot be shared among ranks ({sharing.refused})"
                if sharing is not None and sharing.refused
                else ""
            )
            why_not = tried
            unevenly = f"; nor can its heads split unevenly ({why_not})" if why_not else ""
            # with its key/value heads shared, only its query heads had to divide
            what = (
                f"{shared.query_unit} query heads"
                if shared is not None and shared.query_unit % ctx.tp
                else f"{units} {_blocks(ctx, openers, units)}"
            )
            reasons.append(f"tp {ctx.tp} does not divide its {what}{unshared}{unevenly}")
    for o in openers:
        # a view counting heads with a constant (`self.num_heads + 2`) must count key/value
        # heads every rank holds whole
        summed = summed_refusal(ctx, o, shared.kv.get(o) if shared is not None else None)
        if summed:
            reasons.append(f"{short[o]}: {summed}")
    holders = param_holders(ctx, set(openers), reasons)
    if shared is not None:
        # key/value counts are divided by the heads' shards, not the tp size
        counts = {c for c in counts if c[:2] not in shared.divided()}
    if uneven is None:
        # heads split unevenly give each count each rank's own (uneven_heads.py checked it)
        reasons += _count_reasons(ctx, counts)
    reasons += product_reasons
    found = Found()
    if reasons:
        for m in members:
            found.kept[m] = f"kept whole: {'; '.join(dict.fromkeys(reasons))}"
        return found
    if uneven is not None:
        split_unevenly(ctx, found, so_far, uneven, openers, closers, short)
        style_param_holders(ctx, found, holders, openers, short)
        return found
    found.split_spans.append((openers, closers))
    _open(ctx, found, openers, closers, short, units, shared)
    _close(ctx, found, openers, closers, short)
    # (a module's attributes may hold what earlier spans divided)
    found.attributes = {m: so_far.attributes.get(m, ()) for m, _, _ in counts}
    if shared is not None:
        found.attributes.update({m: so_far.attributes.get(m, ()) for m in shared.attributes})
    _divide_counts(found, counts, openers, short, t.reads.groups)
    if shared is not None:
        for module, entries in shared.attributes.items():
            found.attributes[module] = (*found.attributes[module], *entries)
    style_param_holders(ctx, found, holders, openers, short)
    return found


def _blocks(ctx: Context, openers: list[str], units: int) -> str:
    """What the `units` indivisible blocks of a span's features are, for its reason: the
    words of the opener whose split sets them (the smallest)."""
    t = ctx.trace
    vocabs = {m.num_embeddings for m in ctx.modules.values() if isinstance(m, nn.Embedding)}
    words = []
    for o in openers:
        features, parts = t.spans.openers[o], t.spans.parts.get(o)
        if t.spans.units.get(o, features) != units:
            continue
        if units == features:
            vocab = o in t.spans.at_output and features in vocabs
            words.append("vocab entries" if vocab else "features")
        elif units == t.spans.kv_heads.get(o):
            words.append("key/value heads")
        elif units == t.spans.heads.get(o):
            words.append("heads")
        elif units == t.spans.groups.get(o):
            words.append("channel groups (of a GroupNorm)")
        elif parts is not None and units == len(parts):
            words.append("fused pieces")
        elif parts is not None and {units} == set(parts):
            words.append("features per fused piece")
    return min(words, default="indivisible blocks")


def _member_reasons(ctx: Context, members: list[str], short: dict[str, str]) -> list[str]:
    """Why members cannot take their role: a split that broke, a layer that misfits, a
    weight tied or used outside its own call."""
    t = ctx.trace
    reasons: list[str] = []
    for m in members:
        for r in t.spans.broken.get(m, []):
            reasons.append(f"{short[m]}'s split ends at {r}")
        if m in t.spans.misfits:
            reasons.append(f"{short[m]}: {t.spans.misfits[m]}")
        if m in ctx.tied:
            reasons.append(
                f"{short[m]}'s weight is shared with {join(ctx.tied[m])} (tied); sharding would untie it"
            )
        elif ctx.used_outside(m):
            reasons.append(f"{short[m]}'s weight is also used outside its own forward")
    return reasons


def _count_reasons(ctx: Context, counts: set[tuple[str, str, int]]) -> list[str]:
    """Why a head count the span's views read cannot be divided."""
    t = ctx.trace
    reasons: list[str] = []
    for module, attr, value in sorted(counts):
        if (module, attr) in t.reads.unsplit_sizes:
            reasons.append(
                f"{attr} = {value} sizes the split features and also tensors that are not "
                "split, so it cannot be divided"
            )
        elif (module, attr) in t.reads.cut_terms & t.reads.beside_sizes:
            reasons.append(
                f"{attr} = {value} is a term of a size the fused features are cut at, and also "
                "sizes the dims beside the split features, which each rank keeps whole, so it "
                "cannot be divided"
            )
        elif (module, attr) in t.reads.width_terms:
            reasons.append(
                f"{attr} = {value} is a term of a size the fused features are cut at that is "
                "computed from their width as read off the tensor (each rank's own), so it "
                "cannot be divided too"
            )
        elif not module:
            reasons.append(
                f"the model's own forward reads {attr} = {value} to size the split features, "
                "and a plan divides attributes of submodules only"
            )
        elif value % ctx.tp and (module, attr) in t.reads.groups:
            doing = {
                "norm": "a GroupNorm reads {} = {} to normalize the split channels in groups",
                "depthwise": "a depthwise convolution reads {} = {}, one group per split channel",
                "grouped": "a grouped convolution reads {} = {} to convolve the split channels "
                "in groups",
            }[t.reads.groups[(module, attr)]]
            reasons.append(f"{doing.format(attr, value)}, which tp {ctx.tp} does not divide")
        elif value % ctx.tp:
            # not always heads: a count of query heads per key/value head, of fused pieces
            reasons.append(
                f"a view reads {attr} = {value} to size the split features, which tp "
                f"{ctx.tp} does not divide"
            )
    return reasons


def _product_counts(
    ctx: Context, openers: list[str], counts: set[tuple[str, str, int]]
) -> tuple[set[tuple[str, str, int]], list[str]]:
    """The head counts of fused cuts written as products of attributes (`self.n_head *
    self.head_dim`), which the plan divides, and why any cannot be: exactly one factor of
    each product is divided, the head count a view reads or, where the views read none (a
    view with -1), the one factor no view keeps whole; the others stay as they are."""
    t = ctx.trace
    counted = {(m, a) for m, a, _ in counts} | {
        (m, a) for m, a, _ in (c for cs in t.reads.counts.values() for c in cs)
    }
    found: set[tuple[str, str, int]] = set()
    reasons = []
    for o in openers:
        for term in sorted(t.reads.products.get(o, ())):
            heads = [f for f in term if f[:2] in counted]
            if not heads:
                heads = [f for f in term if f[:2] not in t.reads.beside_sizes]
            if len(heads) == 1:
                found.add(heads[0])
                continue
            said = " * ".join(a for _, a, _ in term)
            which = "none" if not heads else ", ".join(a for _, a, _ in heads)
            reasons.append(
                f"it cuts the fused features at {said}, a product of attributes of which "
                "exactly one must be a head count (one its views read, or the one they keep "
                f"not whole) to be divided ({which} is)"
            )
    return found, reasons


def _open(
    ctx: Context,
    found: Found,
    openers: list[str],
    closers: list[str],
    short: dict[str, str],
    units: int,
    sharing: Sharing | None = None,
) -> None:
    """Openers colwise; `why` names the ops the split passed and the closers that end it.
    With `sharing`, the key/value openers of grouped-query attention share their heads
    among ranks past their count."""
    t = ctx.trace
    to = join_names([short[c] for c in closers])
    # `to` names the closers: the evidence a reviewer checks against the model's forward
    verb = "contracts" if len(closers) == 1 else "contract"
    inners = {t.spans.closers[c].inner for c in closers}
    for o in openers:
        ops = sorted(t.spans.ops.get(o, set()) - PLAIN_OPS)
        path = f"through {', '.join(ops)} to {to}" if ops else f"to {to}"
        partners = [short[p] for p in openers if p != o]
        with_partners = f" (with the outputs of {join_names(partners)})" if partners else ""
        what, it, head_dim = _output_features(ctx, o, inners)
        heads = t.spans.heads.get(o)
        need = (
            f"; tp must divide {units} (the region's smallest head count)"
            if heads and units < heads
            else ""
        )
        kv = sharing.kv.get(o) if sharing is not None else None
        if sharing is not None:
            need = _shared_need(sharing, kv, fused=o in t.spans.kv_parts)
        parts = t.spans.parts.get(o)
        found.rules[o] = decided(
            ColwiseRule,
            f"{what} {path}{with_partners}, which {verb} {it} on its input dim (rowwise){need}",
            head_dim=head_dim,
            parts=list(parts) if parts is not None else None,
            transposed=(o in t.layers.linears and t.layers.linears[o][2]) or None,
            replicate_heads=kv is not None or None,
        )


def _shared_need(sharing: Sharing, kv: int | None, *, fused: bool = False) -> str:
    """What tp sizes a span with shared key/value heads takes, for one opener's `why`."""
    if fused and kv is not None:
        # q|k|v in one Linear: its query pieces split as any, its key/value pieces shared
        each = "one key/value head" if kv == 1 else f"{kv} key/value heads"
        return (
            f"; its key and value pieces hold {each}, each serving consecutive query heads: "
            f"tp must divide {sharing.query_unit} (its query heads) and divide {kv} or be a "
            "multiple of it, each key/value head then whole on the ranks holding its query "
            "heads; each rank computes with a copy of its own rows of the weight (a plain "
            "shard of the original), the gradient of a shared head summed over its ranks"
        )
    if kv is None:
        return (
            f"; tp must divide {sharing.query_unit} (its query heads; the key/value heads "
            "are shared past their count)"
        )
    if kv == 1:
        return (
            "; its one key/value head serves every query head (multi-query attention): it "
            "stays whole on every rank, its gradient summed over them"
        )
    return (
        f"; its {kv} key/value heads each serve consecutive query heads: tp must divide {kv}, "
        f"or be a multiple of it, each head then whole on the tp/{kv} ranks holding its "
        "query heads, its gradient summed over them"
    )


def _output_features(ctx: Context, o: str, inners: set[int]) -> tuple[str, str, int | None]:
    """How an opener's output features are cut (fused pieces, heads, or neither): the words
    for `why`, the pronoun for them, and the head size its rule records."""
    t = ctx.trace
    features = t.spans.openers[o]
    heads = t.spans.heads.get(o)
    head_dim = features // heads if heads and features % heads == 0 else None
    parts = t.spans.parts.get(o)
    if parts is not None:
        # the pieces are cut apart before any view, so their head size shows where
        # they meet again: the closer's input, merged from (heads, head_dim)
        (inner,) = inners if len(inners) == 1 else (1,)
        head_dim = inner if inner > 1 and all(p % inner == 0 for p in parts) else None
        what = (
            f"its {features} output features are {len(parts)} fused pieces "
            f"({' | '.join(map(str, parts))}), cut apart in forward; each rank holds its "
            "own slice of every piece, and they flow"
        )
        return what, "them", head_dim
    if head_dim is not None:
        (inner,) = inners if len(inners) == 1 else (head_dim,)
        pieces = head_dim // inner if inner > 1 and head_dim % inner == 0 else 1
        per_head = (
            f", each head's {pieces} fused pieces of {inner} side by side"
            if 2 <= pieces <= 4
            else ""
        )
        viewed = "viewed as one head" if heads == 1 else f"split into {heads} heads"
        return (
            f"output {viewed} of {head_dim} by a view{per_head}; it flows",
            "it",
            head_dim,
        )
    return f"its {features} output features flow", "them", None


def _close(
    ctx: Context, found: Found, openers: list[str], closers: list[str], short: dict[str, str]
) -> None:
    """Closers rowwise: their outputs are partial sums, one all-reduce."""
    by = join_names([short[o] for o in openers])
    for c in closers:
        s = ctx.trace.spans.closers[c]
        head_dim = s.inner if s.inner > 1 else None
        what = f"{s.n} heads of {s.inner}" if head_dim else f"{s.n} features"
        found.rules[c] = decided(
            RowwiseRule,
            f"contracts the features split by {by} ({what}) on its input dim; its output is a "
            "partial sum, one all-reduce",
            head_dim=head_dim,
            transposed=ctx.trace.layers.linears[c][2] or None,
        )


def _divide_counts(
    found: Found,
    counts: set[tuple[str, str, int]],
    openers: list[str],
    short: dict[str, str],
    groups: dict[tuple[str, str], ChannelUse],
) -> None:
    """The head counts (and fused cut sizes, the groups of a GroupNorm or a depthwise
    convolution) the span's ops read are divided by tp."""
    for module, attr, _ in sorted(counts):
        entries = found.attributes[module]
        by_tp = [d for d in entries if d.by is None]
        attrs = tuple(sorted({*(by_tp[0].attrs if by_tp else ()), attr}))
        of = join(sorted(short[o] for o in openers))
        reads = f"its forward reads {', '.join(attrs)}"
        uses = {groups.get((module, a)) for a in attrs}
        if uses == {"norm"}:
            why = (
                f"{reads} to normalize the channels split by {of} in groups; each rank holds "
                "whole groups and normalizes its own, so it is divided by the tp size"
            )
        elif uses == {"depthwise"}:
            why = (
                f"{reads} to convolve each channel split by {of} alone (a depthwise "
                "convolution, one group per channel); each rank convolves its own channels, "
                "so it is divided by the tp size"
            )
        elif uses == {"grouped"}:
            why = (
                f"{reads} to convolve the channels split by {of} in groups (a grouped "
                "convolution); each rank holds whole groups and convolves its own, so it is "
                "divided by the tp size"
            )
        else:
            why = (
                f"{reads} to view or cut the split features of {of} (with -1 or the rest for "
                "other dims); each rank must use its own share, so it is divided by the tp size"
            )
        divided = Divided(attrs, why)
        found.attributes[module] = (divided, *(d for d in entries if d.by is not None))
