"""A resnet pair of convolutions wider than 1x1 with a GroupNorm between them (a UNet's
resnet block, a 1-D audio or a 3-D video variant): conv1 colwise, the GroupNorm on each
rank's own channels, conv2 rowwise, one all-reduce. A GroupNorm's statistics read the
channels of one group only, so where tp divides the group count each rank holds whole
groups and normalizes them alone: the plan splits the norm's weight and bias with the
channels (split_params) and divides its group count (attributes). Written several ways:
nn.GroupNorm or F.group_norm with a count the module holds, 2-D, 1-D and 3-D, with a time
embedding added to the split channels. Where a split cannot fit (a count tp does not
divide, one group over all channels, a literal count) the convolutions are not paired, and
the plan says why."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.parity import (
    assert_parity,
    assert_the_original_state,
    forward_collectives,
    one_counted_forward,
)
from torch import nn

import tpplan
from tpplan import Plan, check_plan
from tpplan._runtime.local import simulated_ranks

CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


class _ModuleNorm(nn.Module):
    """diffusers' ResnetBlock2D in small: GroupNorm, SiLU, 3x3 conv, the time embedding's
    projection added per channel, GroupNorm, SiLU, 3x3 conv, the residual."""

    def __init__(self, dims: int = 2, width: int = 16, hidden: int = 32, groups: int = 8) -> None:
        super().__init__()
        conv = CONVS[dims]
        self.norm1 = nn.GroupNorm(4, width)
        self.conv1 = conv(width, hidden, 3, padding=1)
        self.time_proj = nn.Linear(12, hidden)
        self.norm2 = nn.GroupNorm(groups, hidden)
        self.conv2 = conv(hidden, width, 3, padding=1)
        self.dims = dims

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_proj(F.silu(temb)).reshape(*temb.shape[:1], -1, *[1] * self.dims)
        h = self.conv2(F.silu(self.norm2(h)))
        return x + h


class _FunctionalNorm(nn.Module):
    """The norm written as a call: `F.group_norm(h, self.groups, self.gn_w, self.gn_b)` on
    the block's own parameters, a 5-wide kernel with stride 1 and dilation 2 (1-D)."""

    def __init__(self, width: int = 16, hidden: int = 32, groups: int = 8) -> None:
        super().__init__()
        self.up = nn.Conv1d(width, hidden, 5, padding=4, dilation=2)
        self.groups = groups
        self.gn_w = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.gn_b = nn.Parameter(0.1 * torch.randn(hidden))
        self.down = nn.Conv1d(hidden, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.group_norm(self.up(x), self.groups, self.gn_w, self.gn_b)
        return x + self.down(F.gelu(h))


class _Net(nn.Module):
    """Two blocks over a stream whose width a whole 1x1 input convolution sets, and a head."""

    def __init__(self, block: nn.Module, block2: nn.Module, dims: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block, block2])
        self.head = CONVS[dims](16, 3, 1)

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        for b in self.blocks:
            x = b(x) if temb is None else b(x, temb)
        return self.head(x)


Inputs = dict[str, torch.Tensor]


def _model(style: str, groups: int = 8) -> tuple[nn.Module, Inputs]:
    torch.manual_seed(0)
    if style == "functional":
        model = _Net(_FunctionalNorm(groups=groups), _FunctionalNorm(groups=groups), 1)
        return model, {"x": torch.randn(2, 16, 10)}
    dims = {"module-2d": 2, "module-1d": 1, "module-3d": 3}[style]
    model = _Net(_ModuleNorm(dims, groups=groups), _ModuleNorm(dims, groups=groups), dims)
    x = torch.randn(2, 16, *[6 if dims < 3 else 4] * dims)
    return model, {"x": x, "temb": torch.randn(2, 12)}


STYLES = ["module-2d", "module-1d", "module-3d", "functional"]
PAIRS = {
    "module-2d": ("conv1", "conv2", "norm2", ("weight", "bias"), "num_groups"),
    "module-1d": ("conv1", "conv2", "norm2", ("weight", "bias"), "num_groups"),
    "module-3d": ("conv1", "conv2", "norm2", ("weight", "bias"), "num_groups"),
    "functional": ("up", "down", "", ("gn_w", "gn_b"), "groups"),
}


def _styles(plan: Plan) -> dict[str, str]:
    return {r.match: r.style for r in plan.rules}


def _infer(model: nn.Module, x: Inputs, tp: int) -> Plan:
    return tpplan.infer_plan(model, tp_size=tp, example_inputs=x)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("style", STYLES)
def test_a_resnet_pair_with_a_group_norm_is_split_the_megatron_way(style: str, tp: int) -> None:
    """conv1 colwise (and the time embedding's projection beside it), the norm's own
    parameters split with the channels, its group count divided, conv2 rowwise: one
    all-reduce per block, no gather, parity forward and backward on both paths, `check`
    clean, and the full state dict the original weights."""
    model, x = _model(style)
    plan = _infer(model, x, tp)
    first, second, norm, params, count = PAIRS[style]
    block = "blocks.*"
    styles = _styles(plan)
    assert styles[f"{block}.{first}"] == "colwise"
    assert styles[f"{block}.{second}"] == "rowwise"
    holder = f"{block}.{norm}" if norm else block
    rule = next(r for r in plan.rules if r.match == holder)
    assert rule.style == "split_params" and rule.shard == dict.fromkeys(params, 0)
    assert "one entry per channel" in rule.why and "GroupNorm" in rule.why
    divided = next(a for a in plan.attributes if a.match == holder)
    assert divided.divide == [count] and "in groups" in divided.why
    if style.startswith("module"):
        assert styles[f"{block}.time_proj"] == "colwise"
        assert styles.get(f"{block}.norm1", "replicate") == "replicate"  # on the whole stream
    assert check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)
    with one_counted_forward(model, plan, tp, x) as (sharded, comms):
        for i in range(2):
            assert forward_collectives(comms, f"_Net.blocks.{i}") == {"all_reduce": 1}
        assert_the_original_state(sharded, model)


@pytest.mark.unit
def test_each_rank_holds_its_own_channels_of_the_norm_and_divides_its_groups() -> None:
    model, x = _model("module-2d")
    plan = _infer(model, x, 2)
    with simulated_ranks(2) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        norm = sharded.blocks[0].norm2
        assert norm.num_groups == 4
        assert norm.weight.to_local().shape == (16,)
        assert torch.equal(norm.weight.full_tensor(), model.blocks[0].norm2.weight)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("groups", "tp", "words"),
    [
        (4, 8, "tp 8 does not divide its 4 channel groups (of a GroupNorm)"),
        (1, 2, "it normalizes each group of 32 channels over all of them, and the split cuts "
         "inside a group"),
    ],
    ids=["groups-tp-does-not-divide", "one-group"],
)  # fmt: skip
def test_a_group_norm_the_split_cannot_fit_keeps_the_pair_from_pairing(
    groups: int, tp: int, words: str
) -> None:
    """No rowwise conv2: the pair is not split the Megatron way, and the reason on conv1
    names the GroupNorm's groups."""
    model, x = _model("module-2d", groups=groups)
    plan = _infer(model, x, tp)
    rules = {r.match: r for r in plan.rules}
    assert "rowwise" not in {r.style for m, r in rules.items() if m.endswith("conv2")}
    assert words in rules["blocks.*.conv1"].why
    assert not [a for a in plan.attributes if "norm2" in a.match]


class _LiteralCount(nn.Module):
    """`F.group_norm(h, 8)`: a count no attribute holds, which no plan can divide."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Conv2d(16, 32, 3, padding=1)
        self.down = nn.Conv2d(32, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(F.group_norm(self.up(x), 8)))


@pytest.mark.unit
def test_a_literal_group_count_keeps_the_pair_from_pairing() -> None:
    plan = _infer(_LiteralCount(), {"x": torch.randn(2, 16, 6, 6)}, 2)
    rules = {r.match: r for r in plan.rules}
    assert rules["down"].style != "rowwise"
    assert "no module attribute read in forward holds it" in rules["up"].why


@pytest.mark.unit
def test_check_names_a_group_count_the_plan_leaves_whole() -> None:
    """Left undivided, each rank would normalize its 16 channels in 8 groups of 2 where the
    model has groups of 4: no shape fails, so check must say it. (The functional style:
    check traces a model it can make inputs up for, one tensor here.)"""
    model, x = _model("functional")
    plan = _infer(model, x, 2)
    data = plan.model_dump(exclude_none=True)
    data["attributes"] = []
    said = [str(p) for p in check_plan(Plan.model_validate(data), model, tp_size=2)]
    assert said == [
        f"rules[1] (match: blocks.*.up), module blocks.{i}.up: blocks.{i} normalizes the "
        "channels this rule splits in groups = 8 groups (a group norm), and no entry of "
        "attributes divides groups: each rank would normalize its share of the channels in "
        f"groups of the wrong size, without an error. Fix: add an entry to attributes: match: "
        f"blocks.{i}, divide: [groups]."
        for i in range(2)
    ]


@pytest.mark.unit
def test_check_names_a_tp_size_that_would_cut_a_group() -> None:
    model, x = _model("functional", groups=4)
    plan = _infer(model, x, 2)
    said = [str(p) for p in check_plan(plan, model, tp_size=8)]
    assert (
        "rules[1] (match: blocks.*.up), module blocks.*.up: a GroupNorm normalizes its 32 "
        "output channels in 4 groups: tp size 8 would cut a group. Fix: use a tp size among "
        "1, 2, 4, or keep this module replicated." in said
    )


@pytest.mark.unit
def test_check_names_each_blocks_own_norm_in_a_stack_traced_through_its_first_blocks() -> None:
    """Twelve blocks: the trace runs the first two and stands the rest by block 0, and the
    fix still names each block's own module, not block 0's."""
    torch.manual_seed(0)
    model, x = _model("functional")
    model.blocks = nn.ModuleList([_FunctionalNorm() for _ in range(12)])
    plan = _infer(model, x, 2)
    data = plan.model_dump(exclude_none=True)
    data["attributes"] = []
    fixes = [p.fix for p in check_plan(Plan.model_validate(data), model, tp_size=2)]
    assert fixes == [
        f"add an entry to attributes: match: blocks.{i}, divide: [groups]." for i in range(12)
    ]
