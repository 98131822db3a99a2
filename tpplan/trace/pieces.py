"""The pieces of a fused layer's output features (q|k|v, gate|up) and how the model's code
cuts them: the tracer's rules for a view with a count of pieces, a slice and a split along
the split dim call here.

Sharded, a fused layer stores each piece's rank-r slice next to the others' (`parts` in the
plan), so rank r's shard is [q_r, k_r, v_r]. The code finds those pieces on a shard only
where it cuts at sizes the plan can divide by the tp size: equal pieces by count, sizes
read from module attributes (or sums of them), or sizes computed from the width it cuts.
Each tensor's piece is kept in `st.splits.pieces`; a cut makes the layer's `parts` finer
(`_carve_at`).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from .._runtime.torch_compat import tree_leaves
from .counted import (
    Counted,
    Expr,
    attributes_in,
    linear_terms,
    product_terms,
    scaled_reads,
    shrinks_with_width,
)
from .ops import RESHAPES, Op
from .split import Split, SplitEnds, carved, norm_dim, reshape
from .trackers import Trackers
from .trackers.dense import Piece

__all__ = ["as_pieces", "cut", "piece_indexed", "piece_sliced", "unstacked"]


RESHAPES_KEEPING = set(RESHAPES)


def as_pieces(st: Trackers, op: Op, s: Split) -> Split:
    """A fused layer's output, or one piece of it, viewed with a fixed count of pieces before
    the rest (timm's `reshape(B, N, 3, self.num_heads, self.head_dim)`, then `unbind` of q,
    k, v; `kv.unflatten(-1, (2, self.n_kv, self.head_dim))` of a k|v piece cut off a q|k|v
    output): its features are that many pieces (`parts` in the plan, each rank its slice of
    every piece), so the split moves to the dims carved out of one piece and the pieces' dim
    stays whole. A count equal to an attribute read just before is the heads' (a layout per
    head), unless the next dim holds the same count: then which is which cannot be told."""
    if len(s.sources) != 1 or s.outer != 1 or s.inner != 1:
        return s
    (src,) = s.sources
    x, features = op.args[0], s.n
    piece = st.splits.piece_of(x)
    if piece is None or (piece is False and st.trace.spans.openers.get(src) != features):
        return s  # not the layer's output (or one piece of it) as it came: cut, viewed, merged
    if piece and piece[2] != features:
        return s
    out = list(op.out.shape)
    pieces = carved(out, reshape(s, tuple(x.shape), tuple(out)).dim, features)
    if len(pieces) < 3 or pieces[0] < 2 or features % pieces[0]:
        return s
    count = pieces[0]
    asked = st.reads.asked[-1] if st.reads.asked else ()
    at = reshape(s, tuple(x.shape), tuple(out)).dim
    written = asked[at] if len(asked) == len(out) else None
    if isinstance(written, Counted) or written == -1:
        return s  # an attribute (a count of heads, a layout per head), or the rest
    if written is None and count in {v for _, _, v in st.reads.fresh}:
        if pieces[1] == count:
            raise SplitEnds(
                f"it views the fused features as {pieces}: whether {count} counts the fused "
                "pieces or the heads cannot be told apart"
            )
        return s
    start = piece[1] if piece else 0
    if piece:
        st.splits.cut_here.add(piece)
    size = features // count
    _carve_at(st, src, {start + i * size for i in range(1, count)}, piece or None)
    st.splits.hold_piece(op.out, None)  # every piece of it, side by side
    stacked = tuple((src, start + i * size, size) for i in range(count))
    st.splits.stacked[id(op.out)] = (op.out, at, stacked)
    return Split(s.dim, count, size, 1, s.sources)


def unstacked(st: Trackers, op: Op, d: int) -> None:
    """Tensors cut one by one out of the dim that holds fused pieces side by side (`unbind`
    of q, k, v; a split into ones) each hold their piece; a view that keeps that dim and
    those before it keeps them side by side."""
    found = st.splits.stacked_at(op.args[0])
    if found is None:
        return
    at, pieces = found
    if op.name in RESHAPES_KEEPING:
        if tuple(op.args[0].shape[: at + 1]) == tuple(op.out.shape[: at + 1]):
            st.splits.stacked[id(op.out)] = (op.out, at, pieces)
        return
    outs = list(op.out)
    if (
        d == at
        and len(outs) == len(pieces)
        and all(o.dim() < op.args[0].dim() or o.shape[d] == 1 for o in outs)
    ):
        for o, piece in zip(outs, pieces, strict=True):
            st.splits.hold_piece(o, piece)


def piece_sliced(st: Trackers, op: Op, s: Split, d: int) -> tuple[torch.Tensor, Split]:
    """`qkv[..., a:b]` along the split dim: a piece of a fused layer's output (or of one of
    its pieces), when each bound inside is written as a module attribute or a sum of them
    (`self.q_size + self.kv_size`), which the plan divides by the tp size so that each
    rank's slice of every piece is what the same index takes from its shard."""
    if len(s.sources) != 1 or s.outer != 1:
        raise SplitEnds("it takes part of the split dim")
    (src,) = s.sources
    if src in st.splits.slices_refused:
        raise SplitEnds("it takes part of the split dim, whose other slices cannot be followed")
    try:
        return _sliced_piece(st, op, s, d, src)
    except SplitEnds:
        # one slice a shard cannot follow ends the split at every slice: the pieces the
        # others carved out are no layout of the layer
        st.splits.slices_refused.add(src)
        if src in st.splits.sliced:
            st.trace.spans.parts.pop(src, None)
        raise


def piece_indexed(st: Trackers, op: Op, s: Split, d: int) -> tuple[torch.Tensor, Split]:
    """`g[..., [-2], :]` along the split dim of a view counted as a sum of attributes and a
    constant (`view(B, T, self.num_heads + 2, D)`): consecutive indices written as numbers
    within the constant's units at either end take one piece, as the slice of them would."""
    t = op.args[0]
    fixed, size = st.splits.fixed_at(t), t.shape[d]
    written = st.reads.cutting[-1] if st.reads.cutting else None
    lists = [
        x
        for x in (written if isinstance(written, tuple) else (written,))
        if isinstance(x, (list, tuple)) and x and all(type(i) is int for i in x)
    ]
    if fixed is None or len(lists) != 1 or len(s.sources) != 1 or s.outer != 1:
        raise SplitEnds("it picks along the split dim")
    at = [i + size if i < 0 else i for i in lists[0]]
    if at != list(range(at[0], at[0] + len(at))) or not all(
        _at_fixed_end(b, size, fixed) for b in (at[0], at[-1] + 1)
    ):
        raise SplitEnds("it picks along the split dim other than a run of its fixed ends")
    (src,) = s.sources
    return _sliced_piece(st, op, s, d, src, first=at[0], literal=True)


def _at_fixed_end(b: int, size: int, fixed: int | None) -> bool:
    """Whether bound `b` of a dim of `size` lies within `fixed` units of either end."""
    return fixed is not None and (b <= fixed or size - b <= fixed)


def _sliced_piece(
    st: Trackers,
    op: Op,
    s: Split,
    d: int,
    src: str,
    *,
    first: int | None = None,
    literal: bool = False,
) -> tuple[torch.Tensor, Split]:
    t, out = op.args[0], op.out
    size = t.shape[d]
    if first is None:
        first = op.named.get("start") or 0
        first = max(first + size, 0) if first < 0 else min(first, size)
    last = first + out.shape[d]
    inner = {b for b in (first, last) if 0 < b < size}
    fixed = st.splits.fixed_at(t)
    if any(b % s.inner for b in inner):
        raise SplitEnds("it takes part of a block of the split dim that must stay whole")
    written = st.reads.cutting[-1] if st.reads.cutting else None
    slices = [written] if isinstance(written, slice) else list(tree_leaves(written))
    slices = [x for x in slices if isinstance(x, slice) and x != slice(None)]
    # the index's one slice that takes part of a dim: a bound of a slice of another dim
    # that equals one of this one's would say nothing of this one
    bounds = [slices[0].start, slices[0].stop] if len(slices) == 1 else []
    held: list[tuple[str, str, int]] = []
    products: set[tuple[tuple[str, str, int], ...]] = set()
    for b in sorted(inner):
        found = [w for w in bounds if isinstance(w, Counted) and int(w) == b]
        products.update(_products_of(found[0]) if len(found) == 1 else ())
        leaves = _terms(st, src, found[0]) if len(found) == 1 else None
        number = literal or any(type(w) is int and w % size == b for w in bounds)
        if leaves is None and number and _at_fixed_end(b, size, fixed):
            continue  # a number counting the constant's units from an end (infer checks it)
        if leaves is None and len(found) == 1 and fixed and size - b <= fixed:
            # `self.num_heads + 1`: the query heads, then units into the constant's at the end
            summed = linear_terms(found[0].expr)
            if summed is not None and summed[0] and 0 < summed[1] <= fixed:
                leaves = [read for read, _ in summed[0]]
        if leaves is None:
            raise SplitEnds(
                f"it takes part of the split dim, at {b}, a bound written with no module "
                "attribute (or sum of them) the plan could divide by the tp size"
            )
        held += leaves
        st.trace.reads.cut_terms.update((m, a) for m, a, _ in leaves)
    start, covered, piece = _held_features(st, t, src)
    if covered % (s.n * s.inner):
        raise SplitEnds("it takes features whose place among the fused pieces is unknown")
    per_unit = covered // (s.n * s.inner)
    if src not in st.trace.spans.parts:
        st.splits.sliced.add(src)  # its pieces come from slices
    _carve_at(st, src, {start + b * per_unit for b in inner}, piece)
    st.trace.reads.counts.setdefault(src, set()).update(held)
    n = out.shape[d]
    if n % s.inner:
        raise SplitEnds("it takes part of a block of the split dim that must stay whole")
    at = start + first * per_unit
    # of its bounds' terms, those of the slice's own size size the piece it takes (the
    # others, its offset, size the pieces before it)
    own = {(m, a, v) for m, a, v in held if v == n}
    st.trace.reads.piece_counts.setdefault((src, at, n * per_unit), set()).update(own)
    sized = {p for p in products if math.prod(v for _, _, v in p) == n}
    st.trace.reads.piece_products.setdefault((src, at, n * per_unit), set()).update(sized)
    parts = st.trace.spans.parts[src]
    starts = {sum(parts[:i]): p for i, p in enumerate(parts)}
    one = starts.get(at) == n * per_unit
    st.splits.hold_piece(out, (src, at, n * per_unit) if one else None)
    return out, Split(s.dim, 1, n // s.inner, s.inner, s.sources)


def cut(st: Trackers, op: Op, s: Split) -> list[tuple[torch.Tensor, Split]]:
    """A fused layer's output, or one piece of it, cut into its pieces (q|k|v, gate|up) along
    the split dim.

    Sharded, the layer stores each piece's rank-r slice next to the others' (`parts` in the
    plan), so rank r's shard is [q_r, k_r, v_r]; the model's own cut finds those pieces only
    when it cuts into equal pieces by count (`chunk`) or by sizes read from module attributes
    (or sums of them, `2 * self.kv_size`), which the plan divides by the tp size. A piece cut
    again (k|v into k and v) makes finer pieces of the layer's.
    """
    name, out = op.name, op.out
    if len(s.sources) != 1 or s.outer != 1 or name not in ("split", "split_with_sizes"):
        raise SplitEnds(
            f"its split features are cut into {len(out)} parts in a way a fused split "
            "cannot follow; a contiguous shard would mix the parts"
        )
    (src,) = s.sources
    start, covered, piece = _held_features(st, op.args[0], src)
    sizes = [o.shape[s.dim] for o in out]
    if sum(1 for n in sizes if n) == 1:
        # one piece holds every feature (a cut into one, or beside empty ones): no cut
        return [(o, s) for o, n in zip(out, sizes, strict=True) if n]
    if any(n % s.inner for n in sizes):
        raise SplitEnds("it cuts the split features inside a block that must stay whole")
    held, widths = ({}, {}) if st.reads.chunking else _sizes_held(st, op)
    asked = op.named.get("split_sizes", op.named.get("split_size"))
    if covered % (s.n * s.inner):
        raise SplitEnds("it cuts features whose place among the fused pieces is unknown")
    per_unit = covered // (s.n * s.inner)
    bounds, at = set(), start
    for n in sizes[:-1]:
        at += n * per_unit
        bounds.add(at)
    _carve_at(st, src, bounds - {start, start + covered}, piece)
    reads = st.trace.reads
    reads.counts.setdefault(src, set()).update(c for cs in held.values() for c in cs)
    followed, at = [], start
    for i, (o, n) in enumerate(zip(out, sizes, strict=True)):
        if n:
            followed.append((o, Split(s.dim, 1, n // s.inner, s.inner, s.sources)))
            piece = (src, at, n * per_unit)
            st.splits.hold_piece(o, piece)
            # the attributes its size was written with size this piece
            reads.piece_counts.setdefault(piece, set()).update(_sized_by(held, asked, i, n))
            mine = {p for p in reads.products.get(src, ()) if math.prod(v for *_, v in p) == n}
            reads.piece_products.setdefault(piece, set()).update(mine)
            if i in widths:
                width = op.args[0].shape[s.dim]
                reads.width_cuts[piece] = (widths[i], width, start, covered)
            at += n * per_unit
    return followed


def _sized_by(
    held: dict[int, list[tuple[str, str, int]]], asked: Any, i: int, n: int
) -> list[tuple[str, str, int]]:
    """The attributes the i-th piece's size (`n`) was written with: `split(size)` writes one
    size for every piece of that size (the last may be shorter)."""
    if isinstance(asked, int):
        return held.get(0, []) if n == asked else []
    return held.get(i, [])


def op_source(st: Trackers, op: Op) -> str:
    """The one opener whose split features the op's input holds."""
    (src,) = st.splits.only_split(op.args[0]).sources
    return src


def _terms(st: Trackers, src: str, w: Counted) -> list[tuple[str, str, int]] | None:
    """The attributes of a cut size or bound `w` the plan divides by the tp size: each of a
    sum of attributes (times constants); a product of attributes (`self.n_head *
    self.head_dim`) is kept for infer to divide the one factor that is a head count
    (`products`). None where `w` is neither."""
    leaves = scaled_reads(w.expr)
    if leaves is not None:
        return leaves
    terms = product_terms(w.expr)
    if terms is None:
        return None
    singles = [t[0] for t in terms if len(t) == 1]
    st.trace.reads.products.setdefault(src, set()).update(t for t in terms if len(t) > 1)
    return singles


def _products_of(w: Counted) -> list[tuple[tuple[str, str, int], ...]]:
    """The products of attributes among the terms of `w` (none where it is no such sum)."""
    terms = product_terms(w.expr)
    return [t for t in terms or () if len(t) > 1]


def _held_features(st: Trackers, t: torch.Tensor, src: str) -> tuple[int, int, Piece | None]:
    """(offset, size) of `src`'s output features `t` holds, and the piece it is (None: all
    of them); SplitEnds where it holds several pieces met together."""
    piece = st.splits.piece_of(t)
    if piece is None:
        raise SplitEnds("it cuts features of several fused pieces met together")
    if piece is False:
        return 0, st.trace.spans.openers[src], None
    st.splits.cut_here.add(piece)
    return piece[1], piece[2], piece


def _carve_at(st: Trackers, src: str, bounds: set[int], piece: Piece | None) -> None:
    """Cut `src`'s fused pieces (`parts`) at these offsets of its output features. `piece`:
    the piece the cut is made in (None: the whole output). A piece already handed on whole
    and read (or one cut here, read by an op before this one) would hold other features on a
    rank once cut finer: that ends the split."""
    spans = st.trace.spans
    whole = spans.openers[src]
    parts = spans.parts.get(src, (whole,))
    starts = [sum(parts[:i]) for i in range(len(parts))]
    new = sorted(set(starts) | bounds | {whole})
    if len(new) - 1 == len(parts):
        return  # no new cut
    for p_start, size in zip(starts, parts, strict=True):
        inside = {b for b in bounds if p_start < b < p_start + size}
        if not inside:
            continue
        old = (src, p_start, size)
        reads = st.splits.piece_uses.get(old, 0) - (old == piece)
        if reads > 0:
            raise SplitEnds("the fused features are cut two different ways")
        st.splits.carved.add(old)
    spans.parts[src] = tuple(b - a for a, b in itertools.pairwise(new))


def _sizes_held(
    st: Trackers, op: Op
) -> tuple[dict[int, list[tuple[str, str, int]]], dict[int, Expr]]:
    """The attributes a split's sizes were read from, which the plan divides by the tp size,
    by the place of the size they wrote among the sizes (two pieces of one size may be
    written with different attributes, `[self.q_size, 2 * self.kv_size]`): each size as
    written, an attribute or a sum of attributes each maybe times a constant; where the
    written sizes are not at hand, the one attribute read just before that holds each size's
    value. Also, by their place among the sizes, those computed from the width read off the
    tensor cut (which shrink by themselves)."""
    asked = op.named["split_size"] if op.name == "split" else op.named["split_sizes"]
    asked = [asked] if isinstance(asked, int) else list(asked)
    written = st.reads.cutting[-1] if st.reads.cutting else None
    written = [written] if isinstance(written, int) else written
    doing = "it cuts the fused features at"
    if not isinstance(written, (list, tuple)) or [int(w) for w in written] != asked:
        return {  # nothing to divide in an empty piece
            i: [st.reads.attribute_holding(size, doing)] for i, size in enumerate(asked) if size > 0
        }, {}
    held: dict[int, list[tuple[str, str, int]]] = {}
    widths: dict[int, Expr] = {}
    width = op.args[0].shape[norm_dim(op.named.get("dim", 0), op.args[0].dim())]
    for i, w in enumerate(written):
        if w <= 0:
            continue
        leaves = _terms(st, op_source(st, op), w) if isinstance(w, Counted) else None
        if leaves is not None:
            held.setdefault(i, []).extend(leaves)
            st.trace.reads.cut_terms.update((m, a) for m, a, _ in leaves)
        elif (
            isinstance(w, Counted)
            and width in st.reads.shapes_read
            and shrinks_with_width(w.expr, width, int(w))
        ):
            # computed from the width read off the tensor it cuts, which on a shard is the
            # shard's own: the size shrinks by itself, and its attributes must stay whole
            st.trace.reads.width_terms.update(attributes_in(w.expr))
            if op.name == "split_with_sizes":  # one size per piece, in order
                widths[i] = w.expr
        else:  # a number or another formula: the one attribute read just before holding it
            held.setdefault(i, []).append(st.reads.attribute_holding(int(w), doing))
    return held, widths
