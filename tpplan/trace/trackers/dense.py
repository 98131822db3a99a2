"""`DenseSplits`: which tensors hold split output features of Linear layers, and where.

Start at `DenseSplits.split_of` and `mark`. A Linear called on an unsplit input opens a split
of its output features (`open`); the per-op rules (rules.py) carry it from tensor to tensor;
a Linear whose input arrives split on its contracted dim closes it (`arrive`). What they see
goes to the trace's `SpanFacts`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from ..record import SpanFacts
from ..split import Split, SplitEnds

__all__ = ["DenseSplits", "Piece"]

# A fused layer's piece: (layer, offset, size) along its output features.
Piece = tuple[str, int, int]


class DenseSplits:
    """Split tensors of one traced forward: id -> (tensor, its Split). The tensors are held so
    that their ids stay unique while traced."""

    def __init__(self, facts: SpanFacts, kept_whole: dict[str, list[str]]) -> None:
        self.facts = facts
        self.splits: dict[int, tuple[torch.Tensor, Split]] = {}
        # Layers an earlier pass found could not stay split (see run.py's `_trace_once`):
        # their outputs are whole from the start, with the reasons that pass gave.
        self.kept_whole = kept_whole
        # Tensors holding one piece of a fused layer's features, cut out along the split dim
        # (`_cut`, slices): id -> (layer, offset, size) in the layer's output features, or
        # None where the features held are not one known piece (pieces met). Tensors
        # computed from one piece hold that piece too (tracer.py's `on_op`); a tensor not
        # here holds all of its layers' features.
        self.pieces: dict[int, Piece | None] = {}
        # Tensors with a dim that holds a fused layer's pieces side by side (a view with a
        # count of pieces, `reshape(B, T, 3, H, D)`): id -> (the tensor, that dim, the
        # pieces in order), so that each piece unbound from it is known (`stacked_at`).
        self.stacked: dict[int, tuple[torch.Tensor, int, tuple[Piece, ...]]] = {}
        # Ops other than element-wise ones that read each piece so far (`used`), and the
        # pieces a later cut carved into finer ones (`carved`): the layer then holds its
        # slice of each finer piece, so a piece read whole elsewhere would be in another
        # order than the one that read meant.
        self.piece_uses: dict[Piece, int] = {}
        self.carved: set[Piece] = set()
        self.cut_here: set[Piece] = set()  # the pieces the running op's rule cut (rules.py)
        # Layers whose output a slice cut into pieces first, and those with a slice a shard
        # cannot follow (rules.py's `_piece_sliced`)
        self.sliced: set[str] = set()
        self.slices_refused: set[str] = set()
        # Views whose count at the split dim is a sum of attributes plus a constant (`view(B,
        # T, self.num_heads + 2, D)`): id -> (the tensor, the constant). Units that many from
        # either end may be cut at literal bounds (`[..., :-2, :]`, `[..., [-2], :]`): infer
        # allows it only where every rank holds those units whole (a key and a value head).
        self.fixed_ends: dict[int, tuple[torch.Tensor, int]] = {}

    def split_of(self, t: Any) -> Split | None:
        """The Split of `t`, if it holds split features that still go on."""
        entry = self.splits.get(id(t)) if isinstance(t, torch.Tensor) else None
        if entry is None or entry[0] is not t:
            return None
        # Once every layer behind a split has had it end somewhere, none of them will stay
        # split (each is kept whole or gathered), so what follows sees whole tensors: a
        # normed latent (DeepSeek's q_a_proj) does not tie the next layer into its span.
        if all(src in self.facts.broken for src in entry[1].sources):
            return None
        return entry[1]

    def piece_of(self, t: Any) -> Piece | Literal[False] | None:
        """(layer, offset, size) of the fused piece `t` holds; None where it holds features
        of several pieces; False where it holds all of its layers' features."""
        if not isinstance(t, torch.Tensor) or id(t) not in self.pieces:
            return False
        if self.splits.get(id(t), (None,))[0] is not t:
            return False
        return self.pieces[id(t)]

    def stacked_at(self, t: Any) -> tuple[int, tuple[Piece, ...]] | None:
        """(dim, pieces) where `t` holds fused pieces side by side along a dim of its own."""
        entry = self.stacked.get(id(t)) if isinstance(t, torch.Tensor) else None
        return None if entry is None or entry[0] is not t else entry[1:]

    def fixed_at(self, t: Any) -> int | None:
        """The units at either end of `t`'s split dim a constant counted (`fixed_ends`)."""
        entry = self.fixed_ends.get(id(t)) if isinstance(t, torch.Tensor) else None
        return None if entry is None or entry[0] is not t else entry[1]

    def hold_piece(self, t: torch.Tensor, piece: Piece | None) -> None:
        """`t` (split, marked) holds this piece of its layer's features (None: pieces met)."""
        self.pieces[id(t)] = piece

    def use_pieces(self, op_ins: list[Any], order_blind: bool) -> set[Piece]:
        """An op reads these tensors: count its reads of pieces (but by ops blind to the
        order of the features), and return the pieces it reads that a cut carved finer: only
        a cut of its own may read those (`cut_here`)."""
        self.cut_here = set()
        if order_blind:
            return set()
        seen = {p for t in op_ins if (p := self.piece_of(t))}
        for piece in seen:
            self.piece_uses[piece] = self.piece_uses.get(piece, 0) + 1
        return seen & self.carved

    @staticmethod
    def carved_reason(pieces: set[Piece]) -> str:
        """Why reading these pieces whole ends the split."""
        src, start, size = min(pieces)
        return (
            f"it reads the {size} features at {start} of {src} whole, which are cut into finer "
            "fused pieces elsewhere; each rank holds its slice of each finer piece, not of this one"
        )

    def only_split(self, t: torch.Tensor) -> Split:
        """The Split of an operand a rule needs split."""
        s = self.split_of(t)
        if s is None:
            raise SplitEnds("unexpected unsplit operand")
        return s

    def mark(self, t: torch.Tensor, split: Split, op: str) -> None:
        """`t`, made by `op`, holds these split features."""
        facts = self.facts
        self.splits[id(t)] = (t, split)
        if len(split.sources) == 1:
            (src,) = split.sources
            if split.n < facts.openers.get(src, 0) and src not in facts.parts:
                facts.heads.setdefault(src, split.n)  # the first view into (heads, head_dim)
        stacked = self.stacked_at(t)
        if self.fixed_at(t) is not None and id(t) not in self.pieces:
            # a view of every piece side by side, counted as a sum (or by -1)
            for s in split.sources:
                facts.units[s] = math.gcd(facts.units.get(s, split.n), split.n)
                facts.summed_units.setdefault(s, set()).add(split.n)
        else:
            self.note_units(split, self.pieces.get(id(t)), stacked[1] if stacked else ())
        for s in split.sources:
            facts.ops.setdefault(s, set()).add(op)
        if len(split.sources) > 1:
            facts.links.add(split.sources)

    def note_units(
        self,
        split: Split,
        piece: Piece | Literal[False] | None = None,
        stacked: tuple[Piece, ...] = (),
    ) -> None:
        """The split's features met blocks of `split.n` per tensor (groups of channels) that
        a rank must hold whole: tp must divide that count too. Also kept apart by `piece`,
        the one piece of a fused layer the tensor holds, or the pieces it holds side by side
        along a dim of its own (`stacked`), if any: a shared key/value piece need not split
        tp ways."""
        facts, n = self.facts, split.n
        for s in split.sources:
            facts.units[s] = math.gcd(facts.units.get(s, n), n)
        for p in (piece,) if piece else stacked:
            facts.piece_units[p] = math.gcd(facts.piece_units.get(p, n), n)
        if piece or stacked:
            return
        for s in split.sources:
            facts.plain_units.setdefault(s, set()).add(n)

    def open(self, name: str, out: torch.Tensor, features: int, op: str, at: int = -1) -> None:
        """`name` made `out` from an unsplit input: its dim `at` (the last, or a
        convolution's channels) holds `features` features of `name`'s own, which a tp-way
        split cuts into contiguous chunks."""
        self.facts.openers[name] = features
        self.mark(out, Split(at % out.dim(), 1, features, 1, frozenset({name})), op)

    def open_linear(self, name: str, out: torch.Tensor, features: int, at: int = -1) -> None:
        """A Linear's output, unless an earlier pass found its split ends anyway: then its
        output is whole, so it ties no one to it."""
        if name in self.kept_whole:
            self.facts.openers[name] = features
            for reason in self.kept_whole[name]:
                self.facts.break_(frozenset({name}), reason)
            return
        self.open(name, out, features, "linear", at)

    def arrive(self, name: str, x: Any, contracted: int = -1) -> None:
        """A Linear is called on `x`: split on the dim it contracts (`contracted`: the last,
        or a convolution's channels), it closes the span (row-parallel); split on
        another dim, the split ends there. A Linear called both ways can take neither role
        (`misfits`)."""
        facts = self.facts
        s = self.split_of(x)
        role = "opener" if s is None else "closer"
        if s is not None and x is not None and (s.dim != contracted % x.dim() or s.outer != 1):
            facts.break_(s.sources, "it reaches a Linear along a dim the Linear does not contract")
            facts.misfits[name] = "its input arrives split along a dim it does not contract"
        elif s is not None:
            if name in facts.closers and not facts.closers[name].same_cut(s):
                facts.misfits[name] = "it is called twice with inputs split differently"
            facts.closers[name] = s
            facts.links.add(s.sources | {name})
        if (role == "opener" and name in facts.closers) or (
            role == "closer" and name in facts.openers
        ):
            facts.misfits[name] = "it is called both on split and on unsplit inputs"

    def arrive_at_lookup(self, ids: Any) -> None:
        """Split features used as the indices of an embedding lookup end there."""
        s = self.split_of(ids)
        if s is not None:
            self.facts.break_(s.sources, "it is used as indices of an embedding lookup")
