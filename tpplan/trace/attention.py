"""`AttentionMode`, the tracer's torch-function mode: what dispatch alone cannot see.

Start at `AttentionMode.__torch_function__`. Below the Python API, an op loses facts the tracer
needs: `scaled_dot_product_attention` runs as many aten ops (on fake tensors, the math path)
that would need rules of their own, a size read off a tensor (`x.shape[1]`) is a plain int, a
reshape arrives with -1 already resolved, and `chunk` arrives as a `split` whose sizes came
from a count. This mode sees the Python calls and tells the trackers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .heads import note_grouped
from .rules import side_input
from .split import Split, SplitEnds, check_broadcast, norm_dim
from .trackers import Trackers

__all__ = ["AttentionMode"]

# Cuts into a number of equal pieces: a rank's shard of a fused output cut so gives the
# rank's slice of each piece, with no size to divide.
_CHUNKS = (torch.Tensor.chunk, torch.chunk)
_VIEWS = (torch.Tensor.view, torch.Tensor.reshape, torch.reshape)
_VIEWS_AS = (torch.Tensor.view_as, torch.Tensor.reshape_as)
_UNFLATTENS = (torch.Tensor.unflatten, torch.unflatten)
_SHAPES = (torch.Tensor.size, torch.Tensor.shape.__get__)  # type: ignore[attr-defined]
_REPEATS = (torch.Tensor.repeat_interleave, torch.repeat_interleave)
# Cuts by sizes or bounds: dispatch sees them as plain ints, the Python call as written.
_CUTS = (torch.Tensor.split, torch.split, torch.Tensor.split_with_sizes, torch.Tensor.__getitem__)


def _unflattened(x: torch.Tensor, dim: int, sizes: Any) -> tuple[Any, ...]:
    """The sizes `x.unflatten(dim, sizes)` is written with, as a whole view's (-1 kept): its
    view runs with the -1 resolved (diffusers' `unflatten(-1, (-1, attn.head_dim))`)."""
    d = dim + x.dim() if dim < 0 else dim
    return (*x.shape[:d], *sizes, *x.shape[d + 1 :])


class AttentionMode(TorchFunctionMode):
    """scaled_dot_product_attention as one op: heads (dim -3) of q, k and v go together.

    Seen whole, so its evidence reads as attention and its internals (on the math path on fake
    tensors) need no rules. Grouped-query attention pairs query head i with key/value head
    i * kv_heads // heads, so a tp-way split keeps pairs together when tp divides both counts.
    Also: sizes read off split tensors, the sizes views are written with, and chunks.
    """

    def __init__(self, st: Trackers) -> None:
        super().__init__()
        self.st = st

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        quiet = self.st.quiet
        if func in _SHAPES and not quiet:
            return self._shape(func, args, kwargs)
        if func in _VIEWS_AS and not quiet:
            return self._view_as(func, args, kwargs)
        if func in _VIEWS:
            sizes = args[1:]
            if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
                sizes = sizes[0]
            return self._asked(tuple(sizes), func, args, kwargs)
        if func in _UNFLATTENS:
            self.st.reads.unflattening += 1
            try:
                return self._asked(_unflattened(*args, **kwargs), func, args, kwargs)
            finally:
                self.st.reads.unflattening -= 1
        if func in _REPEATS or func is torch.Tensor.expand:
            return self._given(func, args, kwargs)
        if func in _CUTS and not quiet:
            return self._cut(func, args, kwargs)
        if func in _CHUNKS:
            self.st.reads.chunking += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.st.reads.chunking -= 1
        if func is not torch.nn.functional.scaled_dot_product_attention or quiet:
            return func(*args, **kwargs)
        return self._attention(func, args, kwargs)

    def _shape(self, func: Any, args: Any, kwargs: Any) -> Any:
        """`x.shape` or `x.size(d)` of a split tensor: the size of its split dim, read so, is
        each shard's own."""
        out = func(*args, **kwargs)
        split = self.st.splits.split_of(args[0])
        if split is not None:
            if isinstance(out, int) and norm_dim(args[1], args[0].dim()) == split.dim:
                self.st.reads.note_shape(out, split)
            elif isinstance(out, tuple):
                self.st.reads.note_shape(out[split.dim], split)
        return out

    def _view_as(self, func: Any, args: Any, kwargs: Any) -> Any:
        """The sizes come from the other tensor's shape, read in C++ where `_SHAPES` does not
        see it: a split dim's size read so is each shard's own."""
        other = args[1]
        split = self.st.splits.split_of(other)
        if split is not None:
            self.st.reads.note_shape(other.shape[split.dim], split)
        return self._asked(tuple(other.shape), func, args, kwargs)

    def _given(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Run a repeat with the count it was written with at hand (`AttributeReads.given`):
        `repeat_interleave(self.n_rep)` and `repeat_interleave(self.n_head // self.n_kv)`
        reach dispatch as the same expand of the same number."""
        if func is torch.Tensor.expand:
            sizes = args[1:]
            if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
                sizes = sizes[0]
            given: tuple[str, Any] = ("sizes", tuple(sizes))
        else:
            given = ("repeat", args[1] if len(args) > 1 else kwargs.get("repeats"))
        self.st.reads.given.append(given)
        try:
            return func(*args, **kwargs)
        finally:
            self.st.reads.given.pop()

    def _cut(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Run a split or an index with its sizes or bounds as written at hand
        (`AttributeReads.cutting`)."""
        written = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections")
        if written is None:
            written = kwargs.get("split_size", kwargs.get("split_sizes"))
        self.st.reads.cutting.append(written)
        try:
            return func(*args, **kwargs)
        finally:
            self.st.reads.cutting.pop()

    def _asked(self, sizes: tuple[Any, ...], func: Any, args: Any, kwargs: Any) -> Any:
        """Run a view with the sizes it was written with at hand (`AttributeReads.asked`)."""
        self.st.reads.asked.append(sizes)
        try:
            return func(*args, **kwargs)
        finally:
            self.st.reads.asked.pop()

    def _attention(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Attention over heads keeps the heads' split, when q, k and v (and a mask) are
        split alike along their heads dim; its ops inside run quiet."""
        st = self.st
        qkv = list(args[:3]) + [kwargs[k] for k in ("query", "key", "value") if k in kwargs]
        splits = [st.splits.split_of(x) for x in qkv]
        if all(s is None for s in splits):
            return func(*args, **kwargs)
        sources = frozenset().union(*(s.sources for s in splits if s is not None))
        st.quiet += 1
        try:
            out = func(*args, **kwargs)
        finally:
            st.quiet -= 1
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if any(st.origins.carries(x) for x in qkv):
            st.origins.computed(out)
        splits = _one_head_pieces(st, qkv, splits)
        try:
            q = _heads_split(qkv, splits)
            if isinstance(mask, torch.Tensor):
                ms = st.splits.split_of(mask)
                if ms is None:
                    check_broadcast(mask.shape, q, out.dim())
                    side_input(st, mask, q, "its mask")
                elif not ms.same_cut(q.at(ms.dim)) or ms.dim != q.dim:
                    raise SplitEnds("the mask is split differently from the heads")
        except SplitEnds as e:
            st.trace.spans.break_(sources, f"scaled_dot_product_attention: {e}")
            return out
        mask_split = st.splits.split_of(mask) if isinstance(mask, torch.Tensor) else None
        if mask_split is not None:
            sources |= mask_split.sources  # a per-head bias joins the heads' span
        units = st.trace.spans.units
        sides = _grouped(st, splits, qkv)
        for s in sources:
            # grouped-query attention: each side's heads on their own (the pairing of query
            # head i with key/value head i // (H/K) is kept by `_grouped`'s facts instead)
            n = sides.get(s) if sides else None
            units[s] = math.gcd(units.get(s, q.n), *((n,) if n else (x.n for x in splits if x)))
        st.splits.mark(out, Split(q.dim, 1, q.n, q.inner, sources), "scaled_dot_product_attention")
        return out


def _grouped(st: Trackers, splits: list[Split | None], qkv: list[torch.Tensor]) -> dict[str, int]:
    """Grouped-query attention, the key and the value alike (rules.py's `note_grouped`):
    opener -> its own side's head count; empty for any other attention."""
    q, k, v = splits[:3]
    assert q is not None and k is not None and v is not None  # _heads_split checked
    if k.n != v.n or k.inner != v.inner:
        return {}
    return note_grouped(st, q, [k, v], qkv[:3])


def _one_head_pieces(
    st: Trackers, qkv: list[torch.Tensor], splits: list[Split | None]
) -> list[Split | None]:
    """A key or value that is one head, a piece of the same fused Linear as the query, split
    along its features rather than by heads (multi-query attention's (B, 1, T, D) cut off
    q|k|v, GPT-BigCode's): as a split of its one head, which ranks can share whole
    (record.py's `kv_parts`); the ops before attention followed its features split, which
    is no looser."""
    q, x0 = splits[0], qkv[0]
    if q is None or len(q.sources) != 1 or q.dim != x0.dim() - 3:
        return splits
    out = list(splits)
    for i in (1, 2):
        x, s = qkv[i], splits[i]
        if (
            s is not None
            and s.sources == q.sources
            and st.splits.piece_of(x)
            and x.dim() == x0.dim()
            and s.dim == x.dim() - 1
            and x.shape[-3] == 1
            and s.outer == 1
            and s.n * s.inner == x.shape[-1] == x0.shape[-1]
        ):
            out[i] = Split(x.dim() - 3, 1, 1, 1, s.sources)
    return out


def _heads_split(qkv: list[torch.Tensor], splits: list[Split | None]) -> Split:
    """The split of the query's heads, when q, k and v are all split along their heads."""
    if any(s is None for s in splits):
        raise SplitEnds("query, key and value are not all split")
    first = splits[0]
    assert first is not None
    if all(
        s is not None
        and s.dim == first.dim
        and (s.outer, s.n, s.inner) == (first.outer, first.n, first.inner)
        and s.dim < x.dim() - 2
        and x.shape[s.dim] == qkv[0].shape[s.dim]
        for x, s in zip(qkv, splits, strict=True)
    ):
        # split alike on a dim attention runs over independently: heads folded into the
        # batch (`(b h) n d`), each rank its own rows of the batch-and-heads dim
        return first
    dims = [x.dim() - 3 for x in qkv]
    for x, s, d in zip(qkv, splits, dims, strict=True):
        assert s is not None
        if s.dim != d or s.outer != 1 or s.n * s.inner != x.shape[d]:
            raise SplitEnds("query, key or value is not split along its heads dim")
    q = splits[0]
    assert q is not None
    return q
