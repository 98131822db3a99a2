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

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import tpplan
from tpplan import Plan
from tpplan._runtime.local import simulated_ranks

sys.path.insert(0, str(Path(__file__).parent))
from blocks import assert_parity


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


@pytest.mark.unit
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


@pytest.mark.unit
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
