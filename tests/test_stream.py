"""Sequence parallel fitted to where the stream really flows (tpplan/infer/stream.py).

Models whose stream does not start at a vocab-parallel token lookup (a patch embedding,
whole position embeddings added to the tokens) see it whole in their first block: that
block's norm runs whole, the module whose code first meets the sequence-split stream with a
whole tensor holds it as a stream region, and a module kept whole gathers the stream as it
comes in. Each plan passes `check` and holds forward and backward parity.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tpplan
from tpplan.plan import Plan

sys.path.insert(0, str(Path(__file__).parent))
from support.infer_models import PiecesThenHeads
from support.models import Vit, images, seeded, token_batch
from support.parity import assert_parity


def _styles(plan: Plan) -> dict[str, str]:
    return {r.match: r.style for r in plan.rules}


@pytest.mark.parametrize("tp", [2, 4])
def test_a_vit_stream_starts_whole_at_its_first_block(tp: int) -> None:
    """The patch embedding and the class token make the stream whole: block 0's norm runs
    whole and block 0 lifts its whole input where it meets the first reduce-scattered
    output; from block 1 on the norms run on sequence shards."""
    model = seeded(Vit, patch_embed="conv", fused=False)
    x = images()
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x, sequence_parallel=True)
    styles = _styles(plan)
    assert "blocks.0.norm1" not in styles
    assert styles["blocks.1.norm1"] == "sequence_parallel"
    assert [r.match for r in plan.regions if r.stream] == ["blocks.0"]
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)


def test_a_head_kept_whole_gathers_the_stream_as_it_comes_in() -> None:
    """At tp 4 the head's 10 classes do not divide: kept whole, it gathers its input over
    the sequence (a prepare rule that keeps its reason), so the model's output is whole."""
    model = seeded(Vit, patch_embed="conv", fused=False, classes=10)
    x = images()
    plan = tpplan.infer_plan(model, tp_size=4, example_inputs=x, sequence_parallel=True)
    head = next(r for r in plan.rules if r.match == "head")
    assert (head.style, head.inputs, head.desired_inputs, head.local_input) == (
        "prepare",
        ["shard(1)"],
        ["replicate"],
        True,
    )
    assert head.why.startswith("kept whole") and "the stream ends in it" in head.why
    assert_parity(model, plan, 4, x)


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_position_embeddings_start_the_stream_whole(tp: int) -> None:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    model = GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    plan = tpplan.infer_plan(model, tp_size=tp, sequence_parallel=True)
    assert all(r.stream for r in plan.regions) and plan.regions
    assert "transformer.h.0.ln_1" not in _styles(plan)
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, {"input_ids": ids})


def test_a_stream_region_round_trips_through_the_plan_file() -> None:
    model = seeded(Vit, patch_embed="conv", fused=False)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=images(), sequence_parallel=True)
    again = Plan.from_yaml(plan.to_yaml())
    assert [(r.match, r.stream) for r in again.regions] == [
        (r.match, r.stream) for r in plan.regions
    ]
    assert "stream: true" in plan.to_yaml()


@pytest.mark.parametrize("tp", [2, 4])
def test_nanogpt_adds_positions_to_the_lookup_in_its_own_forward(tp: int) -> None:
    """nanoGPT's forward adds whole position embeddings to the looked-up rows itself, where
    no region can hold the sum: the lookup sums its rows whole (no reduce-scatter there), the
    stream starts at the first block, and the plan holds parity. (Its attention is split
    and gathered here: a DTensor region is not yet proven under sequence parallel.)"""
    from model_zoo.nanogpt import VOCAB, NanoGpt

    model = seeded(NanoGpt)
    x = token_batch(VOCAB)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x, sequence_parallel=True)
    wte = next(r for r in plan.rules if r.match == "transformer.wte")
    assert (wte.style, wte.output) == ("vocab_parallel", None)
    assert "sequence parallel starts after it" in wte.why
    assert plan.regions and all(r.stream for r in plan.regions)
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)


class _Windowed(torch.nn.Module):
    """Swin's way: the tokens cut into windows (`view(B * windows, window, C)`) before a
    Megatron attention, whose dim 1 is then a window's tokens, not the sequence."""

    def __init__(self, dim: int = 32, window: int = 4) -> None:
        super().__init__()
        self.window = window
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = PiecesThenHeads(dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        windows = self.norm1(x).reshape(b * (n // self.window), self.window, c)
        x = x + self.attn(windows).reshape(b, n, c)
        return x + self.fc2(torch.relu(self.fc1(self.norm2(x))))


class _WindowedStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.Sequential(_Windowed(), _Windowed())
        self.out = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def test_a_windowed_attention_under_sequence_parallel_holds_parity() -> None:
    """Its output reduce-scattered over a window's tokens (dim 1 after the windows' view),
    then viewed back: DTensor carries the layout through, and the plan runs at parity.
    (Where such a layout makes the trial run fail, as Swin's shifted windows do, the layers
    there sum whole instead: the zoo's Swin covers that.)"""
    model = _WindowedStack()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=x, sequence_parallel=True)
    assert tpplan.check_plan(plan, model, tp_size=2) == []
    assert_parity(model, plan, 2, x)


def test_where_the_trial_run_fails_the_layers_around_it_sum_whole() -> None:
    """The innermost module at or around the failure that holds reduce-scattering layers:
    they sum whole instead, the rule gathering that module's input goes, and the layers
    elsewhere keep their reduce-scatter."""
    from tpplan import Rule
    from tpplan.infer.stream import _SCATTERED, _summed_whole

    rules = {
        "b.attn": Rule(
            match="b.attn",
            style="prepare",
            inputs=["shard(1)"],
            desired_inputs=["replicate"],
            local_input=True,
            why="gathers",
        ),
        "b.attn.proj": Rule(
            match="b.attn.proj",
            style="rowwise",
            output="shard(1)",
            local_output=False,
            why="contracts" + _SCATTERED,
        ),
        "b.mlp.fc2": Rule(
            match="b.mlp.fc2", style="rowwise", output="shard(1)", local_output=False, why="x"
        ),
    }
    out = _summed_whole(rules, "b.attn.qkv")
    assert set(out) == {"b.attn", "b.attn.proj"} and out["b.attn"] is None
    proj = out["b.attn.proj"]
    assert proj is not None and (proj.output, proj.local_output) == (None, None)
    assert proj.why.startswith("contracts; sequence parallel stops around it")
    assert _summed_whole(rules, None) == {}
