"""Attention heads tp does not divide: whether a span that tp would otherwise leave whole
(28 query heads at tp 8, 25 at tp 2) splits its heads unevenly instead, each rank whole
heads of its own key/value heads (compile/uneven_heads.py lays them out), and what the
plan then says.

Start at `uneven_heads`. It holds, each checked on the trace, where:
- every opener is a Linear whose features the model's views cut into whole heads: its
  heads alone, heads of q, k and v side by side (GPT-NeoX), or fused pieces each of whole
  heads (`parts`: equal pieces, GPT-2's `c_attn`; a query piece and key/value pieces of
  grouped heads, Phi-3's `qkv_proj`); each layer may have a head size of its own;
- the query heads (H) are all of one count, tp does not divide them, and with grouped-query
  attention (shared_heads.py's `Sharing`, not refused) the key/value heads number K = H/g;
- tp has a split into whole heads of whole or shared key/value heads (`head_shares`):
  past K the key/value openers share their heads (replicate_heads, as for even splits);
- every closer contracts H heads;
- every count the forward reads comes to a whole number on every rank (a head count, a
  width of whole heads: its share of the query heads; a repeat count: the query heads each
  of the rank's key/value heads serves), and the module reading it holds a query opener,
  which its attribute rule names (`uneven`); a repeat computed in forward from counts
  gives each rank its own;
- nothing else in the span holds one entry per head (a per-head norm's weight, a bias
  per head): those split with DTensor's even shares, which whole heads of several counts
  per rank do not match;
- no LoRA wrapper or sequence parallelism hands its layers what uneven heads cannot take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._runtime.adapters import lora_layers
from ..compile.uneven_heads import HeadShare, head_shares, own_share
from ..errors import TpplanError
from ..plan.styles import ColwiseRule, RowwiseRule
from ..trace.counted import Expr, evaluate, values_read
from .context import Context, Decided, Found
from .decision import Divided, decided
from .names import inside, join_names
from .shared_heads import Sharing

__all__ = ["Uneven", "split_unevenly", "uneven_heads"]


@dataclass
class Uneven:
    """A span whose heads split unevenly at the context's tp."""

    heads: int
    """H: the query openers' heads."""
    group: int
    """g: the query heads each key/value head serves (1 without grouping)."""
    head_dims: dict[str, int]
    """Layer -> the size of its heads (an opener's output features per head, a closer's
    input features per head: GPT-NeoX's fused q|k|v holds 3 pieces of a head side by side)."""
    query: list[str]
    """The openers of H heads (every opener, without grouping)."""
    kv: list[str]
    """The key/value openers of grouped-query attention."""
    shares: list[HeadShare]
    attributes: dict[str, list[Divided]] = field(default_factory=dict)
    """Module -> the counts it reads, each rank's own value (`uneven` names its query opener)."""

    @property
    def shared(self) -> bool:
        """The key/value heads are shared past their count (replicate_heads)."""
        return len(self.shares) > self.heads // self.group


def uneven_heads(
    ctx: Context,
    openers: list[str],
    closers: list[str],
    sharing: Sharing | None,
    counts: set[tuple[str, str, int]],
) -> Uneven | str | None:
    """The uneven split of a span's heads at ctx.tp, or why there is none; None where it
    does not apply: no heads, or query heads tp divides (only key/value heads it does not:
    shared_heads.py and the DTensor regions keep the query heads even there, where whole
    groups per rank would not)."""
    t = ctx.trace
    spans = t.spans
    # a fused q|k|v of grouped heads (its key/value pieces in `kv_parts`) is a query opener
    # and a key/value one at once
    fused = {o for o in openers if o in spans.kv_parts}
    kv_openers = set(sharing.kv) - fused if sharing is not None else set()
    of = {o: _heads_of(ctx, o, sharing) for o in openers}
    query_heads = [n for o, n in of.items() if n and o not in kv_openers]
    if not query_heads or all(h % ctx.tp == 0 for h in query_heads):
        return None
    if not ctx.split_unevenly:
        return (
            "the plan is for every size of a family (--family), whose head counts differ; "
            "infer one for a model and tp size to split them unevenly"
        )
    bases = {a.base for a in lora_layers(ctx.model).values()}
    if bases & {*openers, *closers}:
        return "a LoRA adapter wraps one of its layers, and uneven heads take plain layers only"
    if ctx.sequence_parallel:
        # its layers would take the stream split over the sequence as DTensors, and heads
        # split unevenly have no DTensor layout
        return "sequence parallel hands its layers DTensors, which uneven heads cannot take"
    if any(o in spans.parts and not of[o] for o in openers):
        return "a fused layer's pieces are not whole heads of its query and key/value heads"
    if any(o not in t.layers.linears for o in openers):
        return "an opener is not a Linear"
    kv = sorted(sharing.kv) if sharing is not None else []
    if sharing is not None and sharing.refused:
        return f"its key/value heads cannot be shared ({sharing.refused})"
    query = [o for o in openers if o not in kv_openers]
    heads = {of[o] for o in query}
    if not query or len(heads) != 1 or None in heads:
        return "its query openers' features are not all cut into heads of one count"
    (h,) = heads
    assert h is not None
    own = {o: of[o] or (sharing.kv.get(o) if sharing else None) for o in openers}
    if any(
        not own[o] or spans.units.get(o, spans.openers[o]) != own[o] for o in set(openers) - fused
    ):
        return "its openers' splits are not their whole heads"
    k = {sharing.kv[o] for o in kv} if sharing is not None else {h}
    if len(k) != 1 or h % next(iter(k)):
        return "its key/value openers hold unequal head counts"
    group = h // next(iter(k))
    try:
        shares = head_shares(h, group, ctx.tp)
    except TpplanError as e:
        return str(e).split(":")[0]
    head_dims = _head_dims(ctx, openers, own, fused)
    if head_dims is None:
        return "its fused pieces' heads are cut finer than whole heads"
    for c in closers:
        s = spans.closers[c]
        if s.n != h or s.inner <= 1:
            return f"a closer contracts {s.n} blocks of {s.inner}, not its {h} query heads"
        head_dims[c] = s.inner
    for p, sources in t.params.in_span.items():
        if sources & set(openers) and p in t.params.split_vectors:
            return f"{p} holds one entry per head, which whole heads split unevenly do not match"
    found = Uneven(h, group, head_dims, query, kv, shares)
    refused = _attributes(ctx, found, sharing, counts)
    return refused or found


def _attributes(
    ctx: Context, found: Uneven, sharing: Sharing | None, counts: set[tuple[str, str, int]]
) -> str | None:
    """Fill `found.attributes`: each count each rank's own; why not, where one is not."""
    kv_divided = sharing.divided() if sharing is not None else set()
    entries: dict[tuple[str, str], tuple[str, str]] = {}  # (module, attr) -> (by, why)
    for module, attr, value in sorted(counts):
        if (module, attr) in kv_divided:
            continue
        reads = f"its forward reads {attr} = {value} to view or cut the split heads"
        entries[(module, attr)] = ("tp", reads)
        if not _whole_everywhere(found, "tp", value):
            return f"{attr} = {value} has no whole share of the heads on every rank"
    if sharing is not None:
        for module, divided in sharing.attributes.items():
            for d in divided:
                for attr in d.attrs:
                    by = d.by or "tp"
                    whole = _value(ctx, module, attr)
                    if whole is None or not _whole_everywhere(found, by, whole):
                        return f"{attr} has no whole value of its {by} on every rank"
                    reads = f"its forward reads {attr} = {whole} for the key/value heads"
                    entries[(module, attr)] = (by, reads)
    for o in found.kv:
        formula = ctx.trace.spans.repeat_formulas.get(o)
        if formula is not None and not _repeats_own(found, formula, entries):
            return "the repeat of the key/value heads it computes in forward is no rank's own"
    for (module, attr), (by, why) in sorted(entries.items()):
        whole = _value(ctx, module, attr)
        if whole is not None and all(_own(found, s, by, whole) == whole for s in found.shares):
            continue  # every rank's own is the whole value (whole groups on every rank)
        under = sorted(o for o in found.query if inside(o, module) and o != module)
        if not module or not under:
            return f"{attr} is read by {module or 'the model'}, which holds no query layer to name"
        words = {
            "tp": "each rank's share of the query heads",
            "shards": "each rank's count of key/value heads",
            "replicas": "the query heads each of the rank's key/value heads serves",
        }[by]
        found.attributes.setdefault(module, []).append(
            Divided(
                (attr,),
                f"{why}; the heads split unevenly, so it becomes {words} (rank by rank)",
                by=None if by == "tp" else by,
                of=None if by == "tp" else _kv_of(found, module),
                uneven=under[0][len(module) + 1 :],
            )
        )
    return None


def _head_dims(
    ctx: Context, openers: list[str], own: dict[str, int | None], fused: set[str]
) -> dict[str, int] | None:
    """Opener -> the size of its heads: of one piece of a fused layer (its equal pieces, or
    its query piece of H heads beside key/value pieces of H/g); None where the trace cut a
    fused layer's heads finer than whole."""
    spans = ctx.trace.spans
    out = {o: spans.openers[o] // (own[o] or 1) // len(spans.parts.get(o, (0,))) for o in openers}
    for o in fused:
        out[o] = max(spans.parts[o]) // (own[o] or 1)
        if any((n // out[o]) % spans.units.get(o, 1) for n in spans.parts[o]):
            return None
    return out


def _heads_of(ctx: Context, o: str, sharing: Sharing | None) -> int | None:
    """The heads an opener's views cut its features into; for a fused layer of equal pieces
    (q|k|v cut apart, then each viewed as heads: GPT-2's c_attn), each piece's: the split's
    unit, where it cuts every piece into whole heads; for q|k|v of grouped heads (Phi-3's),
    its query piece's, whose size is what the key/value pieces leave, in heads of theirs.
    None where neither."""
    spans = ctx.trace.spans
    parts = spans.parts.get(o)
    if parts is None:
        return spans.heads.get(o)
    if o in spans.kv_parts:
        kv = sharing.kv.get(o) if sharing is not None else None
        sizes = {n for _, n in spans.kv_parts[o]}
        query = sum(parts) - sum(n for _, n in spans.kv_parts[o])
        if not kv or len(sizes) != 1 or next(iter(sizes)) % kv:
            return None
        head_dim = next(iter(sizes)) // kv
        return query // head_dim if query % head_dim == 0 and query in parts else None
    unit = spans.units.get(o)
    # whole heads of more than one feature in every piece (a gate|up pair's features are
    # no heads)
    if len(set(parts)) != 1 or not unit or parts[0] % unit or parts[0] // unit < 2:
        return None
    return unit


def _kv_of(found: Uneven, module: str) -> str | None:
    under = sorted(o for o in found.kv if inside(o, module) and o != module)
    return under[0][len(module) + 1 :] if under else None


def _own(found: Uneven, share: HeadShare, by: str, value: int) -> float:
    """A count's value on the rank of `share` (compile/shard.py's `own_attributes`)."""
    own, whole = own_share(share, by, found.heads, found.group)
    return value * own / whole


def _whole_everywhere(found: Uneven, by: str, value: int) -> bool:
    return all(_own(found, s, by, value).is_integer() for s in found.shares)


def _value(ctx: Context, module: str, attr: str) -> int | None:
    """A count's whole value on the model (a dotted one on an object the module holds)."""
    # imported here: compile/shard.py brings the styles' modules, which a plan with no
    # heads split unevenly never needs at infer time
    from ..compile.shard import attribute_value

    found = attribute_value(ctx.modules[module], attr) if module in ctx.modules else None
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def _repeats_own(
    found: Uneven, formula: Expr, entries: dict[tuple[str, str], tuple[str, str]]
) -> bool:
    """A repeat count computed in forward gives every rank the query heads each of its
    key/value heads serves."""
    for s in found.shares:
        local = {}
        for read, value in values_read(formula).items():
            by = entries.get(read, (None, ""))[0]
            local[read] = value if by is None else int(_own(found, s, by, value))
        if evaluate(formula, local) != s.count // s.kv_count:
            return False
    return True


def split_unevenly(
    ctx: Context,
    found: Found,
    so_far: Decided,
    uneven: Uneven,
    openers: list[str],
    closers: list[str],
    short: dict[str, str],
) -> None:
    """A span whose heads tp does not divide, split unevenly (uneven_heads.py): the query
    openers colwise with uneven heads of their group, the key/value ones shared past their
    count (replicate_heads) or split unevenly in whole heads, the closers rowwise alike, the
    counts read each rank's own."""
    found.split_spans.append((openers, closers))
    h, g, tp = uneven.heads, uneven.group, ctx.tp
    d = uneven.head_dims
    counts = sorted({s.count for s in uneven.shares}, reverse=True)
    each = " or ".join(map(str, counts))
    groups = "one group" if h == g else f"{h // g} groups"
    grouped = f" in {groups} of {g} (one per key/value head)" if g > 1 else ""
    how = (
        f"tp {tp} does not divide its {h} heads{grouped}, so they split unevenly: each rank "
        f"holds {each} whole heads"
        + (", of its own key/value head" if uneven.shared else "")
        + " and computes with a copy of their rows (the weight a plain shard of the original)"
    )
    to = join_names([short[c] for c in closers])
    group = g if g > 1 else None
    for o in openers:
        if o in uneven.kv and uneven.shared and o not in uneven.query:
            found.rules[o] = decided(
                ColwiseRule,
                f"its {uneven.heads // g} key/value heads each serve {g} query heads; {how}, "
                "so each key/value head stays whole on the ranks holding its query heads, its "
                "gradient summed over them",
                head_dim=d[o],
                replicate_heads=True,
            )
            continue
        parts = ctx.trace.spans.parts.get(o)
        found.rules[o] = decided(
            ColwiseRule,
            f"its output features are heads of {d[o]}"
            + (f" in fused pieces ({' | '.join(map(str, parts))})" if parts else "")
            + f" that {to} contracts (rowwise); {how}",
            head_dim=d[o],
            parts=list(parts) if parts else None,
            uneven=True,
            group=group if o in uneven.query else None,
            transposed=ctx.trace.layers.linears[o][2] or None,
        )
    for c in closers:
        found.rules[c] = decided(
            RowwiseRule,
            f"contracts the heads split by {join_names([short[o] for o in openers])} on its "
            f"input dim (heads of {d[c]}); {how}; its output is a partial sum, one all-reduce",
            head_dim=d[c],
            uneven=True,
            group=group,
            transposed=ctx.trace.layers.linears[c][2] or None,
        )
    found.attributes = {m: so_far.attributes.get(m, ()) for m in uneven.attributes}
    for module, entries in uneven.attributes.items():
        found.attributes[module] = (*found.attributes[module], *entries)
