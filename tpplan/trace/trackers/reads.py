"""`AttributeReads`: where the numbers an op is given came from.

Start at `AttributeReads.check_count`. A view of split features (`view(B, T, self.n_head,
hd)`) is right on every rank only if each count it is given shrinks with the shard: the plan
divides module attributes, so a count must be an integer attribute the forward read, or a size
read off the split tensor itself. The hooks (hooks.py) log every integer attribute a running
forward reads; the attention mode (attention.py) logs sizes read off split tensors and the
sizes a view was written with. What is found goes to the trace's `ReadFacts`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._runtime.torch_compat import tree_leaves
from ..counted import Counted, attributes_in, kept_by_dividing, linear_terms, values_read
from ..ops import COPIES, SIZED, Op
from ..record import AttributeRead, ReadFacts
from ..split import Split, SplitEnds, carved

__all__ = ["AttributeReads"]


class AttributeReads:
    """Integer attributes read by each running forward, and sizes read off split tensors."""

    def __init__(self, facts: ReadFacts, broken: Mapping[str, Any] | None = None) -> None:
        self.facts = facts
        # The layers whose split has ended (SpanFacts.broken): the counts they held are
        # divided by no plan
        self.broken: Mapping[str, Any] = broken if broken is not None else {}
        # Integer attributes of modules read by each running forward, innermost last. A count
        # or size an op is given was read by the forward that calls the op (or one enclosing
        # it), so these say which attribute a number came from; reads inside a finished
        # child forward are dropped.
        self.frames: list[list[AttributeRead]] = [[]]
        self.fresh: list[AttributeRead] = []  # attribute reads since the last op
        # Sizes of split dims read off split tensors since the last op (`x.shape`): a count
        # taken so is each shard's own.
        self.shapes_read: set[int] = set()
        # The same sizes -> the split they were read off.
        self.shape_splits: dict[int, Split] = {}
        # The sizes of the running view or reshape as the model wrote them: a reshape reaches
        # dispatch as a copy and `_unsafe_view` with -1 already resolved.
        self.asked: list[tuple[Any, ...]] = []
        self.unflattening = 0  # >0 while an unflatten runs (its view's -1 is resolved)
        self.chunking = 0  # > 0 inside Tensor.chunk: its split cuts into equal parts by count
        # the one piece of a fused layer the view being checked reads (rules.py), if any:
        # the counts it records size that piece (`piece_counts`)
        self.viewing: tuple[str, int, int] | None = None
        # The counts a running repeat was written with, as Python handed them (a `Counted`
        # remembers the attributes it came from): ("repeat", n) for `repeat_interleave(n)`,
        # ("sizes", sizes) for `expand(*sizes)`; innermost last.
        self.given: list[tuple[str, Any]] = []
        # The sizes or index a running `split` or `x[...]` was written with (a `Counted`
        # bound remembers its formula), innermost last: dispatch sees plain ints.
        self.cutting: list[Any] = []
        # The constant of the count the last view checked gave its split dim, when written as
        # a sum of attributes and a constant (`self.num_heads + 2`; 0 for a sum without one,
        # or -1), else None
        self.summed: int | None = None

    # ---- logging ----------------------------------------------------------------------------
    def count_given(self, at: int, times: int) -> Any:
        """The number the running repeat was written with for `times` copies at output dim
        `at` (a `Counted` where it came from attributes); None when none is at hand."""
        if not self.given:
            return None
        kind, value = self.given[-1]
        if kind == "sizes":
            value = value[at] if at < len(value) else None
        return value if isinstance(value, int) and value == times else None

    def read(self, module: str, attr: str, value: int) -> None:
        """`module`'s forward read the integer attribute `attr`."""
        self.frames[-1].append((module, attr, value))
        self.facts.ints.add((module, attr))
        self.fresh.append((module, attr, value))

    def enter(self) -> None:
        """A module's forward starts: its reads go to a frame of its own."""
        self.frames.append([])

    def leave(self) -> None:
        self.frames.pop()

    def note_shape(self, size: int, split: Split) -> None:
        """`size`, the size of a split dim, was read off a tensor split so."""
        self.shapes_read.add(size)
        self.shape_splits[size] = split

    def after_op(self, name: str) -> None:
        """Reads are fresh until the next op. A reshape of a strided tensor runs as a copy and
        then a view: reads just before the reshape are still fresh at its view."""
        if name not in COPIES:
            self.fresh.clear()
            self.shapes_read.clear()
            self.shape_splits.clear()

    def values_read(self) -> set[int]:
        """The values of every attribute read by the running forwards."""
        return {v for frame in self.frames for _, _, v in frame}

    # ---- judging the sizes ops are given ----------------------------------------------------
    def check_count(
        self,
        sizes: Any,
        s: Split,
        before: Split,
        x: Any,
        out_shape: Any,
        width: int | None = None,
        counted: frozenset[str] | None = None,
    ) -> None:
        """A view of split features must size the split dim so that each rank's shard gets
        its share, and the dims beside it so that they do not change.

        - A fixed count at the split dim must be an integer attribute of a running module,
          which the plan divides by the tp size (`view(B, T, self.n_head, hd)`).
        - Where the view reshapes the split features, every size beside the split dim must be
          an integer attribute read in forward (`self.head_dim`), or 2 to 4 times one
          (`3 * self.head_size`, fused pieces per head): one computed from the
          width (`t.size(-1) // cfg.n_head`) would shrink on a shard, without a word when the
          split dim is -1. Numbers the tracer cannot trace to an attribute end the split.
        - A view that keeps the split dim as it was (`x.reshape(*x.shape[:-1], -1, 2)` on
          heads) only needs its count at the split dim, when -1 is elsewhere, to be an
          attribute: read off the tensor it would be the shard's own, but from elsewhere not.

        `width`: the size of the features one split digit spans (one fused piece's, where
        the view carves the pieces apart); the input dim's size when not given. `counted`:
        the openers whose heads the split digit counts (all of `s.sources` when not given).
        """
        self.summed = None
        if not isinstance(sizes, (list, tuple)):
            return  # squeeze, unsqueeze, flatten: dims, not sizes
        asked = self.asked[-1] if self.asked else ()
        if len(asked) == len(out_shape):
            for i, w in enumerate(asked):
                if i != s.dim and isinstance(w, Counted):
                    self.facts.beside_sizes.update(attributes_in(w.expr))
        if self.unflattening and len(asked) == len(sizes) and -1 in asked:
            sizes = list(asked)  # an unflatten's -1, which its view runs resolved
        k = s.dim
        if list(sizes) == list(x.shape):
            return  # the same shape again: on a shard, the shard's own
        read = self.values_read()
        if width is None:
            width = x.shape[before.dim]
        kept = before.n == s.n and before.inner == s.inner and width == sizes[k]
        pieces = carved(list(out_shape), k, width)
        if kept:
            if sizes[k] == -1 or (-1 not in sizes and sizes[k] not in read):
                return
            if not self.asked:
                # no view or reshape of the model's code is running: the sizes are the
                # tensor's own (flatten, unflatten of another dim), so the shard's own; a
                # count that equals an attribute read earlier is a coincidence, and dividing
                # that attribute would resize whatever else the forward computes from it
                return
        elif len(pieces) > 1:  # the split dim is cut into (count, ..., size) dims
            # written -1 (`reshape(B, N, 3, self.num_heads, -1)`): the shard's own size once
            # the count before it is divided, as the count's own check requires
            written = self.asked[-1] if self.asked else ()
            last = k + len(pieces) - 1
            free = len(written) == len(sizes) and written[last] == -1
            beside = pieces[1:-1] if free else pieces[1:]
            try:
                self._check_beside(beside, sizes[k], width, read)
            except SplitEnds:
                # last, a ratio of head counts that dividing them all keeps (Falcon's)
                kept = self._kept_ratios(written, sizes, k, last, counted or s.sources)
                if not kept:
                    raise
                self._check_beside(beside, sizes[k], width, read | kept)
        else:
            self._check_merge(sizes, s, counted or s.sources)
            return
        self._check_fixed_count(sizes, s, counted or s.sources, width)

    def _kept_ratios(
        self, written: Any, sizes: Any, k: int, last: int, counted: frozenset[str]
    ) -> set[int]:
        """Sizes beside the split dim written as a formula of head counts that keeps its
        value when they are all divided (Falcon's `self.num_heads // self.num_kv_heads + 2`):
        each of those counts is divided with the split's own, and the size is as fixed as an
        attribute."""
        if len(written) != len(sizes):
            return set()
        out = set()
        for j in range(k + 1, last + 1):
            w = written[j]
            if isinstance(w, Counted) and kept_by_dividing(w.expr):
                for (module, attr), value in values_read(w.expr).items():
                    for src in counted:
                        self._count(src, (module, attr, value))
                out.add(int(w))
        return out

    def _check_beside(self, beside: list[int], count: int, width: int, read: set[int]) -> None:
        """The sizes a view gives the dims it carves beside the split dim out of the split
        features must be attributes read in forward (or 2 to 4 times one)."""
        if not beside:
            return
        *middle, last = beside
        # `3 * self.head_size` (q|k|v interleaved per head, GPT-NeoX) is as fixed as the
        # attribute, unless the split tensor's width was just read (it may come from that)
        # or the attribute is a count the plan divides (nanoGPT's `C // n_head` equals
        # 2 * n_head by chance, and changes when n_head is divided)
        counts = {
            v
            for src, found in self.facts.counts.items()
            if src not in self.broken
            for _, _, v in found
        }
        counts.add(count)
        multiple = width not in self.shapes_read and any(
            last == m * v for v in read - counts if v > 1 for m in (2, 3, 4)
        )
        if (last not in read and not multiple) or any(m not in read and m > 4 for m in middle):
            raise SplitEnds(
                f"it sizes the features beside the split dim at {beside}, which no "
                "module attribute read in forward holds; computed from a shard's width "
                "they would be wrong on every rank"
            )

    def _check_merge(self, sizes: Any, s: Split, counted: frozenset[str]) -> None:
        """A view merging the split dim with others. One sized by -1 or by the tensor's own
        sizes is the shard's own. One sized by an attribute read right before it
        (`reshape(B, T, self.embed_dim)`) is divided by the plan; a number that only equals
        some attribute read earlier (a head count taken from a shape) is not that attribute."""
        k = s.dim
        asked = self.asked[-1] if self.asked else ()
        if len(asked) == len(sizes) and all(isinstance(v, int) for v in asked):
            sizes = asked  # -1 as written, not as dispatch resolved it
        # the attribute holds the whole merged width, or the count of split units in it
        # (`bsz * self.num_heads`): either way dividing it gives each rank its share
        held = [
            (m, a, v)
            for m, a, v in self.fresh
            if v == sizes[k] or (v == s.n and sizes[k] == s.outer * s.n * s.inner)
        ]
        if isinstance(sizes[k], Counted):
            # written as a formula (`b * self.n_head`): only the attributes it reads sized it
            formula = attributes_in(sizes[k].expr)
            held = [(m, a, v) for m, a, v in held if (m, a) in formula]
        if sizes[k] == -1 or not held:
            if sizes[k] != -1 and -1 in sizes:
                raise SplitEnds(
                    f"it merges the split dim into one of fixed size {sizes[k]} with -1 elsewhere"
                )
            return
        others = [v for j, v in enumerate(sizes) if j != k]
        if len({(m, a) for m, a, _ in held}) != 1 or held[0][2] in others:
            raise SplitEnds(
                f"it merges the split features into a fixed size {sizes[k]}, and which "
                "attribute read just before it sized them is ambiguous "
                f"({', '.join(sorted({a for _, a, _ in held}))})"
            )
        for src in counted:
            self._count(src, held[0])

    def _check_fixed_count(self, sizes: Any, s: Split, counted: frozenset[str], width: int) -> None:
        """The count a view gives the split dim, unless -1 or read off a split tensor, must
        be an attribute the plan divides."""
        k = s.dim
        fresh = {v for _, _, v in self.fresh}
        if sizes[k] in self.shapes_read and sizes[k] not in fresh:
            return  # the count was read off a split tensor just before: the shard's own
        if sizes[k] == -1:
            self.summed = 0  # each rank's own count of every unit it holds
            return
        if self._summed_count(sizes, s, counted, width):
            return
        doing = "with -1 elsewhere, it fixes" if -1 in sizes else "it fixes"
        count = self.attribute_holding(sizes[k], f"{doing} the split dim at")
        for src in counted:
            self._count(src, count)

    def _summed_count(self, sizes: Any, s: Split, counted: frozenset[str], width: int) -> bool:
        """A count at the split dim written as a sum of attributes, maybe plus a constant
        (`view(B, T, self.num_heads + 2, D)`: a fused q|k|v's query heads, and its key and
        value heads): each attribute is a count the plan divides, and infer matches the terms
        to the fused pieces they count (a constant may count only key/value heads that every
        rank holds whole). False where the count is written otherwise."""
        asked = self.asked[-1] if self.asked else ()
        written = asked[s.dim] if len(asked) == len(sizes) else None
        if not isinstance(written, Counted) or written.direct() is not None or -1 in sizes:
            return False
        found = linear_terms(written.expr)
        if found is None or not found[0] or len(counted) != 1:
            return False
        terms, constant = found
        (src,) = counted
        unit = width // s.n
        for read, _ in terms:
            self._count(src, read)
        self.facts.view_sums.setdefault(src, set()).add((tuple(terms), constant, unit))
        self.summed = constant
        return True

    def _count(self, src: str, count: AttributeRead) -> None:
        """`count` sizes `src`'s split features (and the piece being viewed, if one is)."""
        self.facts.counts.setdefault(src, set()).add(count)
        if self.viewing is not None and self.viewing[0] == src:
            self.facts.piece_counts.setdefault(self.viewing, set()).add(count)

    def attribute_holding(self, value: int, doing: str) -> AttributeRead:
        """(module, attribute, value) of the one integer attribute read just before this op
        with this value; the plan divides it by the tp size. Anything else ends the split."""
        read: set[tuple[str, str]] = set()
        for frame in reversed(self.frames):
            read = {(m, a) for m, a, v in frame if v == value}
            if read:
                break
        if len(read) != 1:
            which = (
                f"several attributes read in forward hold it ({', '.join(sorted(a for _, a in read))})"
                if read
                else "no module attribute read in forward holds it"
            )
            raise SplitEnds(f"{doing} {value}, and {which}")
        ((module, attr),) = read
        return module, attr, value

    def note_unsplit_sizes(self, op: Op) -> None:
        """Attributes read to size an op on tensors that are not split: dividing them for a
        split tensor would resize these too, so they must not be divided."""
        if op.name not in SIZED:
            return
        for v in tree_leaves((op.args, op.kwargs)):
            if type(v) is int and v > 1:
                for module, attr, value in self.fresh:
                    if value == v:
                        self.facts.unsplit_sizes.add((module, attr))
