"""Regions of raw weights (issue 35 f): parameters a module uses in its own `x @ w`,
`torch.matmul`, `F.linear` or `einsum`, split in place (`split_params`) where the proof of
dtensor_regions.py passes, the module then a DTensor region.

`raw_params` finds them, `rewrite_raw` makes one way to split a module's (`RAW_WAYS`: the
dim each may split on, then a lone opener in equal fused pieces, a raw q|k|v or gate|up
weight), and `raw_kept` words why a module none of whose ways was proven stays whole.
"""

from __future__ import annotations

from torch import nn

from ..plan.schema import Rule
from ..plan.styles import ReplicateRule, SplitParamsRule
from .region_cuts import Cut, ParamDims

__all__ = ["CONVS", "RAW_WAYS", "raw_kept", "raw_params", "rewrite_raw"]

# the ways to split a module's raw weights, tried in turn: the dim each may split on (its
# first, second and last), then a lone opener in 3 equal fused pieces (a raw q|k|v weight)
# or 2 (gate|up) on each
RAW_WAYS = tuple((d, p) for p in (1, 3, 2) for d in (0, 1, -1))

# torch's own layers (and subclasses, such as a scaled or learned position embedding), whose
# styles say what they split
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TORCH_LAYERS = (nn.Linear, nn.Embedding, *CONVS, nn.MultiheadAttention)


def raw_params(model: nn.Module, rules: dict[str, Rule]) -> set[str]:
    """`module.param` for the parameters of 2 dims or more, none of size 1, that modules no
    rule splits hold themselves (a weight used in the module's own `x @ w` or einsum),
    outside torch's own layers."""
    out = set()
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        # kept whole with 3-D weights: per-head weights the experts pass found no expert in
        kept = isinstance(rules.get(name), ReplicateRule) and any(t.dim() >= 3 for t in own)
        torch_own = isinstance(module, _TORCH_LAYERS) or type(module).__module__.startswith(
            "torch.nn"
        )
        if not name or (name in rules and not kept) or torch_own:
            continue
        for p, t in module.named_parameters(recurse=False):
            # a dim of 1 is broadcast (a class token, position embeddings): not a weight,
            # and skipping them spares most models the fake forward that finds no use
            if t.dim() >= 2 and 1 not in t.shape:
                out.add(f"{name}.{p}")
    return out


def rewrite_raw(
    model: nn.Module,
    holder: str,
    cut: Cut,
    pick: int,
    pieces: int,
    tp: int,
    dims: dict[str, ParamDims],
) -> dict[str, Rule] | None:
    """A region of raw parameters: the holder's own parameters split where their matmul or
    einsum calls keep them in the output (openers) or contract them (closers), on the dim
    at `pick` of those each may be split on (its only one where it has one), kept whole
    where the cut keeps them (`Cut.shared`); a lone opener in `pieces` equal fused pieces
    when more than 1 (a raw q|k|v weight, each rank its slice of each). None where a member
    is a layer, a dim (or a piece) is not divided by tp, or pieces meet several openers."""
    members = {*cut.opens, *cut.closes}
    if (cut.kept and not cut.shared) or any("." in n[len(holder) + 1 :] for n in members):
        return None
    if cut.chained:
        # what a closer summed is cut again: every rank would all-reduce, then hold, all of
        # it (talking heads' mixed scores), no Megatron split (raw_kept says so)
        return None
    if pieces > 1 and len(cut.opens) != 1:
        return None
    shard: dict[str, int] = {}
    fused: dict[str, list[int]] = {}
    for role, names in (("opens", cut.opens), ("closes", cut.closes)):
        for n in names:
            found = getattr(dims.get(n), role, ())
            if not found:
                return None
            d = found[pick] if len(found) > 1 else found[0]
            size = model.get_parameter(n).shape[d]
            cut_in = pieces if role == "opens" else 1
            if size % (tp * cut_in):
                return None
            shard[n[len(holder) + 1 :]] = d
            if cut_in > 1:
                fused[n[len(holder) + 1 :]] = [size // cut_in] * cut_in
                # its bias, added to what it computes, is cut alike (else the pieces meet a
                # whole bias, and its gradient is gathered from the pieces' layout)
                for b, t in model.get_submodule(holder).named_parameters(recurse=False):
                    if t.dim() == 1 and t.shape[0] == size and b not in shard:
                        shard[b], fused[b] = 0, fused[n[len(holder) + 1 :]]
    opens = ", ".join(
        f"{n[len(holder) + 1 :]} (dim {shard[n[len(holder) + 1 :]]}"
        + (f", in {pieces} fused pieces, each rank its slice of each" if pieces > 1 else "")
        + ")"
        for n in cut.opens
    )
    closes = ", ".join(
        f"{n[len(holder) + 1 :]} (dim {shard[n[len(holder) + 1 :]]})" for n in cut.closes
    )
    return {
        holder: SplitParamsRule(
            match=holder,
            shard=shard,
            fused=fused or None,
            why=(
                f"its own weights, used in its code's matmul or einsum, are split: {opens} "
                f"open the split of what they compute, {closes} contract it; they stay "
                "DTensors through the module's code (a DTensor region)"
            ),
        )
    }


# how the experts pass words a module of 3-D weights no expert span split
_NO_EXPERTS = "kept whole: no per-expert matmul of its weights was seen"


def raw_kept(
    rules: dict[str, Rule],
    candidates: dict[str, list[Cut]],
    raw: set[str],
    proven: dict[str, dict[str, Rule]],
) -> dict[str, Rule]:
    """The reason of each module whose own weights a region was tried for and not proven:
    kept whole, saying so (where it had no rule, or the experts pass's reason, which is not
    why a module of per-head weights stays whole); a module with a split rule inside keeps
    its rules."""
    out: dict[str, Rule] = {}
    for m, ways in candidates.items():
        mine = sorted(n[len(m) + 1 :] for way in ways for n in {*way.opens, *way.closes} & raw)
        if m in proven or not mine:
            continue
        rule = rules.get(m)
        inside = any(n.startswith(f"{m}.") and r.splits for n, r in rules.items())
        if inside or not (rule is None or rule.why.startswith(_NO_EXPERTS)):
            continue
        tried = (
            "no way of splitting them in a DTensor region (on each dim they may split on, in "
            "1, 3 or 2 equal fused pieces) passed the proof on fake ranks: each ran a "
            "collective inside the module, or failed there"
        )
        weights = f"its own weights ({', '.join(dict.fromkeys(mine))})"
        chained = sorted({n[len(m) + 1 :] for way in ways for n in way.chained} & {*mine})
        if chained:
            tried = (
                f"{', '.join(chained)} mixes what the split heads computed (each head's "
                "result made from every head's, as talking heads mix the scores before the "
                "softmax), which the module's code then uses head by head: there is no "
                "Megatron split (split there, every rank would all-reduce all of it); and "
                + tried.replace("no way", "no other way", 1)
            )
        out[m] = ReplicateRule(
            match=m,
            why=(
                f"kept whole: {weights} feed its own matmul or einsum calls, and {tried}"
                if rule is None
                else f"{rule.why}; and for {weights}, {tried}"
            ),
        )
    return out
