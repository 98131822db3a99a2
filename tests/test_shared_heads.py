"""Grouped-query attention at a tp size above its key/value head count (colwise
`replicate_heads`, compile/shared_heads.py): each key/value head whole on the tp/heads ranks
whose query heads it serves, the query and output projections split by query heads.

Parity with the unsharded model forward and backward at tp 2 (heads split as plain colwise)
and tp 4 (each of 2 key/value heads shared by 2 ranks); parameters' full tensors are the
original weights; a checkpoint saved at tp 4 loads at tp 2 and 1; and on a fake process group,
Llama-3-70B's attention at tp 16 holds 1/16 of q and o and 1/8 of k and v per rank, keeps 1/8
of the KV cache, and runs one all-reduce per block with no all-gather.

PROTOTYPE: the plans here are written by hand (infer does not write replicate_heads yet).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

import tpplan
from tpplan import Plan
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan._runtime.models import build_model
from tpplan.checkpoint import load_checkpoint, save_checkpoint
from tpplan.diagnose.stats import plan_stats

sys.path.insert(0, str(Path(__file__).parent))
from blocks import assert_parity

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 128,
}


def _kv_plan(head_dim: int, *, qk_norm: bool = False) -> Plan:
    """The Llama/Qwen3 plan with k and v sharing their heads past tp 2 (tp-size free)."""
    attn = "model.layers.*.self_attn"
    rules: list[dict[str, Any]] = [
        {"match": "model.embed_tokens", "style": "vocab_parallel", "why": "vocab rows"},
        {"match": f"{attn}.q_proj", "style": "colwise", "head_dim": head_dim, "why": "q heads"},
        *(
            {
                "match": f"{attn}.{kv}",
                "style": "colwise",
                "head_dim": head_dim,
                "replicate_heads": True,
                "why": "each kv head on the ranks of its query heads",
            }
            for kv in ("k_proj", "v_proj")
        ),
        {"match": f"{attn}.o_proj", "style": "rowwise", "head_dim": head_dim, "why": "closes"},
        *(
            {"match": f"{attn}.{n}", "style": "replicate_grad_sum", "why": "per-head norm"}
            for n in (("q_norm", "k_norm") if qk_norm else ())
        ),
        {"match": "model.layers.*.mlp.gate_proj", "style": "colwise", "why": "mlp"},
        {"match": "model.layers.*.mlp.up_proj", "style": "colwise", "why": "mlp"},
        {"match": "model.layers.*.mlp.down_proj", "style": "rowwise", "why": "mlp"},
        {"match": "lm_head", "style": "colwise", "output": "replicate", "why": "vocab"},
    ]
    attributes = [
        {
            "match": attn,
            "divide": ["num_key_value_groups"],
            "by": "replicas",
            "of": "k_proj",
            "why": "the query heads per key/value head each rank holds",
        }
    ]
    return Plan.from_data(
        {"tpplan": 11, "model": {"class": "any"}, "rules": rules, "attributes": attributes}
    )


def _tiny(spec: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(spec, TINY, device="cpu").float()


def _ids() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 128, (2, 7), generator=g)}


@pytest.mark.parametrize("spec", ["llama", "qwen3"])
@pytest.mark.parametrize("tp", [2, 4])
def test_shared_kv_heads_match_the_unsharded_model(spec: str, tp: int) -> None:
    model = _tiny(spec)
    plan = _kv_plan(8, qk_norm=spec == "qwen3")
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, _ids())


def test_a_shared_heads_gradient_is_summed_over_the_ranks_sharing_it() -> None:
    """At tp 4 each key/value head serves two ranks' query heads: its gradient is the sum of
    both (each alone is about half), the same on both ranks, and as large as tol is not."""
    model, ids = _tiny("llama"), _ids()  # inputs made before the ranks: the same on each
    ref = copy.deepcopy(model)
    ref(**ids).logits.pow(2).sum().backward()
    want = ref.model.layers[0].self_attn.k_proj.weight.grad
    with simulated_ranks(4) as mesh:
        tpplan.apply_plan(model, mesh, _kv_plan(8))
        model(**ids).logits.pow(2).sum().backward()
        w = model.model.layers[0].self_attn.k_proj.weight
        assert isinstance(w, DTensor) and isinstance(w.grad, DTensor)
        assert w.grad.placements == w.placements
        local = rank_values(w.grad.to_local())
        whole = rank_values(w.grad.full_tensor())[0]
    assert [tuple(t.shape) for t in local] == [(8, 64)] * 4  # one head each
    assert torch.equal(local[0], local[1]) and torch.equal(local[2], local[3])
    scale = want.abs().max().item()
    assert scale > 0.05  # a gradient of half the size would be off by far more than tol
    assert (whole - want).abs().max().item() <= 1e-5 * scale  # fp32 sums in another order


def test_full_tensors_are_the_original_weights() -> None:
    model = _tiny("llama")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with simulated_ranks(4) as mesh:
        tpplan.apply_plan(model, mesh, _kv_plan(8))
        got = {
            k: rank_values(v.full_tensor() if isinstance(v, DTensor) else v)[0]
            for k, v in model.state_dict().items()
        }
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("load_tp", [1, 2])
def test_a_checkpoint_saved_at_tp4_loads_at_another_tp(tmp_path: Path, load_tp: int) -> None:
    model = _tiny("llama")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with simulated_ranks(4) as mesh:
        save_checkpoint(tpplan.apply_plan(model, mesh, _kv_plan(8)), tmp_path, sharded=False)
    fresh = build_model("llama", TINY, device="cpu").float()
    if load_tp == 1:
        load_checkpoint(fresh, tmp_path)
        got = fresh.state_dict()
    else:
        with simulated_ranks(load_tp) as mesh:
            tpplan.apply_plan(fresh, mesh, _kv_plan(8))
            load_checkpoint(fresh, tmp_path)
            got = {
                k: rank_values(v.full_tensor() if isinstance(v, DTensor) else v)[0]
                for k, v in fresh.state_dict().items()
            }
    assert all(torch.equal(got[k], want[k]) for k in want)


LLAMA3_70B = {
    "num_hidden_layers": 2,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}


def test_llama3_70b_at_tp16_shares_kv_heads_with_one_all_reduce_per_block() -> None:
    model = build_model("llama", LLAMA3_70B, device="meta")
    plan = _kv_plan(128)
    assert tpplan.check_plan(plan, model, tp_size=16) == []
    stats = plan_stats(model, plan, tp_size=16)
    fwd = stats.collectives["forward"]
    # 2 blocks x (attention + MLP) + the embedding's sum; the output head's gather only
    assert fwd["all_reduce"]["count"] == 5
    assert fwd["all_gather_into_tensor"]["count"] == 1
    assert stats.kv_cache_bytes_per_token_total is not None
    assert stats.kv_cache_bytes_per_token == stats.kv_cache_bytes_per_token_total / 8
