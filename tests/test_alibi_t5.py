"""Attention that meets a whole tensor of one plane per head, split the Megatron way.

BLOOM adds ALiBi, a bias of one row per (batch, head), `(B * heads, 1, k)`, to scores whose
heads are merged into the batch dim (`baddbmm`); T5's cross-attention, which has no
relative-position bias, adds zeros of shape `(1, heads, q, k)`. As DTensor regions each rank
takes its own heads' part of such a whole tensor (a local slice), and a whole tensor every
head shares is used as it is, its gradient summed over the ranks. Parity forward and
backward against the unsharded model on simulated ranks.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import tpplan
from tpplan import Plan
from tpplan._runtime.local import simulated_ranks
from tpplan._runtime.models import build_model
from tpplan.diagnose.stats import plan_stats

sys.path.insert(0, str(Path(__file__).parent))
from support.parity import assert_parity
from support.plans import expand_rules


# ---- whole tensors beside split heads ------------------------------------------------------
class _LearnedMask(nn.Module):
    """Attention given a learned additive mask: one plane all heads share, or one per head."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 48)
        self.out = nn.Linear(16, 8)
        self.mask = nn.Parameter(torch.randn(1, heads, 5, 5, generator=torch.Generator()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in self.qkv(x).split(16, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)  # (B, nh, T, hs)
        return self.out(y.transpose(1, 2).reshape(b, t, 16))


@pytest.mark.parametrize("heads", [1, 4])
def test_a_learned_mask_beside_split_heads_gets_its_whole_gradient(heads: int) -> None:
    """A whole mask every head shares is used as it is on each rank, and its gradient, each
    rank's share from its own heads, is summed over the ranks; one of one plane per head is
    cut to each rank's heads and its gradient gathered. Parity forward and backward."""
    plan = Plan.model_validate(
        {
            "tpplan": 10,
            "rules": [
                {"match": "0.qkv", "style": "colwise", "local_output": False,
                 "parts": [16, 16, 16], "why": "opens"},
                {"match": "0.out", "style": "rowwise", "why": "closes"},
            ],
            "regions": [{"match": "0", "why": "runs on DTensors"}],
        }
    )  # fmt: skip
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    assert_parity(nn.Sequential(_LearnedMask(heads)), plan, 2, x)


# ---- the batched matmuls on their own ---------------------------------------------------------
class _MergedHeads(nn.Module):
    """BLOOM's attention in small: q|k|v interleaved per head, heads merged into the batch
    dim, a whole bias of one row per (batch, head) made in forward (ALiBi's shape), and a
    learned one every batch shares (broadcast, its gradient summed over every head)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 48)  # 4 heads, each its q, k, v of 4
        self.out = nn.Linear(16, 8)
        self.shared = nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 4, 3, 4)  # (B, T, nh, 3, hs)
        q, k, v = (qkv[..., i, :].transpose(1, 2).reshape(b * 4, t, 4) for i in range(3))
        slopes = torch.arange(1, 5, dtype=x.dtype)[:, None] * torch.arange(t, dtype=x.dtype)
        alibi = slopes.repeat(b, 1).view(b * 4, 1, t) * 0.1  # (B * nh, 1, T), whole
        scores = alibi.baddbmm(batch1=q, batch2=k.transpose(-1, -2), alpha=0.5)
        probs = scores.view(b, 4, t, t).softmax(-1).view(b * 4, t, t)
        y = torch.baddbmm(self.shared, probs, v)  # (B * nh, T, hs)
        y = y.view(b, 4, t, 4).permute(0, 2, 1, 3).reshape(b, t, 16)
        return self.out(y)


@pytest.mark.parametrize("tp", [2, 4])
def test_batches_of_merged_heads_take_each_rank_s_rows_of_a_whole_bias(tp: int) -> None:
    """bmm and baddbmm of heads merged into the batch dim (a `_StridedShard`) run on each
    rank's own batches with no collective in the forward: ALiBi's whole bias cut to the
    rank's rows, a learned bias every batch shares used whole, its gradient summed over the
    ranks. Parity forward and backward."""
    plan = Plan.model_validate(
        {
            "tpplan": 10,
            "rules": [
                {"match": "0.qkv", "style": "colwise", "local_output": False, "why": "opens"},
                {"match": "0.out", "style": "rowwise", "why": "closes"},
            ],
            "regions": [{"match": "0", "why": "runs on DTensors"}],
        }
    )
    model = nn.Sequential(_MergedHeads())
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    assert_parity(model, plan, tp, x)
    with simulated_ranks(tp) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
        with CommDebugMode() as comms:
            sharded(x)
    assert {str(k).split(".")[-1] for k in comms.get_comm_counts()} == {"all_reduce"}


# ---- BLOOM and T5 ----------------------------------------------------------------------------
# two layers of 4 heads: tp 4 leaves one head per rank
_BLOOM = {"hidden_size": 64, "n_head": 4, "n_layer": 2, "vocab_size": 128}
_T5 = {
    "d_model": 64, "d_kv": 16, "num_heads": 4, "num_layers": 2, "num_decoder_layers": 2,
    "d_ff": 128, "vocab_size": 128,
}  # fmt: skip


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(seed))


def _bloom() -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = build_model("bloom", _BLOOM, device="cpu").eval()
    return model, {"input_ids": _ids(), "use_cache": False}


def _t5() -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = build_model("t5", _T5, device="cpu").eval()
    return model, {"input_ids": _ids(), "decoder_input_ids": _ids(2), "use_cache": False}


_MODELS = {
    # name: (build, the attention modules' pattern, the first of them, openers, closer)
    "bloom": (
        _bloom,
        "transformer.h.*.self_attention",
        "transformer.h.0.self_attention",
        ["query_key_value"],
        "dense",
    ),
    "t5": (
        _t5,
        "decoder.block.*.layer.*.EncDecAttention",
        "decoder.block.0.layer.1.EncDecAttention",
        ["q", "k", "v"],
        "o",
    ),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(_MODELS))
def test_attention_meeting_a_whole_per_head_tensor_is_a_region(name: str, tp: int) -> None:
    """Its openers colwise handing DTensors on, its output projection rowwise, the module a
    region; the plan checks clean and runs at parity, forward and backward."""
    build, region, first, opens, close = _MODELS[name]
    model, x = build()
    plan = tpplan.infer_plan(model, tp_size=tp)
    assert [r.match for r in plan.regions] == [region]
    rules = expand_rules(plan, model)
    for o in opens:
        rule = rules[f"{first}.{o}"]
        assert (rule.style, rule.output, rule.local_output) == ("colwise", None, False)
    assert rules[f"{first}.{close}"].style == "rowwise"
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_attention_region_gathers_nothing(name: str) -> None:
    """Megatron's count, forward and backward, on fake ranks: one all-reduce per attention
    and per MLP, the vocab-parallel lookups' sums, and one all-gather, of the logits."""
    build, *_ = _MODELS[name]
    model, _ = build()
    plan = tpplan.infer_plan(model, tp_size=2)
    stats = plan_stats(model, plan, tp_size=2, backward=True, batch=2, seq=8)
    forward = {k: v["count"] for k, v in stats.collectives["forward"].items()}
    if name == "bloom":  # 2 layers: attention + MLP each; one lookup
        assert forward == {"all_reduce": 2 * 2 + 1, "all_gather_into_tensor": 1}
    else:  # 2 encoder layers (self-attention + MLP), 2 decoder layers (+ cross-attention);
        # two lookups; the logits' gather
        assert forward == {"all_reduce": 2 * 2 + 3 * 2 + 2, "all_gather_into_tensor": 1}
    assert "all_gather_into_tensor" not in stats.collectives["backward"]
