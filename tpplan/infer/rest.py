"""The Linear and Embedding layers no earlier step split: colwise with the output gathered
where only the data flow kept them whole, else replicated with the reason.

Start at `decide_rest`, the last step before sequence parallel.
"""

from __future__ import annotations

from torch import nn

from ..plan.rule import Rule
from ..plan.styles import ColwiseRule, HeadsRule, ReplicateRule
from .context import Context, Decided, Found
from .decision import NOT_CALLED, decided

__all__ = ["decide_rest"]


def decide_rest(ctx: Context, so_far: Decided) -> Found:
    """Every Linear and Embedding without a decision gets one, with the reason it stays
    whole (`Decided.kept`), or is split anyway with its output gathered."""
    t = ctx.trace
    found = Found()
    for name, module in ctx.modules.items():
        linear = name in t.layers.linears
        if not (linear or isinstance(module, nn.Embedding)) or name in so_far.decisions:
            continue
        parent = so_far.decisions.get(name.rpartition(".")[0])
        if isinstance(parent, HeadsRule):
            continue  # out_proj of an nn.MultiheadAttention split by heads: that style's own
        if name in ctx.tied and name not in t.layers.called:
            continue  # holds a tied weight it never uses: no rule; apply re-ties it
        whole = next((w for m, w in t.layers.whole.items() if name.startswith(f"{m}.")), None)
        if whole is not None:
            why = f"kept whole: {whole}"
        elif name not in t.layers.called:
            why = NOT_CALLED
        else:
            why = so_far.kept.get(
                name, "kept whole: its output is not split anywhere the tracer could follow"
            )
        router = t.experts.routers.get(name)
        if router is not None and name in t.layers.called and why != NOT_CALLED:
            # gathered, it would be exact too; whole, every rank scores the experts itself
            # before they run, where a split would save in*out/tp weights of a layer with a
            # few outputs for one all-gather per call (torchtitan's plan keeps it whole too)
            _, features, _ = t.layers.linears.get(name, (0, 0, False))
            found.routers[name] = _gathered(ctx, name, why) if linear else None
            why = (
                f"kept whole: a router ({why.removeprefix('kept whole: ')}; then its output "
                "reaches an integer input of the module holding the expert weights, its "
                f"routing): each rank scores all {features} of its outputs itself rather than "
                "gather them every call"
            )
            found.rules[name] = decided(ReplicateRule, why)
            continue
        found.rules[name] = (linear and _gathered(ctx, name, why)) or decided(ReplicateRule, why)
    return found


def _gathered(ctx: Context, name: str, why: str) -> Rule | None:
    """A layer whose output cannot stay split may still split its weight: colwise with
    the output gathered is exact whatever the model does next (the gathered output is the
    unsplit one), for one all-gather per call of its output features, and only when
    nothing but the data flow kept it whole. Small layers too (a linear attention's
    per-head gate inputs): the all-gather is of a few features per token, and the memory
    a plan saves should not depend on a size threshold of ours."""
    t = ctx.trace
    _, features, transposed = t.layers.linears[name]
    if (
        name in ctx.tied  # a tied or shared weight stays whole
        or ctx.used_outside(name)
        or name in t.spans.misfits
        or name not in t.layers.called
        or features % ctx.gather_tp
        # check reads a fused layer's pieces from the model and splits each (complete.py)
        or any(p % ctx.gather_tp for p in t.spans.parts.get(name, ()))
    ):
        return None
    reason = why.removeprefix("kept whole: ")
    return decided(
        ColwiseRule,
        f"its output cannot stay split ({reason}); so its {features} output features are split "
        "and gathered right after (one all-gather per call), which splits its weight and "
        "leaves what follows unchanged",
        output="replicate",
        transposed=transposed or None,
    )
