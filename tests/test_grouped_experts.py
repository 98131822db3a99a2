"""Experts written as torchtitan writes them: tokens sorted by expert, one grouped matmul
(`torch._grouped_mm`) over the groups, whose ends are the running sum of a count of tokens
per expert, or a matmul per expert over groups cut by the counts' values and a `new_zeros`
padding row, and the output put back in token order through a buffer made with `new_empty`.
Split like a dense MLP (mode tensor) or by whole experts (mode expert, where the trace saw
the counts set the groups), the router kept whole; forward and backward parity with the
unsharded model on simulated ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpplan

sys.path.insert(0, str(Path(__file__).parent))
from support.parity import assert_parity

_EXPERTS, _DIM, _HIDDEN = 4, 16, 32


class _Grouped(nn.Module):
    """torchtitan's GroupedExperts by hand: w1, w3 (experts, hidden, dim), w2 (experts, dim,
    hidden); `x` holds the tokens grouped by expert, `counts[e]` rows for expert e."""

    def __init__(self, groups_from_counts: bool = True) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(_EXPERTS, _HIDDEN, _DIM) * 0.1)
        self.w2 = nn.Parameter(torch.randn(_EXPERTS, _DIM, _HIDDEN) * 0.1)
        self.w3 = nn.Parameter(torch.randn(_EXPERTS, _HIDDEN, _DIM) * 0.1)
        self.groups_from_counts = groups_from_counts

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.groups_from_counts:
            ends = torch.cumsum(counts, 0, dtype=torch.int32)
        else:  # groups of a fixed size: the counts set nothing
            ends = (torch.arange(1, _EXPERTS + 1) * (x.shape[0] // _EXPERTS)).to(torch.int32)
        h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=ends))
        h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=ends)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=ends)


class _Loop(_Grouped):
    """torchtitan's for-loop experts by hand: the tokens cut into each expert's group by the
    counts' values, a matmul per expert, and a zero row appended with `new_zeros` (torchtitan
    pads its token count so)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, group in enumerate(torch.split(x, counts.tolist())):
            h = F.silu(group @ self.w1[e].t()) * (group @ self.w3[e].t())
            outs.append(h @ self.w2[e].t())
        out = torch.cat(outs)
        return torch.vstack((out, out.new_zeros(1, out.shape[-1])))[: x.shape[0]]


class _Moe(nn.Module):
    """A router Linear of 4 outputs chooses one expert per token; tokens are sorted by it,
    scaled by their score, run through the experts and put back in a `new_empty` buffer."""

    def __init__(self, groups_from_counts: bool = True, loop: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(_DIM, _EXPERTS, bias=False)
        self.experts = _Loop() if loop else _Grouped(groups_from_counts)
        self.up = nn.Linear(_DIM, _DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = self.up(x).view(-1, d)
        score, chosen = torch.sigmoid(self.router(flat)).topk(1, dim=-1)  # (T, 1) each
        chosen = chosen.view(-1)
        counts = torch.histc(chosen.float(), bins=_EXPERTS, min=0, max=_EXPERTS - 1).long()
        order = chosen.argsort(stable=True)
        out = self.experts(flat[order] * score.view(-1)[order, None], counts)
        back = out.new_empty(out.shape)
        back[order] = out
        return x + back.view(b, s, d)


def _tokens() -> torch.Tensor:
    return torch.randn(2, 8, _DIM, generator=torch.Generator().manual_seed(1))


def _rules(plan: tpplan.Plan) -> dict[str, tpplan.Rule]:
    return {r.match: r for r in plan.rules}


@pytest.mark.parametrize("loop", [False, True], ids=["grouped_mm", "for_loop"])
@pytest.mark.parametrize("tp", [2, 4])
def test_grouped_experts_are_split_like_a_dense_mlp_and_the_router_kept_whole(
    tp: int, loop: bool
) -> None:
    torch.manual_seed(0)
    model = _Moe(loop=loop)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=_tokens())
    rules = _rules(plan)
    assert (rules["experts"].style, rules["experts"].mode) == ("experts", "tensor")
    assert rules["experts"].shard == {"w1": 1, "w2": 2, "w3": 1}
    assert rules["router"].style == "replicate"
    assert rules["router"].why.startswith("kept whole: a router (")
    assert "each rank scores all 4 of its outputs itself" in rules["router"].why
    assert_parity(model, plan, tp, _tokens())


@pytest.mark.parametrize("tp", [2, 4])
def test_grouped_experts_split_by_whole_experts_where_the_counts_set_the_groups(tp: int) -> None:
    torch.manual_seed(0)
    model = _Moe()
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=_tokens(), experts="expert")
    rule = _rules(plan)["experts"]
    assert (rule.mode, rule.shard) == ("expert", {"w1": 0, "w2": 0, "w3": 0})
    assert "tokens grouped by expert and the count of each group" in rule.why
    assert_parity(model, plan, tp, _tokens())


def test_grouped_experts_whose_groups_the_counts_do_not_set_are_not_split_by_experts() -> None:
    """Given tokens and a count per expert, but groups of a fixed size: nothing shows the
    tokens come grouped by those counts, so expert mode is refused with the reason and the
    experts are split like a dense MLP."""
    torch.manual_seed(0)
    model = _Moe(groups_from_counts=False)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=_tokens(), experts="expert")
    rule = _rules(plan)["experts"]
    assert rule.mode == "tensor"
    assert "did not show the counts' running sum setting the groups" in rule.why
    assert_parity(model, plan, 2, _tokens())
