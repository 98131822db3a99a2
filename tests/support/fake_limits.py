"""Tiny models with a module that fake tensors cannot run, whatever the plan: one that reads
a value (`.item()`), one whose output shape depends on the values (`nonzero`), one that calls
a kernel with no fake implementation, and a fused layer whose gathered output DTensor itself
cannot make on fake tensors (torch 2.13's `_StridedShard` to `Replicate`: DiffLlama's v_proj,
Mamba's in_proj). Each is split by PLAN (tests/plans/sandwich.yaml), which is sound; `tpplan verify` proves it on numbers.
Shared by test_check_fake_limits and test_cli (as `support.fake_limits:fused`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tpplan import Plan, load_plan

PLAN = load_plan(Path(__file__).parents[1] / "plans" / "sandwich.yaml")


@torch.library.custom_op("tpplan_tests::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    """A kernel for real tensors only: no `register_fake`."""
    return x * 2


class _ReadsValue(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum().item() > 0 else -x  # (B, T, 16), values read


class _Nonzero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.nonzero().shape[0]  # (B, T, 16), a count of the values


class _NoFakeKernel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled(x)  # (B, T, 16)


class Sandwich(nn.Module):
    """embed -> up (colwise) -> mid -> down (rowwise): `mid` is what fake tensors cannot run."""

    def __init__(self, mid: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 8)
        self.up, self.mid, self.down = nn.Linear(8, 16), mid, nn.Linear(16, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.down(self.mid(self.up(self.embed(input_ids))))


def value_read() -> Sandwich:
    return Sandwich(_ReadsValue())


def nonzero() -> Sandwich:
    return Sandwich(_Nonzero())


def no_fake_kernel() -> Sandwich:
    return Sandwich(_NoFakeKernel())


# up's 16 features are two fused pieces of 8 (`parts`), gathered after it (output: replicate):
# torch's own gather of such pieces reads values on fake tensors; tpplan's does not
FUSED_PLAN = Plan.from_yaml(
    "tpplan: 17\nrules:\n"
    "  - {match: up, style: colwise, parts: [8, 8], output: replicate, why: x}\n"
)


def fused() -> Sandwich:
    return Sandwich(nn.Identity())
