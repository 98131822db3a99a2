"""A grouped convolution on split channels: each group of output channels reads its own
group of input channels only, so where each rank holds whole groups it convolves its own
channels with their own kernels, and the split goes on. The plan splits the convolution's
weight and bias with the channels (split_params) and divides its group count (attributes).
Depthwise (one group per channel) written several ways: a MobileNet inverted residual (1x1
expand, 3x3 depthwise, 1x1 project), with and without a channel multiplier, a Mamba-like
mixer (a fused Linear cut in two, a causal depthwise Conv1d on one half, a gate, the output
Linear), and `F.conv1d` on the block's own kernels with a count it holds; grouped in
several channels per group, a ResNeXt bottleneck. A count tp does not divide, or a literal
one, ends the split, with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.models import TwoBlocks
from support.parity import (
    assert_parity,
    assert_the_original_state,
    forward_collectives,
    one_counted_forward,
)
from torch import nn

import tpplan
from tpplan import Plan, check_plan


class _InvertedResidual(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 64, multiplier: int = 1) -> None:
        super().__init__()
        self.expand = nn.Conv2d(width, hidden, 1)
        self.dw = nn.Conv2d(hidden, hidden * multiplier, 3, padding=1, groups=hidden)
        self.project = nn.Conv2d(hidden * multiplier, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(F.relu6(self.dw(F.relu6(self.expand(x)))))


class _Bottleneck(nn.Module):
    """ResNeXt's bottleneck: 1x1 reduce, a 3x3 convolution in 8 groups of 4 channels, 1x1
    expand; `groups` of 2 when asked."""

    def __init__(self, width: int = 16, inner: int = 32, groups: int = 8) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(width, inner, 1)
        self.grouped = nn.Conv2d(inner, inner, 3, padding=1, groups=groups)
        self.expand = nn.Conv2d(inner, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.expand(F.relu(self.grouped(F.relu(self.reduce(x)))))


class _Mixer(nn.Module):
    """in_proj (x | gate) -> causal depthwise Conv1d over the tokens -> silu(x) * silu(gate)
    -> out_proj."""

    def __init__(self, width: int = 16, inner: int = 32) -> None:
        super().__init__()
        self.in_proj = nn.Linear(width, 2 * inner)
        self.conv1d = nn.Conv1d(inner, inner, 4, padding=3, groups=inner)
        self.out_proj = nn.Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, gate = self.in_proj(x).chunk(2, dim=-1)
        h = self.conv1d(h.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return x + self.out_proj(F.silu(h) * F.silu(gate))


class _Functional(nn.Module):
    """`F.conv1d(h, self.kernel, self.kernel_bias, padding=1, groups=self.channels)` on the
    block's own parameters, between two Linear layers over (B, T, C)."""

    def __init__(self, width: int = 16, inner: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(width, inner)
        self.channels = inner
        self.kernel = nn.Parameter(0.3 * torch.randn(inner, 1, 3))
        self.kernel_bias = nn.Parameter(0.1 * torch.randn(inner))
        self.down = nn.Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).transpose(1, 2)
        h = F.conv1d(h, self.kernel, self.kernel_bias, padding=1, groups=self.channels)
        return x + self.down(F.gelu(h.transpose(1, 2)))


def _doubled() -> nn.Module:
    return _InvertedResidual(multiplier=2)


# style -> (block class, input shape, opener, closer, the module holding the kernels)
CASES = {
    "inverted-residual": (_InvertedResidual, (2, 16, 6, 6), "expand", "project", "dw"),
    "channel-multiplier": (_doubled, (2, 16, 6, 6), "expand", "project", "dw"),
    "resnext": (_Bottleneck, (2, 16, 5, 5), "reduce", "expand", "grouped"),
    "mixer": (_Mixer, (2, 7, 16), "in_proj", "out_proj", "conv1d"),
    "functional": (_Functional, (2, 7, 16), "up", "down", ""),
}


def _model(style: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    make, shape, *_ = CASES[style]
    return TwoBlocks(make), torch.randn(*shape)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("style", list(CASES))
def test_a_grouped_convolution_on_split_channels_keeps_the_split(style: str, tp: int) -> None:
    """Opener colwise, the kernels split with the channels and `groups` divided, closer
    rowwise: one all-reduce per block, parity forward and backward on both paths, `check`
    clean, and the full state dict the original weights."""
    model, x = _model(style)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    _, _, opener, closer, holder = CASES[style]
    styles = {r.match: r.style for r in plan.rules}
    assert styles["blocks.*." + opener] == "colwise"
    assert styles["blocks.*." + closer] == "rowwise"
    where = "blocks.*" + (f".{holder}" if holder else "")
    rule = next(r for r in plan.rules if r.match == where)
    params = ("kernel", "kernel_bias") if style == "functional" else ("weight", "bias")
    assert rule.style == "split_params" and rule.shard == dict.fromkeys(params, 0)
    kind = "a grouped convolution" if style == "resnext" else "a depthwise convolution"
    assert kind in rule.why
    divided = next(a for a in plan.attributes if a.match == where)
    assert divided.divide == ["channels" if style == "functional" else "groups"]
    assert check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)
    with one_counted_forward(model, plan, tp, x) as (sharded, comms):
        for i in range(2):
            assert forward_collectives(comms, f"TwoBlocks.blocks.{i}") == {"all_reduce": 1}
        assert_the_original_state(sharded, model)


@pytest.mark.unit
def test_groups_tp_does_not_divide_end_the_split_with_its_reason() -> None:
    """Two groups at tp 4: a rank would hold half a group, whose kernels read the other
    half's channels. The pair is split then gathered, and the reason names the count."""
    torch.manual_seed(0)
    model = TwoBlocks(lambda: _Bottleneck(groups=2))
    plan = tpplan.infer_plan(model, tp_size=4, example_inputs=torch.randn(2, 16, 5, 5))
    rules = {r.match: r for r in plan.rules}
    assert rules["blocks.*.expand"].style != "rowwise"
    assert "blocks.*.grouped" not in rules
    assert (
        "a grouped convolution reads groups = 2 to convolve the split channels in groups, "
        "which tp 4 does not divide" in rules["blocks.*.reduce"].why
    )


class _Literal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.kernel = nn.Parameter(torch.randn(32, 1, 3))
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.conv1d(self.up(x).transpose(1, 2), self.kernel, padding=1, groups=32)
        return x + self.down(h.transpose(1, 2))


@pytest.mark.unit
def test_a_literal_group_count_ends_the_split() -> None:
    plan = tpplan.infer_plan(_Literal(), tp_size=2, example_inputs=torch.randn(2, 5, 16))
    rules = {r.match: r for r in plan.rules}
    assert rules["down"].style != "rowwise"
    assert "no module attribute read in forward holds it" in rules["up"].why


@pytest.mark.unit
def test_check_names_a_tp_size_the_kernels_do_not_split_by() -> None:
    model, x = _model("mixer")
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=x)
    data = plan.model_dump(exclude_none=True)
    said = [str(p) for p in check_plan(Plan.model_validate(data), model, tp_size=64)]
    assert any("groups = 32 does not divide by tp size 64" in s for s in said), said


class _BeforeTheCut(nn.Module):
    """The depthwise convolution on in_proj's whole output, x and gate side by side, cut
    apart only after it: each rank holds its slice of both pieces, which one contiguous
    share of the kernels would not match."""

    def __init__(self, width: int = 16, inner: int = 32) -> None:
        super().__init__()
        self.in_proj = nn.Linear(width, 2 * inner)
        self.conv1d = nn.Conv1d(2 * inner, 2 * inner, 3, padding=1, groups=2 * inner)
        self.out_proj = nn.Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1d(self.in_proj(x).transpose(1, 2)).transpose(1, 2)
        h, gate = h.chunk(2, dim=-1)
        return x + self.out_proj(F.silu(h) * gate)


@pytest.mark.parametrize("tp", [2, 4])
def test_kernels_met_before_a_fused_cut_keep_the_pair_from_pairing(tp: int) -> None:
    """Not a silent wrong answer: the pair is not split, the reason names the pieces, and
    the numbers hold."""
    torch.manual_seed(0)
    model, x = _BeforeTheCut(), torch.randn(2, 7, 16)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    rules = {r.match: r for r in plan.rules}
    assert rules["out_proj"].style != "rowwise" and "conv1d" not in rules
    assert "meet all of in_proj's fused pieces at once" in rules["in_proj"].why
    assert_parity(model, plan, tp, x)
