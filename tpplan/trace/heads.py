"""What the tracer notes about attention heads as they pass: a layer viewed as one head,
which openers a head count counts, and grouped-query attention (which openers are its query
and key/value sides, and the counts that repeat the key/value heads).

Start at `note_grouped`. The per-op rules (rules.py) and the attention mode (attention.py)
call these where an op shows heads; what they note goes to the trace's `SpanFacts`
(record.py), for infer/shared_heads.py to decide whether key/value heads are shared.
"""

from __future__ import annotations

from typing import Any

from .counted import Counted
from .split import Split
from .trackers import Trackers

__all__ = ["heads_owners", "note_grouped", "note_repeat", "one_head"]


def one_head(st: Trackers, s: Split, shape: Any) -> Split:
    """A layer's whole output viewed as one head (`view(B, T, self.n_kv, self.head_dim)`
    with one key/value head, multi-query attention): the split moves from the features
    to the heads dim, one head of them, which tp ranks can only share whole. Told from a
    tensor merely given a dim of 1 by what the view was written with: the head count an
    attribute (or -1), the width an attribute."""
    asked = st.reads.asked[-1] if st.reads.asked else ()
    last = len(shape) - 1
    if (
        last < 1
        or s.dim != last
        or s.outer != 1
        or s.n * s.inner != shape[last]
        or shape[last - 1] != 1
        or len(asked) != len(shape)
        or not isinstance(asked[last], Counted)
        or not (isinstance(asked[last - 1], Counted) or asked[last - 1] == -1)
    ):
        return s
    return Split(last - 1, 1, 1, 1, s.sources)


def heads_owners(st: Trackers, s: Split) -> frozenset[str]:
    """The openers whose heads a count of `s`'s split digit counts: all its sources, but a
    key/value opener of grouped-query attention whose own head count is not the digit's.
    Attention's output carries the query heads, joined with the key/value openers' span:
    `view(B, T, self.n_head * hd)` on it counts the query heads only."""
    kv = st.trace.spans.kv_heads
    own = frozenset(src for src in s.sources if kv.get(src, s.n) == s.n)
    return own or s.sources


def note_grouped(
    st: Trackers, q: Split, kvs: list[Split], tensors: list[Any] | None = None
) -> dict[str, int]:
    """Query heads (`q`, H of them) meeting fewer key/value heads (`kvs`, K each, K < H):
    grouped-query attention, which pairs query head i with key/value head i // (H/K),
    consecutive groups, whether the model repeats the key/value heads first (`repeat_kv`:
    an expand then a merge, seen as K units of H/K) or leaves it to attention's
    `enable_gqa`. Records which openers are which side and the count a rank's repeat needs
    when tp/K ranks share each key/value head (record.py's `kv_heads`, `query_heads`,
    `repeats`, `unshared`); returns opener -> its own side's head count, empty where this
    is not such a pairing. `tensors`: the query's and the keys' and values' tensors, whose
    fused pieces tell them apart when one Linear made them all (`_fused_grouped`)."""
    spans = st.trace.spans
    k = kvs[0]
    kv = frozenset().union(*(x.sources for x in kvs))
    if tensors is not None and len(kv) == 1 and q.sources == kv:
        return _fused_grouped(st, q, k, tensors)
    # eager attention meets the values with weights of the queries and the keys: the keys
    # are a key/value side already
    queries = q.sources - spans.kv_heads.keys()
    if k.n >= q.n or q.n % k.n or kv & queries or not queries:
        return {}
    group = q.n // k.n
    if k.inner == 1:
        # `enable_gqa`: the model's code may still repeat by an attribute on other paths
        # (transformers does under a mask); one that holds the group size, read by the
        # running forward, is divided with the sharing, as that repeat would need
        note_repeat(st, kv, group, "attention groups its heads by", needed=False)
    elif k.inner != group or any(spans.repeats.get(s, (0,))[0] != group for s in kv):
        for s in kv:
            spans.unshared.setdefault(s, "its heads are repeated other than by the groups")
    for s in kv:
        spans.kv_heads[s] = k.n
    for s in queries:
        spans.query_heads[s] = (q.n, kv | spans.query_heads.get(s, (0, frozenset()))[1])
    return {**dict.fromkeys(kv, k.n), **dict.fromkeys(queries, q.n)}


def _fused_grouped(st: Trackers, q: Split, k: Split, tensors: list[Any]) -> dict[str, int]:
    """Grouped-query attention whose query and key/value heads are pieces of one fused
    Linear (q|k|v of unequal pieces): the pieces the keys and values hold are recorded as its
    key/value side (record.py's `kv_parts`), the rest as its queries."""
    spans = st.trace.spans
    (src,) = q.sources
    q_piece, *kv_pieces = (st.splits.piece_of(t) for t in tensors)
    known = [p for p in kv_pieces if p]
    if not q_piece or len(known) != len(kv_pieces) or q_piece in known:
        return {}
    if k.n >= q.n or q.n % k.n:
        return {}
    group = q.n // k.n
    if k.inner == 1:
        note_repeat(st, q.sources, group, "attention groups its heads by", needed=False)
    elif k.inner != group or spans.repeats.get(src, (0,))[0] != group:
        spans.unshared.setdefault(src, "its heads are repeated other than by the groups")
    spans.kv_parts[src] = spans.kv_parts.get(src, frozenset()) | {(p[1], p[2]) for p in known}
    spans.kv_heads[src] = k.n
    spans.query_heads[src] = (q.n, frozenset({src}))
    return {src: q.n}


def note_repeat(
    st: Trackers,
    sources: frozenset[str],
    times: int,
    doing: str,
    *,
    needed: bool,
    at: int | None = None,
) -> None:
    """Heads of `sources` repeated `times` times each (or grouped so, by attention): the
    attribute of the running forward holding `times` must shrink with the heads' sharing
    among ranks (record.py's `repeats`). Several make that sharing unproven, and so does
    none where the count is `needed` (an expand's; attention groups by the shapes). A count
    the code computed from attributes (`self.n_head // self.n_kv`, seen as a `Counted` the
    repeat at output dim `at` was written with) is held by no attribute: its formula is
    kept instead, for infer to evaluate with the counts the plan divides."""
    spans = st.trace.spans
    given = st.reads.count_given(at, times) if at is not None else None
    read = given.direct() if isinstance(given, Counted) else None
    if isinstance(given, Counted) and read is None:
        for src in sources:
            spans.repeats[src] = (times, None)
            spans.repeat_formulas[src] = given.expr
        return
    held: set[tuple[str, str]] = (
        {read}  # the attribute itself, whatever else holds the same value
        if read is not None
        else {(m, a) for m, a, v in st.reads.frames[-1] if v == times}
    )
    for src in sources:
        if len(held) == 1:
            ((module, attr),) = held
            spans.repeats[src] = (times, (module, attr, times))
            continue
        spans.repeats.setdefault(src, (times, None))
        if held or needed:
            which = (
                f"several attributes read in forward hold it ({', '.join(sorted(a for _, a in held))})"
                if held
                else "no module attribute read in forward holds it"
            )
            spans.unshared.setdefault(src, f"{doing} {times}, and {which}")
