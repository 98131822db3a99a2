"""A BatchNorm over split channels: each channel is normalized alone (by its own batch
statistics while training, its own running ones in eval), so each rank normalizes its own
channels and the split goes on. The plan splits the norm's weight and bias and its running
mean and variance (buffers, updated in place while training) with the channels
(split_params). Written three ways: a ResNeXt bottleneck (1x1 conv, BatchNorm2d, a grouped
3x3, BatchNorm2d, 1x1), the same without the norm's affine parameters, and a LeViT-like
MLP of Linear layers with a BatchNorm1d over the flattened tokens."""

from __future__ import annotations

import copy
from pathlib import Path

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
from tpplan import check_plan
from tpplan._runtime.gather import full_state_dict
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan.checkpoint import load_checkpoint, save_checkpoint


class _Bottleneck(nn.Module):
    def __init__(self, width: int = 16, inner: int = 32, *, affine: bool = True) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(width, inner, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(inner, affine=affine)
        self.grouped = nn.Conv2d(inner, inner, 3, padding=1, groups=8, bias=False)
        self.bn2 = nn.BatchNorm2d(inner, affine=affine)
        self.expand = nn.Conv2d(inner, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.reduce(x)))
        return x + self.expand(F.relu(self.bn2(self.grouped(h))))


class _BareBottleneck(_Bottleneck):
    def __init__(self) -> None:
        super().__init__(affine=False)


class _TokenMlp(nn.Module):
    """Linear, BatchNorm1d over (batch x tokens, features), hardswish, Linear: LeViT's MLP."""

    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=False)
        self.norm = nn.BatchNorm1d(hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.up(x).flatten(0, 1)).view(*x.shape[:2], -1)
        return x + self.down(F.hardswish(h))


# style -> (block, input shape, opener, closer, the norms)
CASES = {
    "resnext": (_Bottleneck, (4, 16, 5, 5), "reduce", "expand", ("bn1", "bn2")),
    "no-affine": (_BareBottleneck, (4, 16, 5, 5), "reduce", "expand", ("bn1", "bn2")),
    "levit-mlp": (_TokenMlp, (3, 5, 16), "up", "down", ("norm",)),
}


def _model(style: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    make, shape, *_ = CASES[style]
    model = TwoBlocks(make)
    with torch.no_grad():  # running statistics that matter in eval
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
    return model, torch.randn(*shape)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("style", list(CASES))
def test_a_batch_norm_on_split_channels_keeps_the_split(style: str, tp: int, mode: str) -> None:
    """Opener colwise, each norm's parameters and running statistics split with the
    channels, closer rowwise: one all-reduce per block, parity forward and backward on both
    paths, `check` clean, and the full state dict the original tensors."""
    model, x = _model(style)
    getattr(model, mode)()
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    _, _, opener, closer, norms = CASES[style]
    rules = {r.match: r for r in plan.rules}
    assert rules[f"blocks.*.{opener}"].style == "colwise"
    assert rules[f"blocks.*.{closer}"].style == "rowwise"
    stats = {"running_mean": 0, "running_var": 0}
    for norm in norms:
        rule = rules[f"blocks.*.{norm}"]
        affine = style != "no-affine"
        assert rule.style == "split_params"
        assert rule.shard == ({"weight": 0, "bias": 0} if affine else {}) | stats
        assert "a BatchNorm, one channel at a time" in rule.why
    assert check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)
    with one_counted_forward(model, plan, tp, x) as (sharded, comms):
        for i in range(2):
            assert forward_collectives(comms, f"TwoBlocks.blocks.{i}") == {"all_reduce": 1}
        if mode == "eval":
            assert_the_original_state(sharded, model)


@pytest.mark.parametrize("tp", [2, 4])
def test_running_statistics_update_on_each_rank_s_channels(tp: int) -> None:
    """Training forwards update each rank's share of the running mean and variance in place,
    to what the unsharded model holds after the same forwards; the batch counter, whole,
    counts alike."""
    model, x = _model("resnext")
    model.train()
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    want = copy.deepcopy(model)
    for _ in range(2):
        want(x)
    with simulated_ranks(tp) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
        assert sharded.blocks[0].bn1.running_mean.to_local().shape == (32 // tp,)
        for _ in range(2):
            sharded(x)
        got = full_state_dict(sharded)
    for name, t in want.state_dict().items():
        for v in rank_values(got[name]):
            torch.testing.assert_close(v, t, atol=1e-5, rtol=1e-5, msg=name)


def test_a_checkpoint_saved_at_one_tp_loads_at_another(tmp_path: Path) -> None:
    """Running statistics saved whole at tp 2 load at tp 4 into each rank's channels: the
    eval forward is the unsharded model's."""
    model, x = _model("resnext")
    model.eval()
    folder = tmp_path / "ckpt"
    with simulated_ranks(2) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, tpplan.infer_plan(model, tp_size=2, example_inputs=x))
        save_checkpoint(sharded, folder, sharded=False)
    fresh, _ = _model("resnext")
    with torch.no_grad():
        for m in fresh.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.zero_()  # not the saved statistics
    fresh.eval()
    plan4 = tpplan.infer_plan(fresh, tp_size=4, example_inputs=x)
    want = model(x)
    with simulated_ranks(4) as mesh:
        tpplan.apply_plan(fresh, mesh, plan4)
        load_checkpoint(fresh, folder)
        got = fresh(x)
    for v in rank_values(got):
        torch.testing.assert_close(v, want, atol=1e-5, rtol=1e-5)


@pytest.mark.unit
def test_a_norm_over_another_dim_ends_the_split_with_its_reason() -> None:
    """BatchNorm1d over (batch, tokens, features) normalizes the tokens dim, not the split
    features: no split."""

    class _Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.norm, self.down = nn.Linear(16, 32), nn.BatchNorm1d(5), nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(self.norm(self.up(x)))

    plan = tpplan.infer_plan(_Transposed().eval(), tp_size=2, example_inputs=torch.randn(3, 5, 16))
    rules = {r.match: r for r in plan.rules}
    assert rules["down"].style != "rowwise"
    assert "it normalizes each channel (dim 1), and the split is elsewhere" in rules["up"].why
