"""Step 4 of dtensor_regions.py: key/value heads past their count inside a proven region.

Start at `share_heads` (key/value layers of their own, kept whole for every split head)
and `share_fused` (a fused q|k|v whose key/value pieces no way split). Where tp is a
multiple of the key/value heads, each rank holds and computes the one head its query heads
use, and the region's code sees that head in every head's place (compile/shared_heads.py,
compile/region_pieces.py); the region is kept so only where its run at tp gathers nothing
and its run at one head per rank proves the code reads no other head
(check/regions_dtensor.py's `one_head_per_rank`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import nn

from ..plan.schema import Plan, Rule
from ..plan.styles import ColwiseRule, ReplicateRule
from .region_cuts import Cut
from .region_rules import SHARED, UNEQUAL, rewrite

if TYPE_CHECKING:
    from ..check.run import Inside

__all__ = ["Trial", "share_fused", "share_heads"]


class Trial(NamedTuple):
    """What a proof run of a region's rules needs from dtensor_regions.py."""

    model: nn.Module
    tp: int
    call: tuple[tuple[Any, ...], dict[str, Any]]
    """The (args, kwargs) the model is called with, meta tensors."""
    plan_with: Callable[[dict[str, dict[str, Rule]]], Plan]
    """The plan with these regions' rules."""
    inside: Callable[[str, dict[str, Rule]], list[str]]
    """The split layers inside a region, whose collectives are their own calls'."""


def share_heads(
    run: Trial,
    rules: dict[str, Rule],
    proven: dict[str, dict[str, Rule]],
    sums: dict[str, int],
) -> None:
    """Key/value layers a proven region keeps whole for every split head to share (`SHARED`)
    made to share whole heads instead, where tp is a multiple of their heads: each rank
    holds and computes the one head its query heads use, and hands the region's code the
    whole width with that head in every place (compile/shared_heads.py). Their heads are
    the most that divide tp and their widths for which the region, run at tp and at one
    head per rank, proves it (check/regions_dtensor.py's `one_head_per_rank`); `proven` is
    updated in place."""
    kept: dict[str, dict[str, int]] = {}  # {region: {layer kept whole: its output width}}
    for m, made in proven.items():
        opened = [_width(run.model, o) for o, r in made.items() if isinstance(r, ColwiseRule)]
        widest = max((w for w in opened if w is not None), default=0)
        # kept whole for every head to share, or (a width tp does not divide) before
        inside = {n: r for n, r in rules.items() if n.startswith(f"{m}.") and n not in made}
        widths = {
            k: _width(run.model, k)
            for k, r in {**inside, **made}.items()
            if isinstance(r, ReplicateRule)
            and (r.why.startswith(SHARED) or 0 < (_width(run.model, k) or widest) < widest)
        }
        if widths and all(w is not None for w in widths.values()):
            kept[m] = {k: int(w) for k, w in widths.items() if w is not None}
    tp = run.tp
    for heads in range(tp - 1, 1, -1):
        if tp % heads:
            continue
        trial = {
            m: {**proven[m], **{k: _shared_rule(k, w, heads, tp) for k, w in ws.items()}}
            for m, ws in kept.items()
            if all(w % heads == 0 for w in ws.values())
        }
        if not trial:
            continue
        for m, counted in _one_head_proven(run, {**proven, **trial}, trial).items():
            if sum(counted.forward.values()) == sums.get(m, 0):
                proven[m] = trial[m]
                del kept[m]


def _one_head_proven(
    run: Trial, regions: dict[str, dict[str, Rule]], trial: dict[str, dict[str, Rule]]
) -> dict[str, Inside]:
    """{region of `trial`: what its forward and backward ran} for the regions the plan with
    `regions`' rules runs at tp gathering nothing, whose run at one key/value head per rank
    proves they read only the rank's own (check/regions_dtensor.py)."""
    from ..check.regions_dtensor import one_head_per_rank
    from ..check.run import collectives_inside

    plan = run.plan_with(regions)
    model, (args, kwargs) = run.model, run.call
    modules = {m: run.inside(m, made) for m, made in trial.items()}
    at_tp = collectives_inside(
        plan, model, tp_size=run.tp, args=args, kwargs=kwargs, modules=modules
    )
    if at_tp is None:
        return {}
    refused = one_head_per_rank(plan, model, run.tp, at_tp, args=args, kwargs=kwargs)
    out = {}
    for m in trial:
        counted = at_tp.get(m)
        if counted is None or m in refused or counted.gathers():
            continue
        if any(not op.startswith(("all_reduce", "all_gather")) for op in counted.backward):
            continue
        out[m] = counted
    return out


def share_fused(
    run: Trial,
    rules: dict[str, Rule],
    cuts: dict[str, Cut],
    proven: dict[str, dict[str, Rule]],
    sums: dict[str, int],
    bounds: dict[str, set[int]],
) -> None:
    """Regions no way proved whose fused opener the code cuts into pieces of several sizes
    (q|k|v of grouped heads), tried once more with its narrower pieces' heads shared among
    ranks where tp is a multiple of them: each rank its slice of the query piece and the
    whole head its query heads use of each key/value piece, which the region's code sees in
    every head's place (compile/region_pieces.py), proven as `_share_heads` proves separate
    layers. `proven` and `sums` are updated in place."""
    left, tp = dict(cuts), run.tp
    for heads in range(tp - 1, 1, -1):
        if tp % heads or not left:
            continue
        trial = {}
        for m, cut in left.items():
            made = rewrite(run.model, rules, m, cut, UNEQUAL, 1, bounds)
            fits = _fused_shared(made, heads, tp, cut) if made else None
            if fits is not None:
                trial[m] = fits
        if not trial:
            continue
        for m, counted in _one_head_proven(run, {**proven, **trial}, trial).items():
            if not (left[m].leaky and counted.returned_split):
                proven[m], sums[m] = trial[m], sum(counted.forward.values())
                del left[m]


def _fused_shared(made: dict[str, Rule], heads: int, tp: int, cut: Cut) -> dict[str, Rule] | None:
    """`made` (a region's rules, its fused openers in their unequal pieces) with each fused
    opener's narrower pieces as `heads` shared heads, where every wider piece splits `tp`
    ways and every narrower one into `heads` heads of one size; None where none fits."""
    out, changed = dict(made), False
    to = ", ".join(n.rsplit(".", 1)[-1] for n in cut.closes)
    for name, rule in made.items():
        if not isinstance(rule, ColwiseRule) or not rule.parts or len(set(rule.parts)) < 2:
            continue
        widest = max(rule.parts)
        narrow = [n for n in rule.parts if n < widest]
        if any(n % heads for n in narrow) or any(n % tp for n in rule.parts if n == widest):
            return None
        unit = min(narrow) // heads
        if any(n % unit or n // unit >= tp for n in narrow):
            return None
        out[name] = rule.model_copy(
            update={
                "replicate_heads": True,
                "head_dim": unit,
                "why": (
                    f"its {sum(rule.parts)} output features are the pieces its code cuts them "
                    f"into, {rule.parts}: each rank its slice of the widest, and of each "
                    f"narrower one ({heads} key/value heads of {unit}, fewer than the ranks) "
                    f"the whole head its query heads use, held so through the module's own "
                    f"code (a DTensor region) to {to}, which contracts them (rowwise); the code "
                    "sees that head in every head's place, proven on fake ranks at tp "
                    f"{heads} (one head per rank) to read only it"
                ),
            }
        )
        changed = True
    return out if changed else None


def _width(model: nn.Module, name: str) -> int | None:
    """A Linear's output features (None for any other module)."""
    m = model.get_submodule(name)
    return m.out_features if isinstance(m, nn.Linear) else None


def _shared_rule(name: str, width: int, heads: int, tp: int) -> ColwiseRule:
    size = width // heads
    return ColwiseRule(
        match=name,
        replicate_heads=True,
        head_dim=size,
        local_output=False,
        why=(
            f"its {width} output features are {heads} key/value heads of {size}, fewer than "
            f"the ranks: each head goes whole to the {tp // heads} ranks whose query heads it "
            f"serves (a rank holds and computes one head, its KV cache 1/{heads} of the "
            "model's); the region's code sees the whole width with the rank's head in every "
            f"head's place, proven on fake ranks at tp {heads} (one head per rank) to read "
            "only that one; its gradient is summed over the ranks sharing it"
        ),
    )
