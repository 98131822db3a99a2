"""Step 2 of dtensor_regions.py: one way to cut a module into a region, as rules.

Start at `rewrite`: the openers colwise handing DTensors on (plain, in equal fused pieces,
in pieces of the width every opener shares, or in the unequal pieces the code cuts an
opener into), the closers rowwise, the layers every split head shares kept whole.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from ..plan.schema import Rule
from ..plan.styles import ColwiseRule, ReplicateRule, RowwiseRule
from .raw_regions import CONVS
from .region_cuts import Cut

__all__ = ["SHARED", "UNEQUAL", "rewrite"]

# the way to cut in the unequal pieces the code cuts an opener's features into
UNEQUAL = -1
# how a key/value layer kept whole for every split head to share begins its reason
SHARED = "kept whole: its output is narrower than"


def rewrite(
    model: nn.Module,
    rules: dict[str, Rule],
    holder: str,
    cut: Cut,
    pieces: int,
    tp: int,
    bounds: dict[str, set[int]],
) -> dict[str, Rule] | None:
    """The region's rules: openers colwise handing DTensors on (cut into `pieces` equal
    fused pieces when more than 1), closers rowwise, kept layers whole; None when the
    pieces do not fit. `pieces` 0: every opener and closer in pieces of the size all the
    openers' widths share (`_common_pieces`). `UNEQUAL`: each opener whose features the
    code cuts apart at `bounds` into pieces of several sizes opens in those pieces, held as
    such (compile/region_pieces.py); None where no opener is."""
    opens, closes = cut.opens, cut.closes
    out: dict[str, Rule] = {}
    by = ", ".join(n[len(holder) + 1 :] for n in opens)
    to = ", ".join(n[len(holder) + 1 :] for n in closes)
    common = _common_pieces(model, rules, cut, tp) if pieces == 0 else {}
    if common is None:
        return None
    for o in opens:
        given = rules[o].part_sizes()
        features = sum(given) if given else _width(model, rules, o, 0)
        if features is None:
            return None
        parts = common.get(o)
        if pieces == UNEQUAL:
            parts = _unequal(bounds.get(o, set()), features, tp)
        if pieces > 1:
            if features % (pieces * tp):
                return None
            parts = [features // pieces] * pieces
        split = ""
        if parts and len(set(parts)) > 1:
            split = (
                f"as the pieces its code cuts them into, {parts}, each rank its slice of every "
                "piece (held as such: no DTensor layout has pieces of several sizes), "
            )
        elif parts:
            split = f"as {len(parts)} pieces of {parts[0]}, each rank its slice of every piece, "

        out[o] = ColwiseRule(
            match=o,
            parts=parts,
            transposed=rules[o].stored_transposed() or None,
            local_output=False,
            why=(
                f"its {features} output features are split {split}and stay a DTensor through "
                f"the module's own code (a DTensor region) to {to}, which contracts them "
                "(rowwise)"
            ),
        )
    if pieces == UNEQUAL and not any(isinstance(r, ColwiseRule) and r.parts for r in out.values()):
        return None  # the plain way, tried already
    for c in closes:
        parts = common.get(c)
        joined = (
            f" joined as {len(parts)} pieces of {parts[0]}, each rank its slice of every piece"
            if parts
            else ""
        )
        out[c] = RowwiseRule(
            match=c,
            parts=parts,
            transposed=rules[c].stored_transposed() or None,
            why=(
                f"contracts the features split by {by}, which reach it as a DTensor{joined}; "
                "its output is a partial sum, one all-reduce"
            ),
        )
    for k in cut.kept if cut.shared else ():
        out[k] = ReplicateRule(
            match=k,
            why=(
                f"{SHARED} {by}'s and every split head "
                "shares it (one key/value head, or fewer than the ranks), so each rank "
                "uses it whole through the module's own code (a DTensor region); its "
                "gradient, each rank's heads' share, is summed over the ranks in the backward"
            ),
        )
    for k in cut.kept if not cut.shared else ():
        out[k] = ReplicateRule(
            match=k,
            why=(
                f"kept whole: {', '.join(n[len(holder) + 1 :] for n in cut.readers[k])}, which "
                "opens the region's split, reads its output whole through the module's own "
                "code (a latent projection and its norm); what of it every split head shares "
                "(a rotary key part) has its gradient gathered from the heads in the backward"
            ),
        )
    return out


def _unequal(bounds: set[int], features: int, tp: int) -> list[int] | None:
    """The pieces `bounds` cut `features` into, where they differ in size and each splits
    `tp` ways; None otherwise (pieces of one size are dtensor_regions.py's other ways)."""
    at = sorted({0, features, *(b for b in bounds if 0 < b < features)})
    parts = [b - a for a, b in itertools.pairwise(at)]
    if len(set(parts)) < 2 or any(n % tp for n in parts):
        return None
    return parts


def _common_pieces(
    model: nn.Module, rules: dict[str, Rule], cut: Cut, tp: int
) -> dict[str, list[int]] | None:
    """{layer: its parts} for a region whose code joins the openers' outputs with `cat`
    before a closer (Flux's single-stream block: the heads of 64 features and the MLP's 256
    before one proj_out of 320): all of them cut into pieces of the size every opener's
    width is a multiple of, so that joining rank r's slices is rank r's slice of every
    piece of the closer's input. Layers of one piece are left plain. None where it does
    not fit (that size not a multiple of tp, a closer of one piece)."""
    widths = {o: _width(model, rules, o, 0) for o in cut.opens}
    ins = {c: _width(model, rules, c, 1) for c in cut.closes}
    if any(rules[o].part_sizes() for o in cut.opens) or None in (*widths.values(), *ins.values()):
        return None
    size = math.gcd(*(w for w in widths.values() if w is not None))
    if size % tp or any(n is None or n % size or n == size for n in ins.values()):
        return None
    return {
        n: [size] * (w // size) for n, w in {**widths, **ins}.items() if w is not None and w > size
    }


def _width(model: nn.Module, rules: dict[str, Rule], name: str, side: int) -> int | None:
    """A Linear-like layer's (or a convolution's) output (`side` 0) or input (1) features."""
    m = model.get_submodule(name)
    n = getattr(m, ("out_features", "in_features")[side], None)
    if isinstance(n, int):
        return n
    if isinstance(m, CONVS) and m.groups == 1:  # a convolution of one group: its channels
        return int((m.out_channels, m.in_channels)[side])
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    return int(w.shape[side if not rules[name].stored_transposed() else 1 - side])
