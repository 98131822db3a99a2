"""Attention that meets a whole tensor of one plane per head, split the Megatron way.

BLOOM adds ALiBi, a bias of one row per (batch, head), `(B * heads, 1, k)`, to scores whose
heads are merged into the batch dim (`baddbmm`); T5's cross-attention, which has no
relative-position bias, adds zeros of shape `(1, heads, q, k)`. As DTensor regions each rank
takes its own heads' part of such a whole tensor (a local slice), and a whole tensor every
head shares is used as it is, its gradient summed over the ranks. Parity forward and
backward against the unsharded model on simulated ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpplan import Plan

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
