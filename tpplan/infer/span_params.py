"""The modules beside a span's Linears whose parameters meet its split tensors (per-head
norms, attention sinks, a GroupNorm or BatchNorm on split channels, a depthwise
convolution): whether each can follow the split (`param_holders`), and its rule
(`style_param_holders`): split one entry per head or channel (split_params), or replicated
with its gradient summed over the tp axis (replicate_grad_sum). spans.py's `decide_span`
calls both.
"""

from __future__ import annotations

from torch import nn

from ..plan.styles import ReplicateGradSumRule, SplitParamsRule
from .context import Context, Found
from .decision import decided
from .names import join, join_names, own_split_state

__all__ = ["param_holders", "style_param_holders"]


def param_holders(ctx: Context, openers: set[str], reasons: list[str]) -> list[str]:
    """Modules (not Linear) whose parameters meet this span's split tensors; those that
    cannot follow the split add their reason to `reasons` instead."""
    t = ctx.trace
    owners = {p.rpartition(".")[0] for p, srcs in t.params.in_span.items() if srcs & openers}
    # buffers split with the channels (a BatchNorm's running statistics, affine or not)
    owners |= {p.rpartition(".")[0] for p, srcs in t.params.split_vectors.items() if srcs & openers}
    out = []
    for owner in sorted(owners):
        module = ctx.modules.get(owner)
        label = owner.rpartition(".")[2] or type(module).__name__
        if not owner:
            # rules style submodules (parallelize_module matches child names): nothing
            # can split or sum the gradient of the root's own parameters
            reasons.append(
                "the model's own parameters (not a submodule's) meet its split tensors, "
                "and a plan styles submodules only"
            )
            continue
        if module is None or owner in t.layers.linears or isinstance(module, nn.Embedding):
            reasons.append(f"the weight of {label} is used inside the region outside its own call")
            continue
        own = own_split_state(module, owner, t.params.split_vectors)
        if any(
            p in t.params.outside or not (t.params.in_span.get(p, openers) <= openers) for p in own
        ):
            reasons.append(f"{label}'s parameters are used both inside and outside the region")
            continue
        split = [p for p in own if p in t.params.split_vectors]
        if split and (len(split) < len(own) or any(p in t.params.whole_vectors for p in split)):
            reasons.append(f"{label}'s parameters are used both split with the heads and whole")
            continue
        fused = sorted({o for p in split for o in _across_pieces(ctx, module, p)})
        if fused:
            reasons.append(
                f"{label}'s parameters (one entry per feature) meet all of {join(fused)}'s "
                "fused pieces at once, where each rank holds a slice of every piece, which "
                "their contiguous share would not match"
            )
            continue
        out.append(owner)
    return out


def _across_pieces(ctx: Context, module: nn.Module, param: str) -> list[str]:
    """The openers of fused pieces (`parts`) whose whole output, every piece side by side,
    the split vector `param` met entry by entry (before the forward cut the pieces apart)."""
    t = ctx.trace
    own = param.rpartition(".")[2]
    held = module.get_buffer(own) if own in module._buffers else module.get_parameter(own)
    size = held.shape[t.params.vector_dims.get(param, 0)]
    return [
        o
        for o in t.params.split_vectors[param]
        if len(t.spans.parts.get(o, ())) > 1 and t.spans.openers.get(o) == size
    ]


def style_param_holders(
    ctx: Context, found: Found, holders: list[str], openers: list[str], short: dict[str, str]
) -> None:
    """Modules whose parameters meet the split tensors: split one entry per head (a per-head
    sink), or replicated with their gradient summed over the tp axis (a per-head norm)."""
    for h in holders:
        own = own_split_state(ctx.modules[h], h, ctx.trace.params.split_vectors)
        by = join_names([short[o] for o in openers])
        if any(p in ctx.trace.params.split_vectors for p in own):
            names = [p.rpartition(".")[2] for p in own]
            tables = any(ctx.trace.params.vector_dims.get(p, 0) for p in own)
            entry, kind = (
                ("column", "a relative position bias looked up by rows")
                if tables
                else ("entry", "a per-head sink")
            )
            unit = "head"
            channels = {ctx.trace.params.channel_vectors.get(p) for p in own}
            if channels == {"norm"}:
                entry, kind, unit = "entry", "a GroupNorm's affine parameters", "channel"
            elif channels == {"batch"}:
                entry, kind, unit = "entry", "a BatchNorm, one channel at a time", "channel"
            elif channels and channels <= {"depthwise", "grouped"}:
                grouped = channels != {"depthwise"}
                kind = "a grouped convolution" if grouped else "a depthwise convolution"
                entry, unit = "kernel", "output channel"
                if len(own) > 1:
                    entry = "kernel (and bias entry)"
            entries = {"entry": "entries", "column": "columns"}.get(entry, "kernels")
            found.rules[h] = decided(
                SplitParamsRule,
                f"{join(names)} {'holds' if len(names) == 1 else 'hold'} one {entry} per "
                f"{unit} (per element of the dim split by {by}) and meets them element by "
                f"element ({kind}); split alike, each rank holds its own {unit}s' {entries}",
                shard={p.rpartition(".")[2]: ctx.trace.params.vector_dims.get(p, 0) for p in own},
            )
            continue
        found.rules[h] = decided(
            ReplicateGradSumRule,
            f"its parameters act on the split features of {by} inside the region; each "
            "rank's gradient is a partial sum, summed over the tp axis",
        )
