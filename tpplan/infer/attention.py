"""torch's nn.MultiheadAttention split by its heads: `decide_attention`.

Start at `decide_attention`, which api.py calls before the steps that decide the rest. The
tracer calls an nn.MultiheadAttention that runs torch's own forward one step of the data flow
(trace/hooks.py's `hook_attention`): its computation is torch's, fixed, like nn.Linear's, and
the `heads` style (compile/attention.py) runs it on each rank's heads. What is checked here is
what that style needs of this model: the heads divide by the tp size, and no parameter of
the module is shared with another or used outside its own call.
"""

from __future__ import annotations

from torch import nn

from ..plan.styles import HeadsRule, ReplicateRule
from .context import Context, Decided, Found
from .decision import decided

__all__ = ["decide_attention"]


def decide_attention(ctx: Context, so_far: Decided) -> Found:
    """A `heads` decision for each nn.MultiheadAttention the forward called that can be split
    by heads; the others keep what the later steps decide (whole), with the reason in `kept`."""
    found = Found()
    for name, heads in ctx.trace.layers.attention.items():
        m = ctx.modules[name]
        assert isinstance(m, nn.MultiheadAttention)  # the tracer hooks no other
        why = _kept(ctx, name, m)
        if why is not None:
            # its out_proj is never called (the forward uses its weight): kept with it, not
            # traced on its own as a part the forward did not call
            found.rules[f"{name}.out_proj"] = decided(ReplicateRule, f"kept whole: {why}")
            continue
        head_dim = m.embed_dim // heads
        qkv = "q|k|v in in_proj_weight" if m._qkv_same_embed_dim else "q, k and v weights"
        found.rules[name] = decided(
            HeadsRule,
            f"nn.MultiheadAttention with torch's own forward: its {heads} heads of {head_dim} "
            f"split over the ranks ({qkv}, each rank its slice of each; out_proj contracts "
            "them, one all-reduce)",
            head_dim=head_dim,
        )
    return found


def _kept(ctx: Context, name: str, m: nn.MultiheadAttention) -> str | None:
    """Why the module cannot be split by heads, or None."""
    if m.num_heads % ctx.tp:
        return f"its {m.num_heads} heads do not split over tp size {ctx.tp}"
    if any(n == name or n.startswith(f"{name}.") for n in ctx.tied):
        return "it shares a parameter with another module"
    t = ctx.trace.params
    if any(p in t.outside or p in t.in_span for p in _params(m, name)):
        return "the model's forward also uses its parameters outside its call"
    return None


def _params(m: nn.Module, name: str) -> list[str]:
    return [f"{name}.{n}" for n, _ in m.named_parameters()]
