"""Weights that are not an nn.Linear (issue 35 f): parameters a module uses directly in its own
`x @ w`, `torch.matmul`, `F.linear` or `einsum` (per-head weights shaped [heads, d_model,
d_head], an MLP's `w_in` [d_model, d_mlp]). Each such use is a call of a layer: the weights
whose outputs nothing split reached open a split along the dims they keep in the output, the
ones reading those outputs close it along the dims they contract. The module runs as a DTensor
region with its own weights split (`split_params`), its output summed once at its exit; the
proof on fake ranks keeps it only where nothing is gathered inside.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.models import seeded, token_batch
from support.parity import assert_parity, forward_collectives, one_counted_forward
from torch import nn

import tpplan
from tpplan._runtime.local import rank_values


def _w(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * shape[-2] ** -0.5)


class _RawAttention(nn.Module):
    """Attention over raw weights, its projections written `style`'s way."""

    def __init__(self, style: str, width: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.style, self.n_head, self.head_dim = style, n_head, width // n_head
        if style == "einsum":  # per-head weights
            self.w_q, self.w_k, self.w_v = (_w(n_head, width, self.head_dim) for _ in range(3))
            self.w_o = _w(n_head, self.head_dim, width)
        elif style == "einsum_heads_last":  # a head's features before the heads
            self.w_q, self.w_k, self.w_v = (_w(width, self.head_dim, n_head) for _ in range(3))
            self.w_o = _w(self.head_dim, n_head, width)
        elif style == "linear":  # stored as nn.Linear stores them: [out, in]
            self.w_q, self.w_k, self.w_v, self.w_o = (_w(width, width) for _ in range(4))
            self.b_q = nn.Parameter(0.1 * torch.randn(width))
        else:
            self.w_q, self.w_k, self.w_v, self.w_o = (_w(width, width) for _ in range(4))

    def _project(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.style == "matmul":
            return x @ w
        if self.style == "torch.matmul":
            return torch.matmul(x, w)
        if self.style == "linear":
            return F.linear(x, w, self.b_q if w is self.w_q else None)
        if self.style == "einsum_heads_last":
            return torch.einsum("btc,cdh->bthd", x, w)
        return torch.einsum("btc,hcd->bthd", x, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (self._project(x, w) for w in (self.w_q, self.w_k, self.w_v))
        q, k, v = (z.reshape(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        if self.style == "einsum":
            return torch.einsum("bthd,hdc->btc", a, self.w_o)
        if self.style == "einsum_heads_last":
            return torch.einsum("bthd,dhc->btc", a, self.w_o)
        a = a.reshape(b, t, self.n_head * self.head_dim)
        return F.linear(a, self.w_o) if self.style == "linear" else a @ self.w_o


class _RawMlp(nn.Module):
    """w_in [d_model, d_mlp] and w_out [d_mlp, d_model] with biases, by einsum."""

    def __init__(self, width: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.w_in, self.w_out = _w(width, hidden), _w(hidden, width)
        self.b_in, self.b_out = nn.Parameter(torch.zeros(hidden)), nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(torch.einsum("btc,cm->btm", x, self.w_in) + self.b_in)
        return torch.einsum("btm,mc->btc", h, self.w_out) + self.b_out


class _Model(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.attn, self.mlp = _RawAttention(style), _RawMlp()
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.attn(x)
        return self.head(x + self.mlp(x))


STYLES = ["matmul", "torch.matmul", "linear", "einsum", "einsum_heads_last"]
# {style: (the dim q, k and v split on, the dim the output weight splits on)}: by heads
SHARDS = {
    "matmul": (1, 0),
    "torch.matmul": (1, 0),
    "linear": (0, 1),
    "einsum": (0, 0),
    "einsum_heads_last": (2, 1),  # not a head's features, which split would need all-reduces
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("style", STYLES)
def test_raw_weights_split_the_megatron_way(style: str, tp: int) -> None:
    """The attention's and the MLP's own weights split by heads (the dim of several to split
    on that costs the fewest all-reduces) and hidden features, each
    module a region with one all-reduce in its forward and nothing gathered, every rank
    holding 1/tp of them; parity forward and backward on both execution paths."""
    torch.manual_seed(0)
    model = seeded(_Model, style=style)
    x = token_batch(64)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    rules = {r.match: r for r in plan.rules}
    heads, closes = SHARDS[style]
    assert rules["attn"].style == "split_params", plan.to_yaml()
    assert rules["attn"].shard == {"w_q": heads, "w_k": heads, "w_v": heads, "w_o": closes}
    assert rules["mlp"].shard == {"w_in": 1, "w_out": 0}
    assert sorted(r.match for r in plan.regions) == ["attn", "mlp"]
    assert "its own weights are split" in plan.regions[0].why
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)
    with one_counted_forward(model, plan, tp, x) as (sharded, comms):
        for name in ("attn", "mlp"):
            assert forward_collectives(comms, f"_Model.{name}") == {"all_reduce": 1}
        # each rank holds 1/tp of each split weight; its full tensor is the original
        for name, p in sharded.attn.named_parameters():
            if name.startswith("w_"):
                assert p.to_local().numel() * tp == p.numel()
                whole = rank_values(p.full_tensor())[0]
                assert torch.equal(whole, getattr(model.attn, name))


def test_verify_passes_the_inferred_plan_and_check_refuses_a_wrong_dim() -> None:
    """`verify` (forward and backward against the unsharded model) passes the inferred plan.
    Split on its other dim, the output weight no longer contracts the heads: the region
    would hand back its output split, and check's dry run refuses the plan."""
    from tpplan.diagnose.verify import verify_plan

    model = seeded(_Model, style="matmul")
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=token_batch(64))
    assert verify_plan(model, plan, tp_size=2, backward=True, tol=1e-4).ok
    rules = [
        r.model_copy(update={"shard": {**r.shard, "w_o": 1}}) if r.match == "attn" else r
        for r in plan.rules
    ]
    wrong = plan.model_copy(update={"rules": rules})
    problems = tpplan.check_plan(wrong, model, tp_size=2)
    assert [p.kind for p in problems] == ["dry_run"], problems
    assert "mixed torch.Tensor and DTensor" in str(problems[0])
