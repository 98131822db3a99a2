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


class _CutInOne(nn.Module):
    """fc1's features cut into one piece (`chunk(1)`, as some decompositions write a cut):
    that piece is every feature, no fused cut."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (h,) = self.fc1(x).chunk(1, dim=-1)
        return x + self.fc2(F.gelu(h))


def test_a_cut_into_one_piece_is_no_fused_cut() -> None:
    """A plan with `parts: [32]` would not even validate (a fused layer has two pieces at
    least); apply_plan refused GLM-5-Next's plan so before this was seen."""
    torch.manual_seed(0)
    model = _CutInOne()
    plan, x = _inferred(model, 2)
    assert [(r.style, r.parts if r.style == "colwise" else None) for r in plan.rules] == [
        ("colwise", None),
        ("rowwise", None),
    ]
    assert_parity(model, plan, 2, x)
