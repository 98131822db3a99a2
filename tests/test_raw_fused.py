"""Raw fused weights (issue 35 f with a): one parameter holding q|k|v, or gate|up, end to end,
used in the module's own `einsum`, `x @ w` or `F.linear` and cut into its pieces after. Each
rank holds its slice of every piece (`split_params` with `fused`, a `_StridedShard`), so what
it computes is its own q, k and v; the module is a DTensor region with one all-reduce in its
forward, nothing gathered, and every parameter's full tensor is the original one, as state
dicts and checkpoints see it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.models import seeded, token_batch
from support.parity import (
    assert_parity,
    assert_the_original_state,
    forward_collectives,
    one_counted_forward,
)
from torch import nn

import tpplan
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan.checkpoint import load_checkpoint, save_checkpoint

WIDTH, HEADS, HIDDEN = 32, 4, 64


def _w(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * WIDTH**-0.5)


class _FusedAttention(nn.Module):
    """q|k|v in one raw weight, projected and cut `style`'s way."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style, self.head_dim = style, WIDTH // HEADS
        # F.linear takes the weight stored as nn.Linear stores it: [out, in]
        self.w_qkv = _w(3 * WIDTH, WIDTH) if style == "linear_split" else _w(WIDTH, 3 * WIDTH)
        self.b_qkv = nn.Parameter(0.1 * torch.randn(3 * WIDTH))
        self.w_o = _w(WIDTH, WIDTH)
        if style == "talking":
            self.mix = nn.Parameter(torch.eye(HEADS) + 0.1 * torch.randn(HEADS, HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.style in ("einsum_split", "talking", "reversed"):
            q, k, v = torch.einsum("btc,cf->btf", x, self.w_qkv).split(WIDTH, dim=-1)
        elif self.style == "matmul_chunk":  # with its bias, cut alike
            q, k, v = (x @ self.w_qkv + self.b_qkv).chunk(3, dim=-1)
        elif self.style == "linear_split":
            q, k, v = F.linear(x, self.w_qkv, self.b_qkv).split(WIDTH, dim=-1)
        elif self.style == "view_unbind":
            qkv = torch.einsum("btc,cf->btf", x, self.w_qkv)
            q, k, v = qkv.view(b, t, 3, HEADS, self.head_dim).flatten(-2).unbind(2)
        else:  # slices at sizes read off the output's shape
            qkv = torch.einsum("btc,cf->btf", x, self.w_qkv)
            n = qkv.shape[-1] // 3
            q, k, v = qkv[..., :n], qkv[..., n : 2 * n], qkv[..., 2 * n :]
        q, k, v = (z.reshape(b, t, HEADS, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if self.style == "talking":  # scores mixed across heads before the softmax
            s = torch.einsum("bhqk,hg->bgqk", q @ k.transpose(-2, -1), self.mix)
            a = (s * self.head_dim**-0.5).softmax(-1) @ v
            return a.transpose(1, 2).reshape(b, t, WIDTH) @ self.w_o
        if self.style == "reversed":  # each head attends with another's keys
            k = k.flip(1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return a.reshape(b, t, WIDTH) @ self.w_o


class _FusedMlp(nn.Module):
    """gate|up in one raw weight with its bias, cut by chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.w_gate_up, self.w_down = _w(WIDTH, 2 * HIDDEN), _w(HIDDEN, WIDTH)
        self.b_gate_up = nn.Parameter(0.1 * torch.randn(2 * HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (torch.einsum("btc,cm->btm", x, self.w_gate_up) + self.b_gate_up).chunk(2, -1)
        return torch.einsum("btm,mc->btc", F.silu(gate) * up, self.w_down)


class _Model(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, WIDTH)
        self.attn, self.mlp = _FusedAttention(style), _FusedMlp()
        self.head = nn.Linear(WIDTH, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.attn(x)
        return self.head(x + self.mlp(x))


STYLES = ["einsum_split", "matmul_chunk", "linear_split", "einsum_slices", "view_unbind"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("style", STYLES)
def test_a_raw_fused_weight_splits_by_its_pieces(style: str, tp: int) -> None:
    """q|k|v split as each rank's slice of each piece (a bias added to them alike), gate|up
    as each rank's slice of gate and of up; one all-reduce per module's forward and no
    gather; parity forward and backward on both execution paths; every full tensor the
    original."""
    model = seeded(_Model, style=style)
    x = token_batch(64)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    rules = {r.match: r for r in plan.rules}
    attn, mlp = rules["attn"], rules["mlp"]
    assert attn.style == mlp.style == "split_params", plan.to_yaml()
    qkv = 0 if style == "linear_split" else 1
    assert attn.shard["w_qkv"] == qkv and attn.fused["w_qkv"] == [WIDTH] * 3
    assert mlp.shard == {"w_gate_up": 1, "w_down": 0, "b_gate_up": 0}
    assert mlp.fused == {"w_gate_up": [HIDDEN] * 2, "b_gate_up": [HIDDEN] * 2}
    if style in ("matmul_chunk", "linear_split"):  # the bias its code adds to the pieces
        assert attn.fused["b_qkv"] == [WIDTH] * 3
    assert "in 3 fused pieces, each rank its slice of each" in attn.why
    assert sorted(r.match for r in plan.regions) == ["attn", "mlp"]
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)
    with one_counted_forward(model, plan, tp, x) as (sharded, comms):
        for name in ("attn", "mlp"):
            assert forward_collectives(comms, f"_Model.{name}") == {"all_reduce": 1}
        assert_the_original_state(sharded, model)


def test_the_local_weight_holds_each_ranks_slice_of_each_piece() -> None:
    """Rank r's columns of w_gate_up are gate's r-th slice then up's: the layout the model's
    chunk(2) on its local output reads as its own gate and up."""
    model = seeded(_Model, style="einsum_split")
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=token_batch(64))
    want = model.mlp.w_gate_up.detach()
    with simulated_ranks(2) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        local = rank_values(sharded.mlp.w_gate_up.to_local())
    half = HIDDEN // 2
    for r, got in enumerate(local):
        gate = want[:, r * half : (r + 1) * half]
        up = want[:, HIDDEN + r * half : HIDDEN + (r + 1) * half]
        assert torch.equal(got, torch.cat([gate, up], dim=1)), r


def test_a_whole_save_at_tp_2_loads_at_tp_4(tmp_path: Path) -> None:
    """Saved whole from tp 2 (safetensors) and loaded into the model sharded at tp 4: each
    rank reads its slice of each piece, and the loaded model is at parity."""
    model = seeded(_Model, style="matmul_chunk")
    x = token_batch(64)
    folder = tmp_path / "ckpt"
    with simulated_ranks(2) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, tpplan.infer_plan(model, tp_size=2, example_inputs=x))
        save_checkpoint(sharded, folder, sharded=False)
    fresh = seeded(_Model, style="matmul_chunk", seed=1)
    plan4 = tpplan.infer_plan(fresh, tp_size=4, example_inputs=x)
    want = model(x)
    with simulated_ranks(4) as mesh:
        tpplan.apply_plan(fresh, mesh, plan4)
        load_checkpoint(fresh, folder)
        got = fresh(x)
    for v in rank_values(got):
        torch.testing.assert_close(v, want, atol=1e-5, rtol=1e-5)


_TRIED = (
    "way of splitting them in a DTensor region (on each dim they may split on, in 1, 3 or 2 "
    "equal fused pieces) passed the proof on fake ranks: each ran a collective inside the "
    "module, or failed there"
)
_MIXED = (
    "mix mixes what the split heads computed (each head's result made from every head's, as "
    "talking heads mix the scores before the softmax), which the module's code then uses head "
    "by head: there is no Megatron split (split there, every rank would all-reduce all of it); "
    "and no other "
)


@pytest.mark.parametrize(
    ("style", "said"),
    [
        ("talking", f"(mix, w_o, w_qkv) feed its own matmul or einsum calls, and {_MIXED}{_TRIED}"),
        ("reversed", f"(w_o, w_qkv) feed its own matmul or einsum calls, and no {_TRIED}"),
    ],
    ids=["scores mixed across heads", "keys of another head"],
)
def test_a_raw_fused_weight_no_region_proves_stays_whole_saying_why(style: str, said: str) -> None:
    """Scores mixed across heads before the softmax by a raw [heads, heads] weight (talking
    heads: split, the mix would sum every head's scores over the ranks inside the module
    and every rank hold them all), or each head attending with another head's keys (the
    heads reversed: every way gathers them), have no Megatron split. The attention stays
    whole, its reason naming its weights and the structure or what was tried, no region,
    and the numbers hold."""
    model = seeded(_Model, style=style)
    x = token_batch(64)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=x)
    rules = {r.match: r for r in plan.rules}
    assert rules["attn"].style == "replicate", plan.to_yaml()
    assert rules["attn"].why == f"kept whole: its own weights {said}"
    assert "attn" not in [r.match for r in plan.regions]
    assert_parity(model, plan, 2, x)


@pytest.mark.unit
def test_pieces_of_several_sizes_are_refused_with_the_fix() -> None:
    """A parameter split in place holds each rank's slice of pieces of one size only."""
    from pydantic import ValidationError

    from tpplan.plan.styles import SplitParamsRule

    with pytest.raises(ValidationError) as e:
        SplitParamsRule(
            match="attn", shard={"w_qkv": 1}, fused={"w_qkv": [32, 8, 8]}, why="raw q|k|v"
        )
    assert (
        "split_params: fused w_qkv has pieces of several sizes; a parameter split in place "
        "takes pieces of one size (keep it whole with style: replicate)."
    ) in str(e.value)
    with pytest.raises(ValidationError) as e:
        SplitParamsRule(match="attn", shard={"w_o": 0}, fused={"w_qkv": [32] * 3}, why="x")
    assert "split_params: fused names w_qkv, which is not in shard" in str(e.value)


def test_check_names_fused_pieces_that_do_not_add_up() -> None:
    """fused sizes other than the weight's split dim: one problem naming both and the fix."""
    model = seeded(_Model, style="einsum_split")
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=token_batch(64))
    rules = [
        r.model_copy(update={"fused": {"w_qkv": [16] * 3}}) if r.match == "attn" else r
        for r in plan.rules
    ]
    problems = tpplan.check_plan(plan.model_copy(update={"rules": rules}), model, tp_size=2)
    assert len(problems) == 1, problems
    assert "fused w_qkv [16, 16, 16] add up to 48, but w_qkv dim 1 is 96." in str(problems[0])
    assert "q, k, v" in str(problems[0])
