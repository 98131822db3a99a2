"""Convolutions of one group are Linear layers over their channels (dim 1), whatever their
kernel: an MLP of two 1x1 ones (ConvNeXt's small models, MobileNet's and EfficientNet's
pointwise convolutions), or a UNet's resnet pair of 3x3 ones with a GroupNorm between
them, pairs up colwise then rowwise like any MLP, and the plan's numbers equal the
unsharded model's. DTensor itself computes a convolution over a split weight wrong without
a word, so these tests check the numbers on every rank, forward and backward, and the
check's messages for a convolution the split does not fit."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import tpplan
from tpplan import Plan, Rule, check_plan
from tpplan._runtime.local import simulated_ranks

sys.path.insert(0, str(Path(__file__).parent))
from support.code_styles import Spec, build, inputs
from support.parity import assert_parity


class _ConvMlp(nn.Module):
    """A depthwise 3x3 convolution (kept whole: it mixes no channels), then a residual MLP
    of 1x1 convolutions, 8 -> 32 -> 8 channels, over (B, C, H, W) or, with
    `conv=nn.Conv1d`, (B, C, L)."""

    def __init__(self, conv: type[nn.Module] = nn.Conv2d) -> None:
        super().__init__()
        self.stem = conv(8, 8, 3, padding=1, groups=8)
        self.fc1 = conv(8, 32, 1)
        self.fc2 = conv(32, 8, 1)
        self.head = nn.Linear(8, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.fc2(F.gelu(self.fc1(x)))
        return self.head(x.flatten(2).mean(-1))


def _styles(plan: Plan) -> dict[str, str]:
    return {r.match: r.style for r in plan.rules}


@pytest.mark.unit
@pytest.mark.parametrize("conv", [nn.Conv1d, nn.Conv2d], ids=["conv1d", "conv2d"])
def test_a_1x1_convolution_mlp_is_split_colwise_then_rowwise(conv: type[nn.Module]) -> None:
    model = _ConvMlp(conv)
    x = torch.randn(2, 8, 6, 6) if conv is nn.Conv2d else torch.randn(2, 8, 12)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=x)
    styles = _styles(plan)
    assert (styles["fc1"], styles["fc2"]) == ("colwise", "rowwise")
    assert "stem" not in styles  # a depthwise convolution is no Linear: whole, as any other module
    assert check_plan(plan, model, tp_size=4) == []


@pytest.mark.parametrize("tp", [2, 4])
def test_a_split_1x1_convolution_mlp_matches_the_unsharded_model(tp: int) -> None:
    torch.manual_seed(0)
    model = _ConvMlp()
    x = torch.randn(2, 8, 6, 6)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    assert_parity(model, plan, tp, x)


@pytest.mark.unit
def test_a_split_convolutions_weights_are_the_unsharded_ones_with_the_channels_split() -> None:
    """State dicts see each weight whole; each rank holds its out (colwise) or in (rowwise)
    channels, and a rowwise bias whole."""
    torch.manual_seed(0)
    model = _ConvMlp()
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=torch.randn(2, 8, 6, 6))
    with simulated_ranks(2) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
            p = sharded.get_parameter(name)
            assert isinstance(p, DTensor)
            assert torch.equal(p.full_tensor(), model.get_parameter(name)), name
        assert sharded.fc1.weight.to_local().shape == (16, 8, 1, 1)
        assert sharded.fc2.weight.to_local().shape == (8, 16, 1, 1)
        assert sharded.fc2.bias.to_local().shape == (8,)


def _said(*rules: Rule, tp: int = 2) -> list[str]:
    with torch.device("meta"):
        model = _ConvMlp()
    return [str(p) for p in check_plan(Plan(rules=list(rules)), model, tp_size=tp)]


def _rule(match: str, style: str, **fields: object) -> Rule:
    return Rule(match=match, style=style, why="a test", **fields)


@pytest.mark.unit
def test_a_grouped_convolution_cannot_be_split() -> None:
    assert _said(_rule("stem", "colwise")) == [
        "rules[0] (match: stem), module stem: style 'colwise' splits a convolution only where "
        "it is a Linear over its channels (one group: every output channel reads every input "
        "channel); this Conv2d has groups 8, each output channel reading 1 of 8. Fix: keep "
        "this module replicated (style: replicate)."
    ]


@pytest.mark.unit
def test_a_1x1_convolution_takes_no_transposed() -> None:
    assert _said(_rule("fc1", "colwise", transposed=True), _rule("fc2", "rowwise")) == [
        "rules[0] (match: fc1), module fc1: a convolution takes no `transposed`: its weight "
        "is stored (out, in, kernel...). Fix: drop `transposed` from the rule."
    ]


class _FusedConvMlp(nn.Module):
    """A gated MLP of 1x1 convolutions over (B, C, L) whose gate and up channels are one
    fused convolution, cut apart with `chunk`: 8 -> 2 x 32 -> 8 channels."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Conv1d(8, 64, 1)
        self.down = nn.Conv1d(32, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=1)
        return x + self.down(F.silu(gate) * up)


@pytest.mark.unit
def test_a_fused_1x1_convolution_holds_its_slice_of_each_piece() -> None:
    """infer_plan's `parts` on a fused convolution: each rank holds its slice of the gate's
    channels and of the up's, and the parameter's full tensor is the original weight."""
    torch.manual_seed(0)
    model = _FusedConvMlp()
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=torch.randn(2, 8, 5))
    rules = {r.match: r for r in plan.rules}
    assert (rules["gate_up"].style, rules["gate_up"].parts) == ("colwise", [32, 32])
    assert rules["down"].style == "rowwise"
    with simulated_ranks(2) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        weight = sharded.gate_up.weight
        assert isinstance(weight, DTensor)
        assert torch.equal(weight.full_tensor(), model.gate_up.weight)
        whole = model.gate_up.weight.detach()
        # rank 0's channels: gate 0..15, then up 32..47
        assert torch.equal(weight.to_local(), torch.cat([whole[:16], whole[32:48]]))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("gathered", [False, True], ids=["split", "gathered"])
def test_a_fused_1x1_convolution_matches_the_unsharded_model(tp: int, gathered: bool) -> None:
    """Split by pieces and closed by the rowwise `down`, or gathered right after it."""
    torch.manual_seed(0)
    model, x = _FusedConvMlp(), torch.randn(2, 8, 5)
    fused = {"match": "gate_up", "style": "colwise", "why": "a test", "parts": [32, 32]}
    rules = (
        [Rule(**fused, output="replicate")]
        if gathered
        else [Rule(**fused), _rule("down", "rowwise")]
    )
    assert_parity(model, Plan(rules=rules), tp, x)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(
    "spec",
    [Spec(proj="conv", qkv="chunk"), Spec(proj="conv", qkv="split", kv="gqa")],
    ids=["equal", "unequal"],
)
def test_an_attention_of_fused_1x1_convolutions_matches_the_unsharded_model(
    spec: Spec, tp: int
) -> None:
    """q|k|v from one 1x1 convolution, of equal pieces (cut by `chunk`) or of a narrower k
    and v (grouped heads, cut by `split`): infer_plan's plan, applied, keeps the numbers
    (the code-styles generator found apply_plan refusing it, issue 35)."""
    model, ids = build(spec), inputs()
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=ids)
    assert_parity(model, plan, tp, ids)


@pytest.mark.unit
def test_channels_tp_does_not_divide() -> None:
    assert _said(_rule("fc1", "colwise"), _rule("fc2", "rowwise"), tp=3) == [
        "rules[0] (match: fc1), module fc1: out_channels = 32 does not divide by tp size 3. "
        "Fix: use a tp size among 1, 2, 4, 8, 16, 32, or keep this module replicated.",
        "rules[1] (match: fc2), module fc2: in_channels = 32 does not divide by tp size 3. "
        "Fix: use a tp size among 1, 2, 4, 8, 16, 32, or keep this module replicated.",
    ]


@pytest.mark.parametrize("tp", [2, 4])
def test_an_attention_of_1x1_convolutions_sized_by_literals_is_a_region(tp: int) -> None:
    """q, k, v and the output from 1x1 convolutions, heads cut at literal sizes no attribute
    holds: the attention runs in a DTensor region (the convolutions colwise with DTensor
    outputs, the output one rowwise), with the unsharded model's numbers."""
    spec = Spec(proj="conv", sizes="literal")
    model, ids = build(spec), inputs()
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=ids)
    assert [r.match for r in plan.regions] == ["layers.0.attn"], plan.to_yaml()
    styles = _styles(plan)
    assert styles["layers.0.attn.o_proj"] == "rowwise"
    assert_parity(model, plan, tp, ids)
