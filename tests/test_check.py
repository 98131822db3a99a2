"""check_plan: each kind of problem, with its message, on models built on the meta device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.check import TwoInputs
from support.infer_models import opt
from support.models import tiny_llama
from support.unrunnable import CASES, unrunnable

from tpplan import Plan, Problem, Rule, check_plan, infer_plan, load_plan
from tpplan._runtime.facts import fingerprint, parameter_shapes
from tpplan.check import splits_nothing
from tpplan.plan import ModelInfo

LLAMA_PLAN = Path(__file__).parent / "plans" / "llama.yaml"


@pytest.fixture(scope="module")
def llama():  # type: ignore[no-untyped-def]
    return tiny_llama(device="meta")


def _edit(plan: Plan, **changes: object) -> Plan:
    return plan.model_copy(update=changes)


def _rules(plan: Plan, drop: set[str] = frozenset(), **replace: dict) -> Plan:  # type: ignore[assignment]
    rules = []
    for r in plan.rules:
        if r.match in drop:
            continue
        rules.append(r.model_copy(update=replace.get(r.match, {})))
    return _edit(plan, rules=rules)


def _only(problems: list[Problem], kind: str) -> Problem:
    hits = [p for p in problems if p.kind == kind]
    assert len(hits) == 1, problems
    return hits[0]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_hand_written_plan_is_sound(llama, tp: int) -> None:  # type: ignore[no-untyped-def]
    assert check_plan(load_plan(LLAMA_PLAN), llama, tp_size=tp) == []


def test_a_pattern_matching_nothing_suggests_the_nearest(llama) -> None:  # type: ignore[no-untyped-def]
    plan = Plan.from_yaml(
        "tpplan: 1\nrules:\n  - {match: model.layers.*.self_attn.q_prj, style: colwise, why: x}\n"
        "  - {match: model.layers.*.self_attn.o_proj, style: rowwise, why: x}\n"
    )
    p = _only(check_plan(plan, llama, tp_size=2), "no_match")
    assert p.rule == "rules[0] (match: model.layers.*.self_attn.q_prj)"
    assert "Did you mean 'model.layers.*.self_attn.q_proj'?" in str(p)


def test_a_module_matched_twice(llama) -> None:  # type: ignore[no-untyped-def]
    plan = load_plan(LLAMA_PLAN)
    extra = plan.rules[1].model_copy(update={"match": "model.layers.0.self_attn.q_proj"})
    p = _only(check_plan(_edit(plan, rules=[*plan.rules, extra]), llama, tp_size=2), "overlap")
    assert p.module == "model.layers.0.self_attn.q_proj" and "also matched by rules[1]" in p.message


def test_a_style_on_the_wrong_module_type(llama) -> None:  # type: ignore[no-untyped-def]
    plan = Plan.from_yaml(
        "tpplan: 1\nrules:\n  - {match: model.layers.*.input_layernorm, style: vocab_parallel, why: x}\n"
    )
    p = _only(check_plan(plan, llama, tp_size=2), "module_type")
    assert "applies to nn.Embedding, not to LlamaRMSNorm" in p.message
    assert p.module == "model.layers.*.input_layernorm"  # one problem for all layers


def test_features_that_do_not_divide(llama) -> None:  # type: ignore[no-untyped-def]
    problems = check_plan(load_plan(LLAMA_PLAN), llama, tp_size=5)
    gate = next(p for p in problems if p.module == "model.layers.*.mlp.gate_proj")
    assert gate.message == "out_features = 96 does not divide by tp size 5."
    assert (
        gate.fix
        == "use a tp size among 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, or keep this module replicated."
    )
    embed = next(p for p in problems if p.module == "model.embed_tokens")
    assert embed.message == "num_embeddings (the vocab) = 128 does not divide by tp size 5."


def test_heads_that_do_not_divide_list_the_legal_sizes() -> None:
    model = tiny_llama(hidden=64, heads=8, kv_heads=4, device="meta")
    problems = check_plan(load_plan(LLAMA_PLAN), model, tp_size=8)
    k = next(p for p in problems if p.module == "model.layers.*.self_attn.k_proj")
    assert k.kind == "divisibility"
    assert "4 heads (of head_dim 8) do not split evenly over tp size 8" in k.message
    assert "use a tp size among 1, 2, 4," in k.fix
    # 4 key/value heads for 8 query heads: sharing them would serve tp 8, and the fix says so
    assert "add replicate_heads: true to the rule: each goes whole to the tp/4 ranks" in k.fix
    # the 8 query heads divide by 8 on their own
    assert not [p for p in problems if p.module == "model.layers.*.self_attn.q_proj"]


def test_a_region_left_open(llama) -> None:  # type: ignore[no-untyped-def]
    plan = _rules(load_plan(LLAMA_PLAN), drop={"model.layers.*.mlp.down_proj"})
    problems = [p for p in check_plan(plan, llama, tp_size=2) if p.kind == "unclosed_region"]
    assert {p.module for p in problems} == {
        "model.layers.*.mlp.gate_proj",
        "model.layers.*.mlp.up_proj",
    }
    assert problems[0].message.startswith(
        "its output is contracted by model.layers.*.mlp.down_proj,"
    )


def test_a_region_never_opened(llama) -> None:  # type: ignore[no-untyped-def]
    plan = _rules(
        load_plan(LLAMA_PLAN), drop={"model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj"}
    )
    p = _only(check_plan(plan, llama, tp_size=2), "unopened_region")
    assert p.module == "model.layers.*.mlp.down_proj" and "`input: replicate`" in p.fix


def test_a_gathered_output_opens_no_region(llama) -> None:  # type: ignore[no-untyped-def]
    plan = _rules(load_plan(LLAMA_PLAN), **{"lm_head": {"output": None}})
    p = _only(check_plan(plan, llama, tp_size=2), "unclosed_region")
    assert p.module == "lm_head"
    loss_parallel = _edit(plan, options=plan.options.model_copy(update={"loss_parallel": True}))
    assert check_plan(loss_parallel, llama, tp_size=2) == []


def test_attribute_fixes_are_checked(llama) -> None:  # type: ignore[no-untyped-def]
    plan = Plan.from_yaml(
        "tpplan: 1\nattributes:\n"
        "  - {match: model.layers.*.self_attn, divide: [num_key_value_groups, nope], why: x}\n"
        "  - {match: model.layerz.*, divide: [a], why: x}\n"
    )
    problems = check_plan(plan, llama, tp_size=4)
    assert any("has no integer attribute 'nope'" in p.message for p in problems)
    assert any(
        p.kind == "divisibility" and "num_key_value_groups = 2" in p.message for p in problems
    )
    assert any(p.kind == "no_match" and p.rule.startswith("attributes[1]") for p in problems)


def test_a_plan_for_another_model_says_what_differs(llama) -> None:  # type: ignore[no-untyped-def]
    other = tiny_llama(layers=3, vocab=256, device="meta")
    info = ModelInfo(
        class_="LlamaForCausalLM",
        fingerprint=fingerprint(other),
        parameters=parameter_shapes(other),
    )
    p = _only(check_plan(_edit(load_plan(LLAMA_PLAN), model=info), llama, tp_size=2), "fingerprint")
    assert "written for another model" in p.message
    assert "lm_head.weight was (256, 64), is (128, 64)" in p.message
    assert "model.layers.*.mlp.up_proj.weight was (96, 64) x3, is (96, 64) x2" in p.message
    assert "delete model.fingerprint" in p.fix


def test_a_matching_fingerprint_passes(llama) -> None:  # type: ignore[no-untyped-def]
    info = ModelInfo(class_="LlamaForCausalLM", fingerprint=fingerprint(llama))
    assert check_plan(_edit(load_plan(LLAMA_PLAN), model=info), llama, tp_size=2) == []


def test_tp_size_must_be_positive(llama) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="tp_size must be a positive integer, got 0"):
        check_plan(load_plan(LLAMA_PLAN), llama, tp_size=0)


def test_a_region_that_spans_sibling_modules_is_closed() -> None:
    """BERT opens attention in attention.self.query and closes it in attention.output.dense:
    different parents, one region; the trace sees the data flow join them."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
    )
    model = BertModel(cfg, add_pooling_layer=False)
    plan = Plan.from_yaml(
        "tpplan: 1\nrules:\n"
        "  - {match: 'encoder.layer.*.attention.self.[qkv]*', style: colwise, why: q k v, head_dim: 16}\n"
        "  - {match: encoder.layer.*.attention.output.dense, style: rowwise, why: closes, head_dim: 16}\n"
    )
    assert check_plan(plan, model, tp_size=2) == []
    half = plan.model_copy(update={"rules": plan.rules[:1]})
    p = _only(check_plan(half, model, tp_size=2), "unclosed_region")
    assert "contracted by encoder.layer.*.attention.output.dense" in p.message


def test_an_untraceable_model_gets_the_structural_check() -> None:
    from support.models import HeadNormBlock

    class TwoInputs(HeadNormBlock):  # two inputs: none can be made up, so no trace
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * scale

    plan = Plan.from_yaml("tpplan: 1\nrules:\n  - {match: fc1, style: colwise, why: opens}\n")
    p = _only(check_plan(plan, TwoInputs(), tp_size=2), "unclosed_region")
    assert "no rowwise module under the model (top level)" in p.message


def _sink_plan(shard: dict[str, int]) -> Plan:
    from tpplan import Rule

    return Plan(rules=[Rule(match="z", style="split_params", shard=shard, why="its sinks")])


def test_split_params_naming_a_parameter_the_module_lacks() -> None:
    from support.infer_models import SinkBlock

    p = _only(check_plan(_sink_plan({"sinks": 0}), SinkBlock(), tp_size=2), "module_type")
    assert p.message == (
        "split_params names sinks, which SinkAttention does not hold (its parameters: s (4,))."
    )
    assert p.fix == "name the module's own parameters (not its children's) in shard."


def test_split_params_whose_size_the_tp_size_does_not_divide() -> None:
    from support.infer_models import SinkBlock

    p = _only(check_plan(_sink_plan({"s": 0}), SinkBlock(), tp_size=8), "divisibility")
    assert "s dim 0" in p.message and "1, 2, 4" in p.fix


def test_a_head_dim_smaller_than_the_models_heads_is_caught_by_the_trace() -> None:
    """A plan stating head_dim 4 for heads 8 wide passes its own divisibility check at tp 4
    (16 k/v features are 4 "heads" of 4), but would give each rank half a k/v head, found
    mid-forward. The trace sees the model view k_proj's output as 2 heads of 8."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tpplan import infer_plan

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    # the plan without key/value heads shared past their count (which would serve tp 4)
    data = infer_plan(model).to_data()
    data.pop("attributes")
    for rule in data["rules"]:
        rule.pop("replicate_heads", None)
    wrong = Plan.from_yaml(Plan.from_data(data).to_yaml().replace("head_dim: 8", "head_dim: 4"))
    # 2 divides every count: only the wrong head_dim itself is a problem at tp 2
    assert {p.kind for p in check_plan(wrong, model, tp_size=2)} == {"head_dim"}
    # at tp 4, the wrong head_dim once, and what holds with the model's: 2 heads of 8 do not
    # split over 4 ranks (not again as 4 "heads" of 4)
    problems = [p for p in check_plan(wrong, model, tp_size=4) if p.module.endswith("k_proj")]
    assert [p.kind for p in problems] == ["divisibility", "head_dim"]
    assert problems[0].message == (
        "2 heads (of head_dim 8) do not split evenly over tp size 4; every rank must hold "
        "whole heads."
    )
    assert problems[0].fix == (
        "use a tp size among 1, 2, or keep this module replicated; or, as its 2 heads are "
        "key/value heads the query heads share, add replicate_heads: true to the rule: each "
        "goes whole to the tp/2 ranks holding its query heads (`tpplan infer` writes it)."
    )


def test_a_head_dim_other_than_the_models_names_both() -> None:
    """The llama plan as completed for Llama-3-8B states head_dim 128; a Llama whose heads
    are 64 wide passes the rule's own check at tp 2 (2048 features are 16 whole "heads" of
    128, and 16 divides by 2), so only the trace can tell that the plan was written for
    other heads."""
    from tpplan._runtime.models import build_model
    from tpplan.check import complete_plan

    eight_b = build_model("llama", overrides={"num_hidden_layers": 1})
    stated, _ = complete_plan(load_plan("llama"), eight_b, tp_size=2)
    model = build_model("llama", overrides={"head_dim": 64, "num_hidden_layers": 2})
    problems = check_plan(stated, model, tp_size=2)
    assert {p.kind for p in problems} == {"head_dim"}
    q = next(p for p in problems if p.module == "model.layers.*.self_attn.q_proj")
    assert str(q) == (
        "rules[1] (match: model.layers.*.self_attn.q_proj), module "
        "model.layers.*.self_attn.q_proj: the rule states head_dim 128, but the model's "
        "head_dim is 64 (it views its 2048 output features as 32 heads of 64). Fix: set "
        "head_dim: 64 in the rule, or infer the plan again for this model (`tpplan infer`)."
    )
    o = next(p for p in problems if p.module == "model.layers.*.self_attn.o_proj")
    assert "(its 2048 input features arrive as 32 heads of 64)" in o.message


def test_the_structural_check_looks_past_wrappers() -> None:
    model = TwoInputs()
    plan = Plan.from_yaml(
        "tpplan: 1\nrules:\n"
        "  - {match: mlp.up.linear, style: colwise, why: opens}\n"
        "  - {match: mlp.down.linear, style: rowwise, why: closes}\n"
    )
    assert check_plan(plan, model, tp_size=2) == []
    half = plan.model_copy(update={"rules": plan.rules[:1]})
    p = _only(check_plan(half, model, tp_size=2), "unclosed_region")
    assert "no rowwise module under mlp takes it back" in p.message


def test_fused_parts_other_than_the_models_name_both() -> None:
    """Parts that add up to the width pass the rule's own check however they cut it; GPT-2's
    c_attn cut as 512 | 1024 | 768 would hand each rank the wrong slices of q, k and v (its
    forward differs from the unsharded one by ~1.6 at tp 2)."""
    from tpplan._runtime.models import build_model

    model = build_model("gpt2", overrides={"n_layer": 2})
    shipped = load_plan("gpt2")  # leaves the parts to the model
    c_attn = shipped.rules[2].model_dump(exclude_unset=True) | {"parts": [512, 1024, 768]}
    wrong = shipped.model_copy(
        update={"rules": [*shipped.rules[:2], Rule.model_validate(c_attn), *shipped.rules[3:]]}
    )
    p = _only(check_plan(wrong, model, tp_size=2), "parts")
    assert str(p) == (
        "rules[2] (match: transformer.h.*.attn.c_attn), module transformer.h.*.attn.c_attn: "
        "the rule states parts [512, 1024, 768], but the model cuts its 2304 output features "
        "into the pieces [768, 768, 768]. Fix: set parts: [768, 768, 768] in the rule, or "
        "infer the plan again for this model (`tpplan infer`)."
    )


@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v.static is not None])
def test_a_plan_that_cannot_run_gets_one_static_problem(llama, case: str) -> None:  # type: ignore[no-untyped-def]
    """colwise or sequence_parallel on the token embedding, head_dim divided: each named by
    its static check, with the fix, and not told again by the dry run."""
    want = CASES[case]
    (p,) = check_plan(unrunnable(case), llama, tp_size=2)
    assert p.rule == want.rule and p.kind != "dry_run"
    assert want.static is not None and want.static in p.message
    assert want.fix in p.fix


def test_an_embedding_split_by_columns_and_gathered_is_sound(llama) -> None:  # type: ignore[no-untyped-def]
    plan = Plan.from_yaml(
        CASES["colwise_embedding"].edit.replace(
            "    style: colwise\n", "    style: colwise\n    output: replicate\n", 1
        )
    )
    assert check_plan(plan, llama, tp_size=2) == []


def test_a_count_the_views_read_may_be_divided() -> None:
    """OPT views by its stored num_heads: the attribute its inferred plan divides passes."""
    model = opt()
    plan = infer_plan(model, tp_size=2)
    assert [a.divide for a in plan.attributes] == [["num_heads"]]
    assert check_plan(plan, model, tp_size=2) == []


def test_a_plan_that_does_not_run_names_the_rule_and_where_torch_raised(llama) -> None:  # type: ignore[no-untyped-def]
    """A mistake no static check knows (a sequence-parallel boundary in a plan that is not
    sequence-parallel) is found by running the plan on a meta copy over fake ranks."""
    want = CASES["prepare_in_the_wrong_place"]
    (p,) = check_plan(unrunnable("prepare_in_the_wrong_place"), llama, tp_size=2)
    assert p.kind == "dry_run" and p.rule == want.rule and p.module == "model.layers.0.mlp"
    assert p.message.startswith("a forward on a copy sharded over 2 fake ranks")
    assert want.ran in p.message and want.fix in p.fix


def test_the_last_of_many_identical_blocks_is_run_when_its_rules_differ() -> None:
    """Long stacks of identical blocks are run through their first blocks only, unless the
    plan treats a later one otherwise: a mistake in block 9 of 10 is found."""
    model = tiny_llama(layers=10, device="meta")
    plan = Plan.from_yaml(
        CASES["prepare_in_the_wrong_place"].edit.replace(
            "match: model.layers.*.mlp,", "match: model.layers.9.mlp,"
        )
    )
    (p,) = check_plan(plan, model, tp_size=2)
    assert p.kind == "dry_run" and p.module == "model.layers.9.mlp"
    assert check_plan(load_plan(LLAMA_PLAN), model, tp_size=2) == []


def test_checking_leaves_no_process_group_and_the_model_whole(llama) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.tensor import DTensor, _random

    before = {n: id(p) for n, p in llama.named_parameters()}
    assert check_plan(unrunnable("prepare_in_the_wrong_place"), llama, tp_size=2)
    assert not torch.distributed.is_initialized() and _random._rng_tracker is None
    assert {n: id(p) for n, p in llama.named_parameters()} == before
    assert not any(isinstance(p, DTensor) for p in llama.parameters())


def test_a_plan_that_splits_nothing_is_sound(llama) -> None:  # type: ignore[no-untyped-def]
    empty = Plan.from_yaml("tpplan: 7\nrules: []\n")
    whole = Plan.from_yaml("tpplan: 7\nrules:\n  - {match: lm_head, style: replicate, why: x}\n")
    assert check_plan(empty, llama, tp_size=2) == [] and splits_nothing(empty)
    assert check_plan(whole, llama, tp_size=2) == [] and splits_nothing(whole)
    assert not splits_nothing(load_plan(LLAMA_PLAN))


# issue 33's models: on fake tensors torch's gather of their fused colwise output reads values
ISSUE_33 = {
    "diffllama": {
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
    },
    "mamba": {"num_hidden_layers": 1, "hidden_size": 64, "vocab_size": 128},
}


@pytest.mark.parametrize("spec", list(ISSUE_33))
def test_check_does_not_refuse_the_plan_infer_wrote(spec: str) -> None:
    """What `tpplan infer` then `tpplan check` do: the model on the meta device, tp 2."""
    import warnings

    from tpplan._runtime.models import build_model
    from tpplan.errors import DryRunSkipped

    model = build_model(spec, ISSUE_33[spec])
    plan = infer_plan(model, tp_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DryRunSkipped)
        assert check_plan(plan, model, tp_size=2) == []
