"""A fused q|k|v viewed as heads counted by a sum (issue 35 h, Falcon-7B's multi-query
layout): `view(B, T, self.num_heads + 2, D)`, its query heads then one key and one value
head, or `self.n_head + 2 * self.n_kv`, cut apart on the heads dim by numbers counted from
an end (`[..., :-2, :]`, `[..., [-2], :]`), by attributes plus a number, or by `split`
(and the same view counted by -1).

Each attribute of the sum is a count the plan divides, matched to the fused pieces it
counts; a number may count only key and value pieces of one head each, which every rank
holds whole (`replicate_heads`). So each rank views its own query heads and the shared
key/value heads, the block runs one all-reduce per call, and the state dict is the
original's. A number counting anything else (query heads, key/value heads that ranks
share out) is refused with the reason, and the attention is gathered as before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.models import AttentionLm, token_batch
from support.parity import assert_parity, every_call_collectives
from support.uneven_heads import falcon
from torch import nn

import tpplan

WIDTH, HEADS, HEAD_DIM, VOCAB = 32, 8, 6, 50


class _Attention(nn.Module):
    """q|k|v in one Linear, viewed as H + 2K heads and cut `style`'s way."""

    def __init__(self, style: str, kv: int) -> None:
        super().__init__()
        self.style, self.n_head, self.n_kv, self.head_dim = style, HEADS, kv, HEAD_DIM
        self.qkv = nn.Linear(WIDTH, (HEADS + 2 * kv) * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, WIDTH)

    def _cut(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, _ = y.shape
        style, d, h, kv = self.style, self.head_dim, self.n_head, self.n_kv
        if style.startswith("mqa"):
            g = y.view(b, t, h + 2, d)  # (B, T, H + 2, D)
            if style == "mqa_index":  # Falcon-7B's
                return g[..., :-2, :], g[..., [-2], :], g[..., [-1], :]
            if style == "mqa_slices":
                return g[..., :-2, :], g[..., -2:-1, :], g[..., -1:, :]
            if style == "mqa_split":
                return g.split([h, 1, 1], dim=2)
            if style == "mqa_bounds":  # bounds of an attribute plus a number
                return g[:, :, :h], g[:, :, h : h + 1], g[:, :, h + 1 :]
            k, v, q = g[..., :1, :], g[..., 1:2, :], g[..., 2:, :]  # k and v first
            return q, k, v
        if style == "sum_split":
            return y.view(b, t, h + 2 * kv, d).split([h, kv, kv], dim=2)
        if style == "sum_slices":
            g = y.view(b, t, h + 2 * kv, d)
            return g[:, :, :h], g[:, :, h : h + kv], g[:, :, h + kv :]
        if style == "minus1_split":  # counted by -1: each rank's own count of what it holds
            return y.view(b, t, -1, d).split([h, kv, kv], dim=2)
        if style == "sum_unflatten":
            return y.unflatten(-1, (h + 2 * kv, d)).split([h, kv, kv], dim=-2)
        if style == "kv_number":  # 2 key/value heads counted by a number: ranks share them out
            return y.view(b, t, h + 4, d).split([h, kv, kv], dim=2)
        assert style == "q_number", style  # the query heads counted by a number
        return y.view(b, t, 8 + 2 * kv, d).split([h, kv, kv], dim=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.transpose(1, 2) for z in self._cut(self.qkv(x)))  # (B, heads, T, D)
        group = self.n_head // self.n_kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.o(a.reshape(b, t, self.n_head * self.head_dim))


def _model(style: str, kv: int) -> AttentionLm:
    torch.manual_seed(0)
    return AttentionLm(lambda: _Attention(style, kv), VOCAB, WIDTH)


def _ids() -> torch.Tensor:
    return token_batch(VOCAB, batch=2, seq=6)


SPLIT = [
    *((s, 1) for s in ("mqa_index", "mqa_slices", "mqa_split", "mqa_bounds", "mqa_first")),
    *(
        (s, kv)
        for s in ("sum_split", "sum_slices", "sum_unflatten", "minus1_split")
        for kv in (1, 2)
    ),
]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(("style", "kv"), SPLIT)
def test_heads_counted_by_a_sum_split_the_megatron_way(style: str, kv: int, tp: int) -> None:
    model = _model(style, kv)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=_ids())
    rules = {r.match: r for r in plan.rules}
    qkv, kv_w = rules["attn.qkv"], kv * HEAD_DIM
    pieces = (
        [kv_w, kv_w, HEADS * HEAD_DIM] if style == "mqa_first" else [HEADS * HEAD_DIM, kv_w, kv_w]
    )
    assert (qkv.style, qkv.parts, qkv.output_layout()) == ("colwise", pieces, "shard(-1)")
    assert rules["attn.o"].style == "rowwise"
    assert "n_head" in {a for attr in plan.attributes for a in attr.divide}
    assert not tpplan.check_plan(plan, model, tp_size=tp)
    assert_parity(model, plan, tp, _ids())
    assert every_call_collectives(model, plan, tp, _ids(), "AttentionLm.attn") == {"all_reduce": 1}


@pytest.mark.parametrize(
    ("style", "kv", "written"), [("kv_number", 2, "n_head + 4"), ("q_number", 1, "2 * n_kv + 8")]
)
def test_a_number_counting_heads_ranks_do_not_all_hold_is_refused(
    style: str, kv: int, written: str
) -> None:
    """On a rank the number stays what it is, where its heads would shrink."""
    model = _model(style, kv)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=_ids())
    qkv = next(r for r in plan.rules if r.match == "attn.qkv")
    assert qkv.output_layout() == "replicate"
    assert f"a view counts its heads as {written}, whose" in qkv.why
    assert "only key and value pieces of one head each, whole on every rank" in qkv.why
    assert_parity(model, plan, 2, _ids())


# CommDebugMode tracks modules with backward hooks, which warn of the model's output class
@pytest.mark.filterwarnings("ignore:For backward hooks to be called")
@pytest.mark.parametrize("tp", [2, 4])
def test_falcon_multi_query_splits_its_heads_and_keeps_one_key_value_head_per_rank(
    tp: int,
) -> None:
    """transformers' Falcon with `multi_query` (Falcon-7B's attention): its
    query heads split, its key and value head whole on every rank, its FalconLinear (a
    Linear written out) run on local shards. 12 heads: 8 would equal its head size, and
    which of the two a view read could not be told."""
    model, ids = falcon(12), token_batch(64)
    plan = tpplan.infer_plan(model, tp_size=tp)
    qkv = next(r for r in plan.rules if r.match.endswith("query_key_value"))
    assert (qkv.parts, qkv.replicate_heads, qkv.output_layout()) == (
        [96, 8, 8],
        True,
        "shard(-1)",
    )
    assert {a for attr in plan.attributes for a in attr.divide} == {"num_heads"}
    assert not tpplan.check_plan(plan, model, tp_size=tp)
    assert_parity(model, plan, tp, ids)
    with torch.no_grad():  # CommDebugMode's backward hooks refuse Falcon's in-place residual
        calls = every_call_collectives(model, plan, tp, ids, "FalconForCausalLM.transformer.h.0")
    assert calls == {"all_reduce": 2}, calls  # the attention's dense and the MLP's, no gather


def test_falcon_7b_heads_tp_does_not_divide_split_unevenly() -> None:
    """71 heads at tp 8 (Falcon-7B's): each rank 9 or 8 query heads and the key and value
    head; simulated ranks cannot slice a dim whose size differs by rank, which verify says
    (real ranks run it: test_processes.py)."""
    model = falcon(71)
    plan = tpplan.infer_plan(model, tp_size=8, example_inputs=token_batch(64))
    qkv = next(r for r in plan.rules if r.match.endswith("query_key_value"))
    assert (qkv.uneven, qkv.group, qkv.parts) == (True, 71, [568, 8, 8])
    assert "each rank holds 9 or 8 whole heads" in qkv.why
    assert not tpplan.check_plan(plan, model, tp_size=8)
    with pytest.raises(tpplan.TpplanError, match="tpplan verify --processes"):
        tpplan.verify_plan(model, plan, tp_size=8, inputs={"input_ids": token_batch(64)})


def test_a_family_plan_does_not_split_heads_unevenly() -> None:
    """An uneven split states its model's head size and count, which a plan for every size of
    a family (`tpplan infer --family`, the shipped plans) cannot: there the heads tp does not
    divide stay gathered, and the reason names the query heads and the way to split them."""
    model = falcon(5)
    plan = tpplan.infer_plan(model, tp_size=2, split_unevenly=False)
    qkv = next(r for r in plan.rules if r.match.endswith("query_key_value"))
    assert qkv.output_layout() == "replicate" and qkv.uneven_group() is None
    assert "tp 2 does not divide its 5 query heads" in qkv.why
    assert "infer one for a model and tp size to split them unevenly" in qkv.why
