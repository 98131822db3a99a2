"""A module whose forward does not run on fake tensors (a kernel's fake implementation fails
where the real kernel runs) does not refuse the whole model: on the meta device that module
runs whole on real tensors and its layers stay whole with the reason; a model whose weights
are in memory is traced on them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpplan
from tpplan.trace import TraceError

sys.path.insert(0, str(Path(__file__).parent))
from support.parity import assert_parity

_FAKE_FAILS = "The size of tensor a (4) must match the size of tensor b (8)"


@torch.library.custom_op("tpplan_test::attend", mutates_args=())
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


@_attend.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # as SDPA's meta kernel did for grouped kv heads in some latent-attention configs
    raise RuntimeError(_FAKE_FAILS)


def _keep(ctx: object, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)  # type: ignore[attr-defined]


def _grads(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)  # type: ignore[attr-defined]
        return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad)


_attend.register_autograd(_grads, setup_context=_keep)


class _Attention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        return self.o(_attend(q, k, v).transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.down(F.gelu(self.up(x)))


class _Model(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _x(device: str = "cpu") -> torch.Tensor:
    return torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0)).to(device)


@pytest.mark.parametrize("blocks", [3, 10])
def test_on_meta_the_module_that_fails_runs_whole_and_its_layers_stay_whole(blocks: int) -> None:
    """Every block's attention (3 blocks traced one by one, 10 shortened) runs whole with
    the kernel's error in its layers' reason; the MLPs split as usual; the plan runs the
    real model at parity."""
    with torch.device("meta"):
        meta = _Model(blocks)
    plan = tpplan.infer_plan(meta, tp_size=2, example_inputs=_x("meta"))
    rules = {r.match: r for r in plan.rules}
    for layer in ("q", "k", "v", "o"):
        rule = rules[f"blocks.*.attn.{layer}"]
        assert rule.style == "replicate"
        assert rule.why.startswith("kept whole: attn runs whole: its forward does not run on fake")
        assert _FAKE_FAILS in rule.why
    assert (rules["blocks.*.up"].style, rules["blocks.*.down"].style) == ("colwise", "rowwise")
    assert tpplan.check_plan(plan, meta, tp_size=2) == []
    assert_parity(_Model(blocks), plan, 2, _x())


def test_in_memory_the_model_is_traced_on_its_own_weights() -> None:
    """The same model on the CPU: the trace runs on its weights, sees every layer, and the
    plan splits the MLPs and the attention's projections (split and gathered around the op
    the tracer does not know), at parity."""
    model = _Model()
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=_x())
    styles = {r.match: r.style for r in plan.rules}
    assert styles["blocks.*.up"] == "colwise" and styles["blocks.*.attn.q"] == "colwise"
    assert_parity(model, plan, 2, _x())


class _FailsItself(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _attend(self.up(x), x, x)


def test_a_failure_in_the_model_s_own_forward_still_refuses_with_the_error() -> None:
    """Nothing smaller than the model itself can run whole: the trace error stays, naming
    the kernel's words and what to do."""
    with torch.device("meta"):
        meta = _FailsItself()
    with pytest.raises(TraceError) as e:
        tpplan.infer_plan(meta, tp_size=2, example_inputs=_x("meta"))
    assert _FAKE_FAILS in str(e.value) and "Pass example_inputs" in str(e.value)
