"""Ops the tracer has no rule of its own for (issue 35, i): followed through the ops torch
decomposes them into (`log_sigmoid`, `hardswish`, `softshrink`: families of element-wise
ops, each by its own rule), `glu` as a cut into two fused halves, and ops that order or
pick along one dim (`topk`, `sort`) when that dim is not the split one. Each MLP is split
colwise then rowwise and keeps the unsharded model's numbers, forward and backward."""

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

ACTIVATIONS = {
    "glu": lambda h: F.glu(h, dim=-1),
    "logsigmoid": F.logsigmoid,
    "hardswish": F.hardswish,
    "softshrink": F.softshrink,
}


class _Mlp(nn.Module):
    """fc1 -> an activation no rule of the tracer names -> fc2, with a residual."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.act = act
        self.fc1 = nn.Linear(16, 64 if act == "glu" else 32)  # glu halves its input
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(ACTIVATIONS[self.act](self.fc1(x)))


class _Ordered(nn.Module):
    """The MLP's features ordered along the sequence (`topk`, `sort`), or picked among
    themselves (`along="features"`: the top 4 of each token's features)."""

    def __init__(self, along: str) -> None:
        super().__init__()
        self.along = along
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))  # (B, T, 32)
        if self.along == "sequence":
            top, _ = h.topk(2, dim=1)
            ordered, _ = h.sort(dim=1)
            h = h + top.mean(1, keepdim=True) + ordered
        else:
            top, _ = h.topk(4, dim=-1)
            h = h * top.sum(-1, keepdim=True)
        return x + self.fc2(h)


def _inferred(model: nn.Module, tp: int) -> tuple[tpplan.Plan, torch.Tensor]:
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    return tpplan.infer_plan(model, tp_size=tp, example_inputs=x), x


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_an_activation_without_a_rule_is_followed_through_its_parts(act: str, tp: int) -> None:
    torch.manual_seed(0)
    model = _Mlp(act)
    plan, x = _inferred(model, tp)
    rules = {r.match: r for r in plan.rules}
    assert (rules["fc1"].style, rules["fc1"].output, rules["fc2"].style) == (
        "colwise",
        None,
        "rowwise",
    ), rules["fc1"].why
    # glu's halves are fused pieces: each rank holds its slice of each
    assert rules["fc1"].parts == ([32, 32] if act == "glu" else None)
    assert_parity(model, plan, tp, x)


@pytest.mark.parametrize("tp", [2, 4])
def test_ordering_along_another_dim_keeps_the_split(tp: int) -> None:
    torch.manual_seed(0)
    model = _Ordered("sequence")
    plan, x = _inferred(model, tp)
    assert [r.style for r in plan.rules] == ["colwise", "rowwise"]
    assert "sort, topk" in plan.rules[0].why
    assert_parity(model, plan, tp, x)


def test_picking_among_the_split_features_ends_the_split_with_the_reason() -> None:
    plan, _ = _inferred(_Ordered("features"), 2)
    assert plan.rules[0].output == "replicate"
    assert "fc1's split ends at topk: it orders or picks along the split dim" in plan.rules[0].why
