"""`Tracer`, the dispatch driver: every aten op of the traced forward, handed to the trackers
and the per-op rules.

Start at `Tracer.on_op`. Each op first goes to the trackers that follow something other than
dense splits (parameters, vectors, experts' partial sums, table rows); then, if one of its
inputs holds split features, its rule (rules.py) says where they go, or why they end there.
The driver decides nothing itself: what a split means is in split.py, what an op does to one
in rules.py, and what each tracker follows in trackers/.
"""

from __future__ import annotations

from typing import Any

import torch

from .._runtime.torch_compat import TorchDispatchMode, decomposition
from .ops import ELEMENTWISE, METADATA, NEW_FROM, Op, run_op
from .rules import follow, has_rule, sized_by_a_shard
from .split import SplitEnds
from .trackers import Trackers

__all__ = ["Tracer"]

# Ops that read a tensor's features without caring in which order they lie along the split
# dim (each feature on its own, or dims moved whole): a piece they read may still be cut
# finer (dense.py's `use_pieces`).
_MOVES = {"t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "clone", "contiguous"}
_MOVES |= {"_to_copy", "alias", "detach", "lift_fresh"}


def _order_blind(op: Op) -> bool:
    return op.name in _MOVES or op.name in ELEMENTWISE or torch.Tag.pointwise in op.func.tags


class Tracer(TorchDispatchMode):
    """Carries Splits from op to op (see the module docstring)."""

    def __init__(self, st: Trackers) -> None:
        super().__init__()
        self.st = st
        self.decomposing: list[Any] = []  # the ops being run by their parts, innermost last

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        op = Op(func, args, kwargs or {}, None)
        if self._unknown(op):
            done, out = self._by_parts(op)
            if done:
                return out
        op.out = run_op(func, args, op.kwargs)
        # a table's rows are judged even inside its own (quiet) forward
        self.st.lookups.on_op(op)
        if not self.st.quiet:
            self.on_op(op)
        self.st.reads.after_op(op.name)
        return op.out

    def _unknown(self, op: Op) -> bool:
        """An op that meets split features and that no rule knows."""
        return (
            not self.st.quiet
            and op.func.namespace == "aten"  # prim::device and the like have no parts
            and op.name not in METADATA
            and not has_rule(op)
            and op.func not in self.decomposing  # its own parts call it again: its verdict
            and any(self.st.splits.split_of(t) is not None for t in op.ins)
        )

    def _by_parts(self, op: Op) -> tuple[bool, Any]:
        """Run an op no rule knows as torch decomposes it (`log_sigmoid`, `hardswish`,
        `to`): its Python reference, or its composite kernel, with this mode on, so each op
        it is made of comes back here to its own rule before the split is given up.
        (False, None) where torch has no decomposition for it."""
        table = decomposition(op.func)
        self.decomposing.append(op.func)
        try:
            with self:
                out = table(*op.args, **op.kwargs) if table is not None else NotImplemented
                if out is NotImplemented:
                    out = op.func.decompose(*op.args, **op.kwargs)
        finally:
            self.decomposing.pop()
        return (False, None) if out is NotImplemented else (True, out)

    def on_op(self, op: Op) -> None:
        st = self.st
        splits = [s for s in (st.splits.split_of(t) for t in op.ins) if s is not None]
        sources = frozenset().union(*(s.sources for s in splits))
        st.origins.note_carrying(op)
        if st.origins.expert_params and st.experts.on_op(op):
            return
        st.vectors.note(op)
        st.origins.note_params(op, sources)
        if not splits or op.name in NEW_FROM:
            # `x.new_empty(...)` reads nothing of x but its dtype and device
            if not sized_by_a_shard(st, op):
                st.reads.note_unsplit_sizes(op)
            return
        if not op.outs:
            if op.func.namespace != "prim" and op.name not in METADATA:
                st.trace.spans.break_(
                    sources, f"{op.name} turns the split tensor into a plain value"
                )
            return
        read = [p for t in op.ins if (p := st.splits.piece_of(t)) is not False]
        for t in op.outs:
            st.splits.pieces.pop(id(t), None)  # a rule says which piece its outputs hold
        carved = st.splits.use_pieces(op.ins, _order_blind(op))
        try:
            results = follow(st, op)
            if carved - st.splits.cut_here:
                raise SplitEnds(st.splits.carved_reason(carved - st.splits.cut_here))
        except SplitEnds as e:
            st.trace.spans.break_(sources, f"{op.name}: {e}")
            if st.origins.expert_params:
                st.experts.split_ended(op, sources)
            return
        for t, s in results:
            if read and id(t) not in st.splits.pieces:
                # computed from one piece, it holds that piece; from several, none known
                st.splits.hold_piece(t, read[0] if len(set(read)) == 1 else None)
            st.splits.mark(t, s, op.name)
