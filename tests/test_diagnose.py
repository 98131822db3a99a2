"""The diagnostics on their own: plan_stats (what a plan costs per rank, on the meta device)
and verify_plan (each module's error against the unsharded model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.models import tiny_llama

from tpplan.diagnose.stats import plan_stats
from tpplan.diagnose.verify import Verification, _error, verify_plan
from tpplan.plan import Plan, load_plan

LLAMA_PLAN = Path(__file__).parent / "plans" / "llama.yaml"


def _split_bytes(model: torch.nn.Module, tp: int) -> int:
    """Parameter bytes per rank under tests/plans/llama.yaml, counted by hand: the
    projections, the embedding and the head are split in tp, norms stay whole."""
    split = ("_proj.", "embed_tokens.", "lm_head.")
    return sum(
        p.numel() * p.element_size() // (tp if any(s in n for s in split) else 1)
        for n, p in model.named_parameters()
    )


@pytest.mark.parametrize("tp", [2, 4])
def test_stats_count_bytes_per_rank_and_megatrons_collectives(tp: int) -> None:
    model = tiny_llama(device="meta")
    stats = plan_stats(model, load_plan(LLAMA_PLAN), tp_size=tp, batch=2, seq=8)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stats.param_bytes_total == total
    assert stats.param_bytes_per_rank == _split_bytes(model, tp)
    assert stats.tokens == 16
    layers = len(model.model.layers)
    forward = stats.collectives["forward"]
    # one all-reduce closing attention and one the MLP per block, one after the lookup;
    # the logits gathered once
    assert {k: v["count"] for k, v in forward.items()} == {
        "all_reduce": 2 * layers + 1,
        "all_gather_into_tensor": 1,
    }
    # each all-reduce sends a whole (2, 8, 64) fp32 activation
    assert forward["all_reduce"]["bytes"] == (2 * layers + 1) * 2 * 8 * 64 * 4
    assert "backward" not in stats.collectives


def test_stats_with_backward_count_its_collectives_too() -> None:
    stats = plan_stats(tiny_llama(device="meta"), load_plan(LLAMA_PLAN), tp_size=2, backward=True)
    assert stats.collectives["backward"]["all_reduce"]["count"] > 0
    assert stats.to_dict()["param_fraction"] == round(stats.param_fraction, 6)


def test_verify_of_a_sound_plan_is_within_tolerance_everywhere() -> None:
    report = verify_plan(tiny_llama(), load_plan(LLAMA_PLAN), tp_size=2, backward=True)
    assert report.ok, report.rows
    assert ("model.layers.*.self_attn.o_proj", "output") in report.rows
    assert ("model.layers.*.self_attn.q_proj.weight", "grad") in report.rows
    assert report.worst <= 1e-5  # fp32 sums in another order


def test_verify_names_the_gradient_a_wrong_plan_gets_wrong() -> None:
    """replicate_grad_sum on the final norm, which sees whole activations: each rank's
    gradient is already whole, so summing it over 2 ranks doubles it. check_plan cannot see
    a number; verify can."""
    data = load_plan(LLAMA_PLAN).model_dump(mode="json", exclude_none=True)
    data["rules"].append({"match": "model.norm", "style": "replicate_grad_sum", "why": "wrong"})
    report = verify_plan(tiny_llama(), Plan.model_validate(data), tp_size=2, backward=True)
    assert not report.ok
    assert [k for k, v in report.rows.items() if v > report.tol] == [("model.norm.weight", "grad")]


@pytest.mark.unit
def test_a_ranks_piece_is_compared_with_its_own_chunk_of_the_whole() -> None:
    whole = torch.arange(24.0).reshape(2, 12)
    assert _error(whole[:, 6:], whole, rank=1, tp=2) == 0.0
    assert _error(whole[:, 6:], whole, rank=0, tp=2) == 6.0
    # a fused output of 3 pieces of 4: rank 1 holds the second half of each piece
    mine = whole[:, [2, 3, 6, 7, 10, 11]]
    assert _error(mine, whole, rank=1, tp=2, parts=(4, 4, 4)) == 0.0
    assert _error(whole[:, :5], whole, rank=0, tp=2) == float("inf")  # no split fits


@pytest.mark.unit
def test_a_report_keeps_the_worst_error_per_layer_pattern() -> None:
    report = Verification(tp_size=2, tol=1e-4)
    report.add("model.layers.0.mlp", "output", 1e-6)
    report.add("model.layers.1.mlp", "output", 1e-3)
    assert report.rows == {("model.layers.*.mlp", "output"): 1e-3}
    assert not report.ok and report.worst == 1e-3


@pytest.mark.parametrize("tp", [2, 8])
def test_stats_count_the_working_rows_of_a_fused_layer_of_unequal_pieces(tp: int) -> None:
    """q|k|v of 64|32|32 computes with a copy of each rank's own rows beside its shard: one
    more shard at tp 2; at tp 8, past its 4 key/value heads, its query slice and a whole key
    and value head each (8 + 8 + 8 rows)."""
    from support.infer_models import fused_gqa

    import tpplan

    model = fused_gqa()
    plan = tpplan.infer_plan(model, example_inputs=torch.randint(0, 32, (2, 8)))
    stats = plan_stats(model, plan, tp_size=tp, batch=2, seq=8)
    rows = {2: (64 + 32 + 32) // 2, 8: 64 // 8 + 8 + 8}[tp]
    assert stats.working_bytes_per_rank == rows * (64 + 1) * 4  # weight rows and bias
    shard = (64 + 32 + 32) // tp * (64 + 1) * 4
    assert stats.working_bytes_per_rank >= shard
