"""Grouped key/value heads past their count inside a DTensor region (issue 35 b with h's
sharing): attention whose code sizes its heads by numbers (`view(b, t, 8, 6)`), so it runs
as a region, at a tp size above its key/value heads (tp 4 and 8 over 2).

Before, the key/value layers stayed whole on every rank (1.5x a Megatron split's elements at
tp 4). Now each rank holds and computes the one head its query heads use, and the region's
code sees the whole width with that head in every head's place (`replicate_heads` with
`local_output: false`). That is right only where the code reads no other head for a rank's
query heads, which check proves by running the region at one head per rank (tp 2): code
that mixes the key/value heads, or reduces over them, keeps the layers whole, with the
reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.models import AttentionLm, token_batch
from support.parity import (
    assert_parity,
    assert_the_original_state,
    every_call_collectives,
    simulated_ranks,
)
from torch import nn

import tpplan
from tpplan.plan.styles import ColwiseRule, ReplicateRule

WIDTH, HEADS, KV, HEAD_DIM, VOCAB = 32, 8, 2, 6, 64


class _Attention(nn.Module):
    """Separate q, k and v layers, their heads sized by numbers, joined `style`'s way."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.q = nn.Linear(WIDTH, HEADS * HEAD_DIM)
        self.k = nn.Linear(WIDTH, KV * HEAD_DIM)
        self.v = nn.Linear(WIDTH, KV * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 8, 6).transpose(1, 2)  # (B, H, T, D)
        k = self.k(x).view(b, t, 2, 6).transpose(1, 2)  # (B, KV, T, D)
        v = self.v(x).view(b, t, 2, 6).transpose(1, 2)
        style = self.style
        if style in ("mixed", "mixed_gqa"):  # every key/value head mixed with the other
            k = k + k.flip(1)
        if style == "centred":  # a reduction over the key/value heads
            k = k - k.mean(dim=1, keepdim=True)
        if style == "expand":
            k, v = (z[:, :, None].expand(b, 2, 4, t, 6).reshape(b, 8, t, 6) for z in (k, v))
        elif style in ("sdpa_gqa", "mixed_gqa"):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.o(a.transpose(1, 2).reshape(b, t, 48))
        else:
            k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
        if style in ("softmax", "weights"):
            keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
            s = s.masked_fill(~keep, float("-inf"))
            a = s.softmax(-1) @ v
            if style == "weights":  # the weights averaged over heads, used: a gradient
                w = s.softmax(-1).mean(dim=1)  # (B, T, T)
                return self.o(a.transpose(1, 2).reshape(b, t, 48)) + w @ x
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, 48))


def _model(style: str) -> AttentionLm:
    torch.manual_seed(0)
    return AttentionLm(lambda: _Attention(style), VOCAB, WIDTH)


def _ids() -> torch.Tensor:
    return token_batch(VOCAB, batch=2, seq=6)


def _held(model: nn.Module, plan: tpplan.Plan, tp: int, name: str) -> int:
    """The elements rank 0 holds of parameter `name` under `plan` on `tp` simulated ranks;
    the sharded model's full state dict is the original's."""
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        assert_the_original_state(sharded, model)
        local = sharded.get_parameter(name).to_local()  # a LocalTensor: every rank's
        return int(local._local_tensors[0].numel())


STYLES = ["repeat", "expand", "softmax", "weights", "sdpa_gqa"]


@pytest.mark.parametrize(("style", "tp"), [*((s, 4) for s in STYLES), ("repeat", 8)])
def test_each_rank_holds_the_key_value_head_its_query_heads_use(style: str, tp: int) -> None:
    model = _model(style)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=_ids())
    assert [r.match for r in plan.regions] == ["attn"]
    rules = {r.match: r for r in plan.rules}
    for name in ("attn.k", "attn.v"):
        rule = rules[name]
        assert isinstance(rule, ColwiseRule), rule
        assert (rule.replicate_heads, rule.head_dim, rule.local_output) == (True, 6, False)
        assert f"each head goes whole to the {tp // 2} ranks" in rule.why
        assert "proven on fake ranks at tp 2 (one head per rank)" in rule.why
    assert "sharing whole key/value heads" in plan.regions[0].why
    assert not tpplan.check_plan(plan, model, tp_size=tp)
    assert_parity(model, plan, tp, _ids())
    # one head of the two: half the weight, where whole it was all of it
    assert _held(model, plan, tp, "attn.k.weight") == HEAD_DIM * WIDTH
    sums = 2 if style == "weights" else 1  # the closer's, and the average over heads
    calls = every_call_collectives(model, plan, tp, _ids(), "AttentionLm.attn")
    assert calls == {"all_reduce": sums}, calls


def test_at_a_tp_dividing_the_key_value_heads_the_layers_split_as_before() -> None:
    model = _model("repeat")
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=_ids())
    k = next(r for r in plan.rules if r.match == "attn.k")
    assert isinstance(k, ColwiseRule) and not k.replicate_heads and k.local_output is False
    assert_parity(model, plan, 2, _ids())


@pytest.mark.parametrize(
    ("style", "said"),
    [
        ("mixed", "its code ran"),
        ("centred", "it reduces over the key/value heads"),
    ],
)
def test_code_reading_other_key_value_heads_keeps_them_whole(style: str, said: str) -> None:
    """Inferred: the layers stay whole, as before. Written by hand: check refuses the plan
    with the reason the run at one head per rank gives."""
    model = _model(style)
    plan = tpplan.infer_plan(model, tp_size=4, example_inputs=_ids())
    k = next(r for r in plan.rules if r.match == "attn.k")
    assert isinstance(k, ReplicateRule), k
    assert_parity(model, plan, 4, _ids())
    rules = [
        ColwiseRule(
            match=r.match, replicate_heads=True, head_dim=6, local_output=False, why="by hand"
        )
        if r.match in ("attn.k", "attn.v")
        else r
        for r in plan.rules
    ]
    problems = tpplan.check_plan(plan.model_copy(update={"rules": rules}), model, tp_size=4)
    assert len(problems) == 1, problems
    p = problems[0]
    assert p.module == "attn" and p.rule == "regions[0] (match: attn)"
    assert p.message.startswith("k, v: at tp 2 (one key/value head per rank) ")
    assert said in p.message
    assert "which is right only where each rank reads its own head" in p.message
    assert p.fix == "keep the layer whole (style: replicate), or rerun `tpplan infer`."


def test_handing_shared_heads_on_outside_a_region_is_refused() -> None:
    model = _model("repeat")
    plan = tpplan.infer_plan(model, tp_size=4, example_inputs=_ids())
    problems = tpplan.check_plan(plan.model_copy(update={"regions": []}), model, tp_size=4)
    found = [p for p in problems if p.module == "attn.k"]
    assert found and found[0].message.startswith(
        "attn.k shares whole key/value heads and hands its output on (local_output: false), "
        "but no region of the plan holds it"
    )
    assert found[0].fix == (
        "list the module whose code reads it in the plan's regions, or drop local_output: false."
    )


def test_grouped_sdpa_on_whole_key_value_heads_runs_on_dtensors() -> None:
    """SDPA's enable_gqa on key/value heads kept whole beside split query heads: on local
    shards each rank's one query head met both key/value heads, a wrong answer (off by 0.56
    before); the region now stays on DTensors, which repeat them to the query's heads."""
    model = _model("mixed_gqa")
    plan = tpplan.infer_plan(model, tp_size=4, example_inputs=_ids())
    assert isinstance(next(r for r in plan.rules if r.match == "attn.k"), ReplicateRule)
    assert_parity(model, plan, 4, _ids())
    with simulated_ranks(4) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        how = sharded.attn.__dict__["_tpplan_region"]
    assert how.startswith("DTensor") and "SDPA with enable_gqa on key/value heads" in how, how


class _Fused(nn.Module):
    """q|k|v in one Linear (8 query heads of 6, 2 key/value heads), cut by numbers."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.qkv = nn.Linear(WIDTH, (HEADS + 2 * KV) * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, WIDTH)
        if style in ("norms", "layer_norm"):
            self.q_norm = nn.RMSNorm(48)  # over every query head's features
            kind = nn.RMSNorm if style == "norms" else nn.LayerNorm
            self.k_norm = kind(12)  # over every key/value head's features
            with torch.no_grad():  # a weight far from ones, so its gradient is not trivial
                self.k_norm.weight.copy_(torch.linspace(0.5, 1.5, 12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        y = self.qkv(x)
        if self.style == "slices":
            q, k, v = y[..., :48], y[..., 48:60], y[..., 60:]
        elif self.style == "chunk":
            q, kv = y.split([48, 24], dim=-1)
            k, v = kv.chunk(2, dim=-1)
        else:
            q, k, v = y.split([48, 12, 12], dim=-1)
        if self.style in ("norms", "layer_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, 8, 6).transpose(1, 2)
        k, v = (z.view(b, t, 2, 6).repeat_interleave(4, dim=2).transpose(1, 2) for z in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = self.o(a.transpose(1, 2).reshape(b, t, 48))
        if self.style == "weights":  # the weights averaged over heads, used: a gradient
            p = (q @ k.transpose(-2, -1) * 6**-0.5).softmax(-1)  # (B, H, T, T)
            return out + p.mean(dim=1) @ x
        return out


def _fused(style: str) -> AttentionLm:
    torch.manual_seed(0)
    return AttentionLm(lambda: _Fused(style), VOCAB, WIDTH)


@pytest.mark.parametrize(
    ("style", "tp"),
    [("split", 4), ("slices", 4), ("chunk", 4), ("norms", 4), ("weights", 4), ("split", 8)],
)
def test_a_fused_layer_holds_its_query_slice_and_the_key_value_head_they_use(
    style: str, tp: int
) -> None:
    """Each rank its slice of the query piece and one whole key/value head of each other
    piece; a RMSNorm over every key/value head's features sums its statistics over the
    ranks (one all-reduce of a value per row, as the query norm's); attention weights by
    hand, averaged over heads and used, take the rank's own heads of the whole keys, whose
    gradient comes back whole."""
    model = _fused(style)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=_ids())
    assert [r.match for r in plan.regions] == ["attn"]
    qkv = next(r for r in plan.rules if r.match == "attn.qkv")
    assert isinstance(qkv, ColwiseRule)
    assert (qkv.parts, qkv.replicate_heads, qkv.head_dim, qkv.local_output) == (
        [48, 12, 12],
        True,
        6,
        False,
    )
    assert "(2 key/value heads of 6, fewer than the ranks)" in qkv.why
    assert not tpplan.check_plan(plan, model, tp_size=tp)
    assert_parity(model, plan, tp, _ids())
    # the closer's, each norm's statistics, the average over heads
    sums = {"norms": 3, "weights": 2}.get(style, 1)
    calls = every_call_collectives(model, plan, tp, _ids(), "AttentionLm.attn")
    assert calls == {"all_reduce": sums}, calls
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        assert_the_original_state(sharded, model)
        how = sharded.attn.__dict__["_tpplan_region"]
    # no local note gives a rank's cuts of pieces held whole: the region runs on DTensors
    assert how.startswith("DTensor") and "key/value heads ranks share" in how, how


def test_a_layer_norm_over_shared_key_value_heads_keeps_them_gathered() -> None:
    """A LayerNorm's mean and variance over every key/value head: no sum over the ranks
    makes them from one head per rank here, so the run at one head per rank, which sums
    them, refuses the sharing, and the fused layer is split then gathered as before."""
    model = _fused("layer_norm")
    plan = tpplan.infer_plan(model, tp_size=4, example_inputs=_ids())
    qkv = next(r for r in plan.rules if r.match == "attn.qkv")
    assert isinstance(qkv, ColwiseRule) and not qkv.replicate_heads
    assert qkv.output_layout() == "replicate"
    assert_parity(model, plan, 4, _ids())
