"""Grouped-query attention at a tp size above its key/value head count (colwise
`replicate_heads`, compile/shared_heads.py): each key/value head whole on the tp/heads ranks
whose query heads it serves, the query and output projections split by query heads.

What infer writes (from the trace: the heads' grouping in attention, the count that repeats
them), parity of its plans with the unsharded model forward and backward at tp 2 (heads
split as plain colwise) and tp 4 (each of 2 key/value heads shared by 2 ranks), down every
path transformers takes (grouped attention, repeat_kv under a padding mask, eager); the
parameters' full tensors are the original weights; a checkpoint saved at tp 4 loads at tp 2
and 1; on a fake process group, Llama-3-70B's attention at tp 16 holds 1/16 of q and o and
1/8 of k and v per rank, keeps 1/8 of the KV cache, and runs one all-reduce per block with
no all-gather; and check's messages for the tp sizes it still cannot serve.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import tpplan
from tpplan import Plan
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan._runtime.models import build_model
from tpplan.checkpoint import load_checkpoint, save_checkpoint
from tpplan.diagnose.stats import plan_stats

sys.path.insert(0, str(Path(__file__).parent))
from support.code_styles import Spec, build, inputs
from support.parity import assert_parity

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 128,
}


def _kv_plan(spec: str = "llama", tp: int = 4, config: dict[str, Any] | None = None) -> Plan:
    """The plan infer writes for a tiny model of `spec` (built on the meta device)."""
    return tpplan.infer_plan(build_model(spec, config or TINY, device="meta"), tp_size=tp)


def _tiny(spec: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(spec, TINY, device="cpu").float()


def _ids() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 128, (2, 7), generator=g)}


def _padded(ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same ids with a padding mask (the first sequence's first two tokens padding):
    transformers then repeats the key/value heads by num_key_value_groups (repeat_kv)."""
    mask = torch.ones_like(ids["input_ids"])
    mask[0, :2] = 0
    return {**ids, "attention_mask": mask}


def test_infer_shares_the_kv_heads_past_their_count() -> None:
    """2 key/value heads, 8 query heads: k and v take replicate_heads, q and o plain, and the
    count repeat_kv reads is divided by the ranks sharing a head; the plan is the same at
    tp 2 (it serves both) and check passes it at tp 2, 4 and 8."""
    plan = _kv_plan(tp=4)
    rules = {r.match.rpartition(".")[2]: r for r in plan.rules}
    assert rules["k_proj"].replicate_heads and rules["v_proj"].replicate_heads
    assert rules["q_proj"].replicate_heads is None and rules["q_proj"].output is None
    assert rules["o_proj"].style == "rowwise"
    (attr,) = plan.attributes
    assert (attr.divide, attr.by, attr.of) == (["num_key_value_groups"], "replicas", "k_proj")
    assert _kv_plan(tp=2).to_data()["rules"] == plan.to_data()["rules"]
    model = build_model("llama", TINY, device="meta")
    for tp in (2, 4, 8):
        assert tpplan.check_plan(plan, model, tp_size=tp) == [], tp


@pytest.mark.parametrize("spec", ["llama", "qwen3"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("masked", [False, True], ids=["grouped", "repeat_kv"])
def test_shared_kv_heads_match_the_unsharded_model(spec: str, tp: int, masked: bool) -> None:
    model = _tiny(spec)
    plan = _kv_plan(spec, tp)
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, _padded(_ids()) if masked else _ids())


def test_eager_attention_shares_kv_heads_at_tp4() -> None:
    """Eager attention always repeats the key/value heads (repeat_kv): infer proves the count
    on that path too."""
    model = _tiny("llama")
    model.config._attn_implementation = "eager"
    plan = tpplan.infer_plan(copy.deepcopy(model).to("meta"), tp_size=4)
    assert [a.by for a in plan.attributes] == ["replicas"]
    assert_parity(model, plan, 4, _padded(_ids()))


class _Gqa(nn.Module):
    """Hand-written grouped-query attention, torchtitan's way: its key/value heads repeated
    by `self.n_rep` (or, with `literal`, by a number no attribute holds; with `computed`, by
    `self.n_heads // self.n_kv`, counts its views do not read)."""

    def __init__(self, literal: bool = False, computed: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd, self.literal = 8, 2, 8, literal
        self.computed = computed
        self.n_rep = self.n_heads // self.n_kv
        self.wq = nn.Linear(32, 64, bias=False)
        self.wk = nn.Linear(32, 16, bias=False)
        self.wv = nn.Linear(32, 16, bias=False)
        self.wo = nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.hd)
        k = self.wk(x).view(b, s, -1, self.hd)
        v = self.wv(x).view(b, s, -1, self.hd)
        rep = 4 if self.literal else self.n_heads // self.n_kv if self.computed else self.n_rep
        k, v = (
            t.unsqueeze(3).expand(b, s, t.shape[2], rep, self.hd).reshape(b, s, -1, self.hd)
            for t in (k, v)
        )
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


def test_a_repeat_by_an_attribute_is_divided_for_shared_heads() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Gqa())
    plan = tpplan.infer_plan(model, tp_size=4)
    rules = {r.match: r for r in plan.rules}
    assert rules["0.wk"].replicate_heads and rules["0.wv"].replicate_heads
    assert [(a.match, a.divide, a.by, a.of) for a in plan.attributes] == [
        ("0", ["n_rep"], "replicas", "wk")
    ]
    assert_parity(model, plan, 4, torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2)))


def _shared_in_a_region(model: nn.Module, plan: Plan) -> None:
    """The attention runs as a DTensor region at tp 4, each rank holding the one key/value
    head its query heads use (seen by the code in every head's place: the repeat by a number
    the plan cannot divide then holds), its query and output split, to parity."""
    rules = {r.match: r for r in plan.rules}
    assert [r.match for r in plan.regions] == ["0"], plan.to_yaml()
    assert "wk, wv sharing whole key/value heads" in plan.regions[0].why
    for name in ("0.wk", "0.wv"):
        rule = rules[name]
        assert (rule.style, rule.replicate_heads, rule.local_output) == ("colwise", True, False)
        assert "each head goes whole to the 2 ranks whose query heads it serves" in rule.why
    assert (rules["0.wq"].style, rules["0.wo"].style) == ("colwise", "rowwise")
    assert not tpplan.check_plan(plan, model, tp_size=4)
    assert_parity(model, plan, 4, torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2)))


def test_a_repeat_by_a_number_no_attribute_holds_is_shared_in_a_region() -> None:
    """Repeated by a literal 4, each rank's one head would be repeated 4 times past the count
    on local shards: at tp 4 the attention runs on DTensors, each rank holding its one
    key/value head and the code seeing it in every head's place; at tp 2 the heads split."""
    model = nn.Sequential(_Gqa(literal=True))
    _shared_in_a_region(model, tpplan.infer_plan(model, tp_size=4))
    assert tpplan.infer_plan(model, tp_size=2).rules[1].output is None


def test_a_repeat_computed_from_counts_the_plan_does_not_divide_is_shared_in_a_region() -> None:
    """`n_heads // n_kv` where the views count no heads (-1): neither is divided, so each
    rank would repeat its one head 4 times where 2 are needed on local shards. At tp 4 a
    DTensor region sharing the key/value heads one per rank; at tp 2 they split as they are."""
    model = nn.Sequential(_Gqa(computed=True))
    _shared_in_a_region(model, tpplan.infer_plan(model, tp_size=4))
    assert tpplan.infer_plan(model, tp_size=2).rules[1].output is None


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(
    "kv", ["gqa", "mqa"], ids=["grouped, computed repeat", "one kv head of its own layer"]
)
def test_hand_written_key_value_heads_are_shared_past_their_count(kv: str, tp: int) -> None:
    """Key/value heads from layers of their own, viewed by `self.n_kv`, repeated by
    `self.n_head // self.n_kv` (a number no attribute holds, computed from the counts the
    plan divides) and merged back by `self.n_head * self.head_dim`: 2 key/value heads for 4
    query heads, or one for all (multi-query attention). Past the key/value heads each is
    whole on the ranks it serves (tests/test_code_styles.py holds these cases to parity
    and to gathering nothing)."""
    spec = Spec(kv=kv)  # type: ignore[arg-type]
    model, ids = build(spec), inputs()
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=ids)
    rules = {r.match.rpartition(".")[2]: r for r in plan.rules}
    for name in ("q_proj", "k_proj", "v_proj"):
        assert rules[name].style == "colwise" and rules[name].output is None, rules[name]
        # the plan holds at every tp the heads take: the key/value heads shared past K
        assert bool(rules[name].replicate_heads) == (name != "q_proj")
    assert rules["o_proj"].style == "rowwise"
    if kv == "mqa":
        assert "its one key/value head serves every query head" in rules["k_proj"].why
    divided = {(a.by or "tp", tuple(a.divide)) for a in plan.attributes}
    assert ("tp", ("n_head",)) in divided


def test_a_shared_heads_gradient_is_summed_over_the_ranks_sharing_it() -> None:
    """At tp 4 each key/value head serves two ranks' query heads: its gradient is the sum of
    both (each alone is about half), the same on both ranks, and as large as tol is not."""
    model, ids = _tiny("llama"), _ids()  # inputs made before the ranks: the same on each
    ref = copy.deepcopy(model)
    ref(**ids).logits.pow(2).sum().backward()
    want = ref.model.layers[0].self_attn.k_proj.weight.grad
    plan = _kv_plan()
    with simulated_ranks(4) as mesh:
        tpplan.apply_plan(model, mesh, plan)
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
    plan = _kv_plan()
    with simulated_ranks(4) as mesh:
        tpplan.apply_plan(model, mesh, plan)
        got = {
            k: rank_values(v.full_tensor() if isinstance(v, DTensor) else v)[0]
            for k, v in model.state_dict().items()
        }
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("load_tp", [1, 2])
def test_a_checkpoint_saved_at_tp4_loads_at_another_tp(tmp_path: Path, load_tp: int) -> None:
    """Saved whole (safetensors, each key/value head once) where two ranks share each head,
    loaded exactly where none does; through DCP on gloo ranks in test_checkpoint.py."""
    model = _tiny("llama")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    plan = _kv_plan()
    with simulated_ranks(4) as mesh:
        save_checkpoint(tpplan.apply_plan(model, mesh, plan), tmp_path, sharded=False)
    fresh = build_model("llama", TINY, device="cpu").float()
    if load_tp == 1:
        load_checkpoint(fresh, tmp_path)
        got = fresh.state_dict()
    else:
        with simulated_ranks(load_tp) as mesh:
            tpplan.apply_plan(fresh, mesh, plan)
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
    """The plan infer writes at tp 16 for 64 query heads and 8 key/value heads."""
    model = build_model("llama", LLAMA3_70B, device="meta")
    plan = tpplan.infer_plan(model, tp_size=16)
    assert tpplan.check_plan(plan, model, tp_size=16) == []
    stats = plan_stats(model, plan, tp_size=16)
    fwd = stats.collectives["forward"]
    # 2 blocks x (attention + MLP) + the embedding's sum; the output head's gather only
    assert fwd["all_reduce"]["count"] == 5
    assert fwd["all_gather_into_tensor"]["count"] == 1
    assert stats.kv_cache_bytes_per_token_total is not None
    assert stats.kv_cache_bytes_per_token == stats.kv_cache_bytes_per_token_total / 8


@pytest.mark.parametrize(
    ("tp", "said"),
    [
        (3, "2 heads (of head_dim 8) do not split evenly over tp size 3"),
        (16, "8 heads (of head_dim 8) do not split evenly over tp size 16"),
    ],
)
def test_check_names_the_tp_sizes_sharing_cannot_serve(tp: int, said: str) -> None:
    """tp 3 neither divides the 2 key/value heads nor is a multiple of them; tp 16 splits 8
    query heads in halves. Each gets one message naming the layer and the sizes to use."""
    model = build_model("llama", TINY, device="meta")
    problems = tpplan.check_plan(_kv_plan(), model, tp_size=tp)
    assert problems and all(said in p.message or p.kind != "heads" for p in problems)
    text = "\n".join(str(p) for p in problems)
    assert said in text
    if tp == 3:
        assert "k_proj" in text and "or a multiple of 2 dividing the query heads" in text
    else:
        assert "q_proj" in text and "use a tp size among" in text


@pytest.mark.parametrize("tp", [2, 4])
def test_clip_grad_norm_over_the_meshes_is_the_unsharded_models(tp: int) -> None:
    """Shared key/value heads live on a 2-D view of the tp mesh, where torch's
    clip_grad_norm_ refuses to stack norms across meshes: tpplan.clip_grad_norm_ gives the
    unsharded model's total norm and clipped gradients, on every rank."""
    model, ids = _tiny("llama"), _ids()
    ref = copy.deepcopy(model)
    ref(**ids).logits.pow(2).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1.0)
    assert want > 10  # so the clipping scales every gradient
    plan = _kv_plan()
    with simulated_ranks(tp) as mesh:
        tpplan.apply_plan(model, mesh, plan)
        model(**ids).logits.pow(2).sum().backward()
        total = rank_values(tpplan.clip_grad_norm_(model.parameters(), max_norm=1.0))
        grads = {
            n: rank_values(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
            for n, p in model.named_parameters()
        }
    assert all(abs(t.item() - want.item()) <= 1e-4 * want.item() for t in total)
    for name, p in ref.named_parameters():
        for rank, g in enumerate(grads[name]):
            assert (g - p.grad).abs().max().item() <= 1e-6, (name, rank)


def test_verify_compares_a_shared_heads_outputs_with_its_heads_share() -> None:
    """verify_plan compares each module's output on each rank with its share of the
    unsharded one: a shared key/value projection's output is one head of K, the same on the
    tp/K ranks that share it, not a 1/tp chunk."""
    model = _tiny("llama")
    report = tpplan.verify_plan(model, _kv_plan(), tp_size=4, backward=True)
    assert report.ok, report.rows
    k_proj = [err for (name, _), err in report.rows.items() if name.endswith("self_attn.k_proj")]
    assert k_proj and max(k_proj) <= report.tol


def test_sequence_parallel_with_shared_heads_matches_the_unsharded_model() -> None:
    """With the stream split over the sequence, the shared key/value projections gather
    their input as the query's does."""
    plan = tpplan.infer_plan(
        build_model("llama", TINY, device="meta"), tp_size=4, sequence_parallel=True
    )
    assert {r.match.rpartition(".")[2] for r in plan.rules if r.shares_heads()} == {
        "k_proj",
        "v_proj",
    }
    assert_parity(_tiny("llama"), plan, 4, _ids())
