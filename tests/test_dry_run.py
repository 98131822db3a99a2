"""run_plan: a plan applied to a meta copy over fake ranks of its own, one forward and one
backward; each failure is a problem on the rule of its likeliest culprit."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.models import tiny_llama
from support.plans import LLAMA_PLAN
from support.unrunnable import CASES, unrunnable
from torch import nn

from tpplan import Plan, load_plan
from tpplan._runtime.fake import meta_copy
from tpplan._runtime.local import fake_ranks
from tpplan.check.run import run_plan
from tpplan.errors import DryRunSkipped


@pytest.fixture(scope="module")
def llama():  # type: ignore[no-untyped-def]
    return tiny_llama(device="meta")


@pytest.mark.parametrize("case", list(CASES))
def test_every_unrunnable_plan_fails_its_run(llama, case: str) -> None:  # type: ignore[no-untyped-def]
    """The dry run alone (no static check before it) names the rule, the module where torch
    raised, how that module relates to the rule's, and torch's first line."""
    want = CASES[case]
    (p,) = run_plan(unrunnable(case), llama, tp_size=2)
    assert p.kind == "dry_run" and p.rule == want.rule
    assert want.ran in p.message, p.message


def test_a_sound_plan_runs(llama) -> None:  # type: ignore[no-untyped-def]
    assert run_plan(load_plan(LLAMA_PLAN), llama, tp_size=4) == []


def test_the_copy_holds_no_weights() -> None:
    model = tiny_llama()
    copy_ = meta_copy(model)
    assert all(p.is_meta for p in copy_.parameters())
    assert not any(p.is_meta for p in model.parameters())


class _Routed(nn.Module):
    """With `routed`, a forward that reads a value (`.item()`), which no meta tensor has."""

    def __init__(self, *, routed: bool) -> None:
        super().__init__()
        self.routed = routed
        self.embed = nn.Embedding(8, 8)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        if not self.routed or x.sum().item() > 0:
            x = self.down(self.up(x))
        return x


def test_a_model_that_cannot_run_on_meta_is_left_to_the_static_checks() -> None:
    plan = Plan.from_yaml(
        "tpplan: 7\nrules:\n  - {match: up, style: colwise, why: x}\n"
        "  - {match: down, style: colwise, why: a mistake only a run shows}\n"
    )
    (p,) = run_plan(plan, _Routed(routed=False), tp_size=2)
    assert p.rule == "rules[1] (match: down)" and "fails in down (Linear)" in p.message
    with warnings.catch_warnings():
        warnings.simplefilter("error", DryRunSkipped)  # left to the static checks, silently
        assert run_plan(plan, _Routed(routed=True), tp_size=2) == []


def test_it_runs_beside_a_process_group_of_another_size(llama) -> None:  # type: ignore[no-untyped-def]
    """The fake ranks are a group of their own: inside a 4-rank group, a tp 2 run is
    possible and leaves that group as it was."""
    with fake_ranks(4):
        assert run_plan(load_plan(LLAMA_PLAN), llama, tp_size=2) == []
        assert run_plan(unrunnable("colwise_embedding"), llama, tp_size=2)
        assert dist.get_world_size() == 4 and dist.get_backend() == "fake"


class _WidthCheck(torch.autograd.Function):
    """The identity, whose backward asks for a gradient as wide as the unsplit features."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if grad.shape[-1] != 16:
            raise RuntimeError(f"a gradient of width {grad.shape[-1]}")
        return grad


class _Mid(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _WidthCheck.apply(x)


class _Sandwich(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 8)
        self.up, self.mid, self.down = nn.Linear(8, 16), _Mid(), nn.Linear(16, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.down(self.mid(self.up(self.embed(input_ids))))


def test_a_failure_in_the_backward_names_the_module_getting_its_gradient() -> None:
    plan = Plan.from_yaml(
        "tpplan: 7\nrules:\n  - {match: up, style: colwise, why: x}\n"
        "  - {match: down, style: rowwise, why: x}\n"
    )
    (p,) = run_plan(plan, _Sandwich(), tp_size=2)
    assert p.rule == "rules[0] (match: up)" and p.message.startswith("a backward on a copy")
    assert (
        "fails in mid (_Mid), which takes the output of up: RuntimeError: a gradient of width 8"
        in p.message
    )
