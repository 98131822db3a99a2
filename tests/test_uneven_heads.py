"""Attention heads a tp size does not divide (issue 35 h): 28 query heads at tp 8, 14 at tp 4,
5 at tp 2 split unevenly in whole heads, each rank's its own key/value heads'
(compile/uneven_heads.py, infer/uneven_heads.py). Simulated ranks here; real gloo ranks,
generate included, in test_processes.py (slow)."""

from __future__ import annotations

import copy

import pytest
import torch
from model_zoo.measure import measure
from support.models import token_batch
from support.parity import assert_parity, assert_the_original_state
from support.uneven_heads import (
    HEAD_DIM,
    VOCAB,
    gpt2,
    gpt_neox,
    llama,
    phi3,
    qwen2,
    qwen3,
    uneven_plan,
)
from torch.distributed.tensor import DTensor

import tpplan
from tpplan._runtime.local import simulated_ranks
from tpplan.compile.shard import own_attributes
from tpplan.compile.uneven_heads import head_shares
from tpplan.errors import TpplanError

IDS = token_batch(VOCAB)


@pytest.mark.parametrize(
    ("heads", "group", "tp", "counts", "kv_first"),
    [
        # Qwen2-7B's 28 heads in 4 groups at tp 8: each key/value head on 2 ranks
        (28, 7, 8, [4, 3] * 4, [0, 0, 1, 1, 2, 2, 3, 3]),
        (14, 7, 4, [4, 3, 4, 3], [0, 0, 1, 1]),
        # Falcon-7B's 71 heads and one key/value head at tp 8
        (71, 71, 8, [9] * 7 + [8], [0] * 8),
        # 25 heads of their own (GPT-2 XL's count) at tp 2
        (25, 1, 2, [13, 12], [0, 13]),
        # 3 groups of 2 at tp 2: whole groups, 2 and 1
        (6, 2, 2, [4, 2], [0, 2]),
        # tp dividing them: the even split, unchanged
        (32, 4, 8, [4] * 8, [0, 1, 2, 3, 4, 5, 6, 7]),
    ],
)
def test_each_rank_takes_whole_heads_of_its_own_key_value_heads(
    heads: int, group: int, tp: int, counts: list[int], kv_first: list[int]
) -> None:
    shares = head_shares(heads, group, tp)
    assert [s.count for s in shares] == counts
    assert [s.kv_first for s in shares] == kv_first
    # the query heads of every rank, in order, are every head once, of its own groups
    assert [h for s in shares for h in range(s.first, s.first + s.count)] == list(range(heads))
    for s in shares:
        assert s.first // group == s.kv_first
        assert (s.first + s.count - 1) // group == s.kv_first + s.kv_count - 1


@pytest.mark.parametrize(
    ("heads", "group", "tp", "message"),
    [
        (
            6,
            2,
            4,
            "6 query heads in 3 key/value groups have no split into whole heads at tp 4: every "
            "rank needs whole query heads of whole or shared key/value heads. Use a tp size "
            "among 2, 3, 6, or keep the attention replicated.",
        ),
        (
            4,
            4,
            8,
            "4 query heads in 1 key/value groups have no split into whole heads at tp 8: every "
            "rank needs whole query heads of whole or shared key/value heads. Use a tp size "
            "among 2, 3, 4, or keep the attention replicated.",
        ),
    ],
)
def test_no_split_into_whole_heads_is_refused_with_the_sizes_that_have_one(
    heads: int, group: int, tp: int, message: str
) -> None:
    with pytest.raises(TpplanError) as e:
        head_shares(heads, group, tp)
    assert str(e.value) == message


BUILD = {"qwen2": qwen2, "llama": llama, "qwen3": qwen3}


CASES = [
    pytest.param("qwen2", 14, 2, 4, id="qwen2-14q-2kv-tp4"),
    pytest.param("qwen2", 28, 4, 8, id="qwen2-28q-4kv-tp8"),
    pytest.param("llama", 5, 5, 2, id="llama-5-heads-tp2"),
    pytest.param("qwen3", 14, 2, 4, id="qwen3-qk-norm-14q-2kv-tp4"),
]


@pytest.mark.parametrize(("arch", "heads", "kv", "tp"), CASES)
# CommDebugMode hooks every module's backward; transformers' models hand back a ModelOutput,
# which torch warns backward hooks cannot see (the forwards are what is counted)
@pytest.mark.filterwarnings("ignore:For backward hooks to be called:UserWarning")
def test_inferred_uneven_heads_match_the_unsharded_model(
    arch: str, heads: int, kv: int, tp: int
) -> None:
    """infer_plan splits heads tp does not divide unevenly (not split then gathered), says
    so in its reasons, `check` takes the plan, and forward and backward match the unsharded
    model on both paths; the state dict is the original's and no attention all-gathers."""
    model = BUILD[arch](heads, kv)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=IDS)
    rules = {r.match.rpartition(".")[2]: r for r in plan.rules if "self_attn" in r.match}
    group = heads // kv
    assert rules["q_proj"].uneven_group() == group
    assert rules["o_proj"].uneven_group() == group
    assert rules["o_proj"].style == "rowwise"
    for name in ("k_proj", "v_proj"):
        if tp > kv:
            assert rules[name].shares_heads() and rules[name].uneven_group() is None
        else:
            assert rules[name].uneven_group() == 1
    assert "split unevenly" in rules["q_proj"].why, rules["q_proj"].why
    assert not tpplan.check_plan(plan, model, tp_size=tp)
    assert_parity(model, plan, tp, IDS)
    measured = measure(model, plan, tp, IDS, {"attention": r"model\.layers\.\d+\.self_attn"})
    for block, kinds in measured.collectives.items():
        # each rank's copy of its rows is gathered once, with the weight (the first call);
        # every call after gathers nothing: one all-reduce, as an even split
        assert not any(k.startswith("all_gather") for k in kinds), (block, kinds)
        assert kinds.get("all_reduce") == 1, (block, kinds)
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        assert_the_original_state(sharded, model)


def test_each_rank_holds_its_own_heads_and_attribute_values() -> None:
    """At tp 4, 14 query heads in 2 groups: ranks hold 4, 3, 4, 3 query heads, one key/value
    head each, and read num_key_value_groups as their own count."""
    model, tp = qwen2(14, 2), 4
    plan = uneven_plan(14, 2, tp)
    attention = model.model.layers[0].self_attn
    rule = plan.attributes[0]
    values = own_attributes(
        plan, model, rule, "model.layers.0.self_attn", "num_key_value_groups", tp, 7
    )
    assert values == [4, 3, 4, 3]
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        attention = sharded.model.layers[0].self_attn
        own = attention.q_proj._tpplan_local_run.own
        index = own.index(torch.device("cpu"))
        from tpplan._runtime.local import rank_values

        assert [v.numel() // HEAD_DIM for v in rank_values(index)] == [4, 3, 4, 3]
        groups = attention.num_key_value_groups
        assert [int(str(groups.node._local_ints[r])) for r in range(tp)] == [4, 3, 4, 3]
        # the parameters stay plain shards of the original: equal rows on every rank
        assert isinstance(attention.q_proj.weight, DTensor)
        shapes = {tuple(v.shape) for v in rank_values(attention.q_proj.weight.to_local())}
        assert shapes == {(14 * HEAD_DIM // tp, 64)}


def test_check_refuses_uneven_heads_with_no_split_in_whole_heads() -> None:
    """A hand plan splitting 6 query heads in 3 groups unevenly at tp 4: no rank split
    exists (tp above the groups and no multiple of them); check names the sizes."""
    model = qwen2(6, 3)
    plan = uneven_plan(6, 3, 2)
    problems = tpplan.check_plan(plan, model, tp_size=4)
    messages = {p.message for p in problems}
    assert (
        "6 query heads in 3 key/value groups have no split into whole heads at tp 4: every "
        "rank needs whole query heads of whole or shared key/value heads. Use a tp size "
        "among 2, 3, 6, or keep the attention replicated." in messages
    ), messages


def test_check_of_a_plan_for_every_tp_points_to_the_plan_for_this_one() -> None:
    """A plan inferred with no tp (as the shipped ones are) splits heads evenly; at a tp that
    does not divide them, check's fix names the command that writes the uneven split."""
    model = qwen2(14, 2)
    fixes = {p.module: p.fix for p in tpplan.check_plan(tpplan.infer_plan(model), model, tp_size=4)}
    assert fixes["model.layers.*.self_attn.q_proj"] == (
        "use a tp size among 1, 2, 7, 14, or keep this module replicated; or write a plan for "
        "this tp (`tpplan infer MODEL --tp 4`), which splits the heads unevenly, whole heads per "
        "rank, where the model allows it."
    )
    # and that plan passes
    assert not tpplan.check_plan(tpplan.infer_plan(model, tp_size=4), model, tp_size=4)


def test_a_dtensor_reaching_an_uneven_layer_is_refused_by_name() -> None:
    model, tp = qwen2(14, 2), 4
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, uneven_plan(14, 2, tp))
        q = sharded.model.layers[0].self_attn.q_proj
        from torch.distributed.tensor import Replicate

        x = DTensor.from_local(torch.randn(2, 8, 64), mesh, [Replicate()])
        with pytest.raises(TpplanError) as e:
            q(x)
    assert str(e.value) == (
        "a colwise layer with uneven heads (Linear of 112 output features) was handed a "
        "DTensor (a DTensor region or a sequence-parallel input); its heads split unevenly "
        "have no DTensor layout. Drop uneven from its rule, or the region or sequence "
        "parallelism."
    )


def test_fused_unequal_pieces_of_heads_tp_does_not_divide_split_unevenly() -> None:
    """Phi-3's fused q|k|v of grouped heads (14 query, 2 key/value) at tp 4: each rank its
    query heads and its shared key/value head of the fused rows, the cut sizes from the
    config each rank's own. Simulated ranks cannot hold a per-rank value in transformers'
    config (it takes ints only): applying there says so and names real ranks, which run it
    (test_processes.py)."""
    model = phi3(14, 2)
    plan = tpplan.infer_plan(model, tp_size=4, example_inputs=IDS)
    qkv = next(r for r in plan.rules if r.match.endswith("qkv_proj"))
    assert (qkv.parts, qkv.head_dim, qkv.uneven, qkv.group) == ([112, 16, 16], 8, True, 7)
    divided = {a.divide[0]: (a.by, a.uneven) for a in plan.attributes}
    assert divided == {
        "config.num_attention_heads": (None, "qkv_proj"),
        "num_key_value_heads": ("shards", "qkv_proj"),
        "num_key_value_groups": ("replicas", "qkv_proj"),
    }
    assert not tpplan.check_plan(plan, model, tp_size=4)
    with simulated_ranks(4) as mesh, pytest.raises(TpplanError) as e:
        tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
    assert str(e.value).endswith(
        "takes ints only. Run it on real ranks (torchrun; tpplan verify --processes)."
    )


def test_verify_compares_each_ranks_own_heads() -> None:
    """`tpplan verify` (simulated ranks) compares a layer of uneven heads by the rank's own
    heads' rows of the unsharded output, forward and backward."""
    from tpplan.diagnose.verify import verify_plan

    model = qwen2(14, 2)
    plan = tpplan.infer_plan(model, tp_size=4, example_inputs=IDS)
    report = verify_plan(model, plan, tp_size=4, backward=True, inputs={"input_ids": IDS})
    assert report.ok, report.rows
    assert ("model.layers.*.self_attn.q_proj", "output") in report.rows


@pytest.mark.slow
def test_verify_on_real_ranks_where_simulated_ones_cannot_run_it() -> None:
    """5 heads of their own at tp 2 (ranks of 3 and 2 key/value heads): `tpplan verify
    --processes` runs it on real gloo ranks, forward and backward."""
    from tpplan.diagnose.verify import verify_in_processes

    overrides = {
        "vocab_size": VOCAB,
        "hidden_size": 40,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 5,
        "num_key_value_heads": 5,
        "head_dim": HEAD_DIM,
    }
    from tpplan._runtime.models import build_model

    model = build_model("qwen2", overrides, device="cpu")
    plan = tpplan.infer_plan(model, tp_size=2)
    assert any(r.uneven_group() for r in plan.rules), plan.to_yaml()
    report = verify_in_processes("qwen2", overrides, plan, tp_size=2, backward=True)
    assert report.ok, report.rows


def test_verify_on_simulated_ranks_names_real_ranks_where_it_cannot_run() -> None:
    """Ranks of 4, 2 and 2 query heads (8 in 4 groups at tp 3): one process cannot decide
    each rank's views in the backward; verify says so and names the command that can."""
    from tpplan.diagnose.verify import verify_plan

    model = qwen2(8, 4)
    plan = tpplan.infer_plan(model, tp_size=3, example_inputs=IDS)
    with pytest.raises(TpplanError) as e:
        verify_plan(model, plan, tp_size=3, backward=True, inputs={"input_ids": IDS})
    assert str(e.value).startswith("simulated ranks could not run this plan's heads split")
    assert str(e.value).endswith("Verify it on real ranks: tpplan verify --processes.")


def test_sequence_parallel_keeps_heads_tp_does_not_divide_as_before() -> None:
    """Sequence parallel hands the attention's layers DTensors, which heads split unevenly
    cannot take: they stay split then gathered, the reason saying why, with parity."""
    model = qwen2(14, 2)
    plan = tpplan.infer_plan(model, tp_size=4, example_inputs=IDS, sequence_parallel=True)
    q = next(r for r in plan.rules if r.match.endswith("q_proj"))
    assert q.output_layout() == "replicate" and q.uneven_group() is None
    assert "sequence parallel hands its layers DTensors" in q.why, q.why
    assert_parity(model, plan, 4, IDS)


def test_lora_adapters_keep_heads_tp_does_not_divide_as_before() -> None:
    """peft LoRA wrappers on the attention's layers: heads split unevenly take plain layers
    only, so the attention stays split then gathered, its reason saying why, with parity."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(qwen2(14, 2), LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    plan = tpplan.infer_plan(model, tp_size=4, example_inputs=IDS)
    assert not any(r.uneven_group() for r in plan.rules)
    q = next(r for r in plan.rules if r.match.endswith("q_proj.base_layer"))
    assert "a LoRA adapter wraps one of its layers" in q.why, q.why
    assert_parity(model, plan, 4, IDS)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"head_dim": 5},
            "a colwise layer with uneven heads (Linear of 112 output features) needs whole "
            "heads on local shards, and they are no whole number of heads of head_dim 5. Fix "
            "the rule's head_dim, or drop uneven and keep the layer whole.",
        ),
        (
            {"head_dim": 8, "embedding": 1},
            "a colwise layer with uneven heads (Embedding of 112 output features) needs whole "
            "heads on local shards, and it cannot run on its local shards: an embedding's "
            "lookup takes no rows of its own. Fix the rule's head_dim, or drop uneven and "
            "keep the layer whole.",
        ),
    ],
)
def test_a_hand_rule_of_uneven_heads_that_cannot_run_is_refused_by_name(
    fields: dict[str, int], message: str
) -> None:
    from tpplan.compile.linear import Colwise

    model = qwen2(14, 2)
    layer = copy.deepcopy(model.model.layers[0].self_attn.q_proj)
    if fields.get("embedding"):
        layer = torch.nn.Embedding(10, 14 * HEAD_DIM)
    with simulated_ranks(4) as mesh, pytest.raises(TpplanError) as e:
        Colwise(uneven_heads=(fields["head_dim"], 7))._apply(layer, mesh)
    assert str(e.value) == message


def test_fused_heads_of_three_pieces_side_by_side_split_unevenly() -> None:
    """GPT-NeoX's query_key_value views its output as heads of q, k and v side by side
    (heads of 3 x 8 features) and dense contracts heads of 8: 5 heads at tp 2 split 3 and 2,
    each layer by its own head size, with parity."""
    model = gpt_neox(5)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=IDS)
    rules = {r.match.rpartition(".")[2]: r for r in plan.rules if ".attention." in r.match}
    assert (rules["query_key_value"].head_dim, rules["query_key_value"].uneven) == (24, True)
    assert (rules["dense"].head_dim, rules["dense"].uneven) == (8, True)
    assert not tpplan.check_plan(plan, model, tp_size=2)
    assert_parity(model, plan, 2, IDS)


def test_fused_equal_pieces_of_heads_tp_does_not_divide_split_unevenly() -> None:
    """GPT-2's c_attn (q|k|v of 5 heads each, fused, stored (in, out)) at tp 2: each rank
    its own heads of every piece (3 and 2), split_size each rank's own, with parity; the
    weight a plain shard of the original (not the pieces' strided layout)."""
    model = gpt2(5)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=IDS)
    c_attn = next(r for r in plan.rules if r.match.endswith("c_attn"))
    assert (c_attn.parts, c_attn.head_dim, c_attn.uneven) == ([40, 40, 40], 8, True)
    assert [a.uneven for a in plan.attributes] == ["c_attn"]
    assert not tpplan.check_plan(plan, model, tp_size=2)
    assert_parity(model, plan, 2, IDS)
