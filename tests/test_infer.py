"""infer_plan: plans inferred from data flow, checked against hand-written plans (ours and the
ones transformers ships) and against the unsharded model's numbers on simulated ranks."""

from __future__ import annotations

import copy
import time
import types

import pytest
import torch
import torch.nn.functional as F
from support.infer_models import (
    ODD_NAMES,
    PLAIN_NAMES,
    ROLES,
    GatedBlock,
    Mlp,
    NormedMlp,
    PiecesThenHeads,
    SinkAttention,
    SinkBlock,
    WidthFromShard,
    albert,
    bart,
    block,
    deepseek_v3,
    falcon,
    fused_gqa,
    gemma3,
    gpt2,
    gpt_neox,
    gpt_oss,
    llama_gqa,
    llama_mha,
    opt,
    phi3,
    qwen2,
    qwen3,
    t5,
    whisper,
)
from support.models import Vit, seeded, tiny_llama, token_batch
from support.parity import assert_parity
from support.plans import rule_for, styles
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import tpplan
import tpplan._runtime.inputs
from tpplan._runtime.local import simulated_ranks
from tpplan._runtime.models import build_model
from tpplan.diagnose.verify import verify_plan
from tpplan.plan import Plan, load_plan
from tpplan.plan.patterns import match_names

HF_FAMILIES = {"llama_mha": llama_mha, "llama_gqa": llama_gqa, "qwen2": qwen2, "qwen3": qwen3}


# ---- oracles --------------------------------------------------------------------------------
def test_llama_plan_equals_the_hand_written_one() -> None:
    model = tiny_llama()
    inferred = tpplan.infer_plan(model)
    written = load_plan("tests/plans/llama.yaml")
    assert styles(inferred, model) == styles(written, model)
    for name in styles(written, model):
        assert (
            rule_for(inferred, model, name).head_size()
            == rule_for(written, model, name).head_size()
        ), name


_HF_STYLES = {
    "colwise": ("colwise", None),
    "rowwise": ("rowwise", None),
    "colwise_gather_output": ("colwise", "replicate"),
    "replicated_with_grad_allreduce": ("replicate_grad_sum", None),
}


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_hf_plans_match_transformers_own(family: str) -> None:
    """transformers' hand-written plans (read here as oracles only) shard the same modules."""
    model = HF_FAMILIES[family]()
    names = [n for n, _ in model.named_modules() if n]
    oracle: dict[str, tuple[str, str | None]] = {}
    base = model.base_model_prefix
    for pattern, style in type(model.config).base_model_tp_plan.items():
        for n in match_names(f"{base}.{pattern}", names):
            oracle[n] = _HF_STYLES[style]
    for pattern, style in type(model)._tp_plan.items():
        for n in match_names(pattern, names):
            oracle[n] = _HF_STYLES[style]
    ours = styles(tpplan.infer_plan(model), model)
    assert {n: ours.get(n) for n in oracle} == oracle
    # The one module we shard beyond theirs is the token embedding (vocab-parallel).
    assert {n: s for n, s in ours.items() if n not in oracle} == {
        "model.embed_tokens": ("vocab_parallel", None)
    }


# ---- numeric parity ---------------------------------------------------------------------------
def _tokens() -> torch.Tensor:
    return token_batch(batch=2, seq=8)


PARITY = [
    ("llama_mha", 2), ("llama_mha", 4), ("llama_gqa", 2), ("llama_gqa", 4),
    ("qwen2", 2), ("qwen2", 4), ("qwen3", 2), ("qwen3", 4),
]  # fmt: skip


@pytest.mark.parametrize(("family", "tp"), PARITY)
def test_hf_plans_keep_the_numbers(family: str, tp: int) -> None:
    model = HF_FAMILIES[family]()
    assert_parity(model, tpplan.infer_plan(model), tp, _tokens())


@pytest.mark.parametrize("tp", [2, 4])
def test_stored_head_count_is_divided(tp: int) -> None:
    """OPT views with `self.num_heads` and -1 for the sequence: the plan divides num_heads."""
    model = opt()
    plan = tpplan.infer_plan(model)
    (attr,) = plan.attributes
    assert attr.match == "model.decoder.layers.*.self_attn"
    assert attr.divide == ["num_heads"]
    assert styles(plan, model)["model.decoder.layers.0.self_attn.q_proj"] == ("colwise", None)
    assert_parity(model, plan, tp, _tokens())


@pytest.mark.parametrize("tp", [2, 4])
def test_tied_embeddings_are_split_alike_and_stay_tied(tp: int) -> None:
    """OPT ties its token embedding to its head: both split the vocab rows of one weight."""
    model = opt()
    plan = tpplan.infer_plan(model)
    assert styles(plan, model)["model.decoder.embed_tokens"] == ("vocab_parallel", None)
    assert styles(plan, model)["lm_head"] == ("colwise", "replicate")
    assert "tied with lm_head" in rule_for(plan, model, "model.decoder.embed_tokens").why
    assert_parity(model, plan, tp, _tokens())
    with simulated_ranks(tp) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
        assert sharded.lm_head.weight is sharded.model.decoder.embed_tokens.weight


def test_tied_weights_split_differently_are_refused() -> None:
    model = opt()
    plan = tpplan.infer_plan(model)
    rules = [
        tpplan.Rule(match=r.match, style="replicate", why=r.why) if r.match == "lm_head" else r
        for r in plan.rules
    ]
    problems = tpplan.check_plan(plan.model_copy(update={"rules": rules}), model, tp_size=2)
    (tied,) = [p for p in problems if p.kind == "tied"]
    assert tied.module == "model.decoder.embed_tokens"
    assert "lm_head.weight: whole" in tied.message and "embed_tokens.weight: dim 0" in tied.message
    assert "splits it the same way" in tied.fix


# ---- fused layers, Conv1D -------------------------------------------------------------------
@pytest.mark.parametrize(("tp", "tied"), [(2, True), (4, True), (2, False)])
def test_gpt2_conv1d_and_fused_qkv(tp: int, tied: bool) -> None:
    """Conv1D stores its weight (in, out): found by its ops, split on the other dim; c_attn's
    q|k|v are split piece by piece, and the split size the model reads is divided."""
    model = gpt2(tied=tied)
    plan = tpplan.infer_plan(model)
    c_attn = rule_for(plan, model, "transformer.h.0.attn.c_attn")
    assert (c_attn.style, c_attn.parts, c_attn.transposed, c_attn.head_dim) == (
        "colwise", [64, 64, 64], True, 8,
    )  # fmt: skip
    for name, style in [
        ("attn.c_proj", "rowwise"),
        ("mlp.c_fc", "colwise"),
        ("mlp.c_proj", "rowwise"),
    ]:
        rule = rule_for(plan, model, f"transformer.h.0.{name}")
        assert (rule.style, rule.transposed, rule.parts) == (style, True, None)
    (attr,) = plan.attributes
    assert (attr.match, attr.divide) == ("transformer.h.*.attn", ["split_size"])
    assert_parity(model, plan, tp, _tokens())


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_pieces_of_unequal_size(tp: int) -> None:
    """q|k|v of 64|32|32 (grouped-query): each rank gets its own query and key/value heads;
    past the 4 key/value heads (tp 8) each goes whole to the 2 ranks of its query heads, so
    the plan serves every tp up to the 8 query heads."""
    model = fused_gqa()
    plan = tpplan.infer_plan(model, example_inputs=_tokens())
    rule = rule_for(plan, model, "attn.qkv")
    assert (rule.style, rule.parts, rule.head_dim) == ("colwise", [64, 32, 32], 8)
    assert rule.replicate_heads
    assert [(a.divide, a.by) for a in plan.attributes] == [
        (["q_size"], None),
        (["kv_size"], "shards"),
    ]
    assert not tpplan.check_plan(plan, model, tp_size=8)
    assert tpplan.check_plan(plan, model, tp_size=16)  # 8 query heads do not split 16 ways
    assert_parity(model, plan, tp, _tokens())


def test_fused_cut_at_literal_sizes_is_a_region() -> None:
    """Sizes written as numbers cannot become per-rank sizes a plan divides: the attention
    is a DTensor region instead, the fused layer opening it in the pieces its code cuts
    (held as such, compile/region_pieces.py); it was split then gathered before."""
    model = fused_gqa(literal_sizes=True)
    plan = tpplan.infer_plan(model, example_inputs=_tokens())
    rule = rule_for(plan, model, "attn.qkv")
    assert (rule.style, rule.output, rule.parts, rule.local_output) == (
        "colwise", None, [64, 32, 32], False,
    )  # fmt: skip
    assert [r.match for r in plan.regions] == ["attn"], plan.to_yaml()
    assert_parity(model, plan, 2, _tokens())


def test_phi3_gate_up_by_chunk_and_sliced_qkv() -> None:
    """gate_up_proj is cut by chunk(2): equal pieces, no size to divide. qkv_proj is cut by
    slices at positions computed from the config (`self.config.num_attention_heads *
    self.head_dim`): the head count is divided on the attention's own copy of the config,
    and q|k|v splits as each rank's slice of each piece, where transformers' own plan
    gathers it."""
    model = phi3()
    plan = tpplan.infer_plan(model)
    gate_up = rule_for(plan, model, "model.layers.0.mlp.gate_up_proj")
    assert (gate_up.style, gate_up.parts) == ("colwise", [96, 96])
    assert rule_for(plan, model, "model.layers.0.mlp.down_proj").style == "rowwise"
    qkv = rule_for(plan, model, "model.layers.0.self_attn.qkv_proj")
    assert (qkv.style, qkv.output_layout()) == ("colwise", "shard(-1)")
    assert rule_for(plan, model, "model.layers.0.self_attn.o_proj").style == "rowwise"
    divided = {a for attr in plan.attributes for a in attr.divide}
    assert "config.num_attention_heads" in divided and "head_dim" not in divided
    assert_parity(model, plan, 2, _tokens())


def test_gpt_neox_interleaved_qkv_with_computed_inner_size() -> None:
    """GPT-NeoX views query_key_value as (heads, 3 * self.head_size): each head's q, k and v
    side by side. A small multiple of an attribute read in forward is as fixed as the
    attribute, so the heads split whole (each rank its heads' q, k and v) and dense closes."""
    model = gpt_neox()
    plan = tpplan.infer_plan(model)
    qkv = rule_for(plan, model, "gpt_neox.layers.0.attention.query_key_value")
    assert (qkv.style, qkv.output, qkv.head_dim) == ("colwise", None, 3 * 16)
    assert "3 fused pieces of 16" in qkv.why
    dense = rule_for(plan, model, "gpt_neox.layers.0.attention.dense")
    assert (dense.style, dense.head_dim) == ("rowwise", 16)
    for tp in (2, 4):
        assert_parity(model, plan, tp, _tokens())


def test_inner_size_from_the_split_width_ends_the_split() -> None:
    """The same view with its inner size computed from the fused output's own width: equal
    to 3 * head_dim on the whole tensor, wrong on a shard. The split ends there."""
    model = WidthFromShard()
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    qkv = rule_for(plan, model, "qkv")
    assert qkv.output == "replicate" or qkv.style == "replicate"
    assert "beside the split dim" in qkv.why
    assert_parity(model, plan, 2, x)


def test_gemma3_qk_norms_stay_inside_the_region() -> None:
    """Gemma 3's q/k norms ask their weight for its device: a query, not a use outside the
    region. The attention splits, the norms' gradients are summed over the tp axis."""
    model = gemma3()
    plan = tpplan.infer_plan(model)
    assert rule_for(plan, model, "model.layers.0.self_attn.q_proj").style == "colwise"
    assert rule_for(plan, model, "model.layers.0.self_attn.o_proj").style == "rowwise"
    norm = rule_for(plan, model, "model.layers.0.self_attn.q_norm")
    assert norm.style == "replicate_grad_sum"
    assert_parity(model, plan, 2, _tokens())


@pytest.mark.parametrize("tp", [2, 4])
def test_a_per_head_sink_is_split_with_the_heads(tp: int) -> None:
    """A 1-D parameter with one entry per head, met element by element by the split heads
    (`lse - sink.view(1, -1, 1)`): each rank holds its own heads' entries (split_params),
    so the attention splits; forward and every gradient match the unsharded model."""
    model = SinkBlock()
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    rule = rule_for(plan, model, "z")
    assert (rule.style, rule.shard) == ("split_params", {"s": 0})
    assert styles(plan, model)["z.a"] == ("colwise", None)
    assert styles(plan, model)["z.d"] == ("rowwise", None)
    assert_parity(model, plan, tp, x)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_sink_also_used_whole_makes_the_attention_a_dtensor_region(tp: int) -> None:
    """The sink is used per head and whole (`s.mean()`), so it cannot be split: the attention
    runs as a DTensor region instead, the sink a replicated DTensor each rank slices to its
    heads. No rule splits the sink; forward and every gradient match the unsharded model."""
    model = SinkBlock(also_whole=True)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    assert not any(r.style == "split_params" for r in plan.rules)
    assert [r.match for r in plan.regions] == ["z"]
    assert styles(plan, model)["z.a"] == ("colwise", None)
    assert rule_for(plan, model, "z.a").local_output is False
    assert styles(plan, model)["z.d"] == ("rowwise", None)
    assert_parity(model, plan, tp, x)


def test_parameters_of_the_model_itself_in_a_region_keep_it_whole() -> None:
    """A plan styles submodules only: the root's own sink cannot be split or have its
    gradient summed, so the attention stays whole, with that reason."""
    model = SinkAttention()
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    assert styles(plan, model).get("a", ("colwise", "replicate")) == ("colwise", "replicate")
    assert "the model's own parameters" in rule_for(plan, model, "a").why
    assert_parity(model, plan, 2, x)


def test_gpt_oss_sinks_joined_to_the_logits() -> None:
    """GPT-OSS joins each head's sink to its logits (`cat` along the keys)."""
    model = gpt_oss()
    plan = tpplan.infer_plan(model)
    sinks = rule_for(plan, model, "model.layers.0.self_attn")
    assert (sinks.style, sinks.shard) == ("split_params", {"sinks": 0})
    assert "one entry per head" in sinks.why
    assert rule_for(plan, model, "model.layers.0.self_attn.q_proj").style == "colwise"
    assert rule_for(plan, model, "model.layers.0.self_attn.o_proj").style == "rowwise"
    assert_parity(model, plan, 2, _tokens())


def test_deepseek_latent_attention_runs_as_a_region_for_its_gradients() -> None:
    """DeepSeek's keys are assembled in a buffer made with `new_empty` to the local head
    count (followed as split), next to a rotary part computed from the weights and broadcast
    over the heads with `expand`. On local shards that broadcast covers a rank's own heads
    only, so the rotary part's gradient would be a partial sum nothing adds up: the local
    split is refused, and the attention runs as a DTensor region instead, its latent
    projections whole, where the rotary part's gradient is gathered in the backward (forward
    parity alone would not show it; the backward parity does)."""
    model = deepseek_v3()
    plan = tpplan.infer_plan(model)
    assert [r.match for r in plan.regions] == ["model.layers.*.self_attn"]
    kv = rule_for(plan, model, "model.layers.0.self_attn.kv_b_proj")
    assert (kv.style, kv.local_output) == ("colwise", False)
    for latent, reader in (("kv_a_proj_with_mqa", "kv_b_proj"), ("q_a_proj", "q_b_proj")):
        rule = rule_for(plan, model, f"model.layers.0.self_attn.{latent}")
        assert rule.style == "replicate"
        assert rule.why.startswith(f"kept whole: {reader}, which opens the region's split")
    assert_parity(model, plan, 2, _tokens())


def test_a_gate_computed_from_the_weights_keeps_the_split_from_training_wrong() -> None:
    """An MLP whose split features are scaled by a per-token gate computed from the whole
    input: on local shards the gate's gradient would be each rank's partial sum, so the
    split cannot run on local tensors (said in the trace); it runs as a DTensor region,
    where DTensor sums that gradient, and every gradient matches."""
    model = GatedBlock()
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    assert [r.match for r in plan.regions] == ["blk"]
    assert rule_for(plan, model, "blk.up").local_output is False
    assert styles(plan, model)["blk.down"] == ("rowwise", None)
    assert_parity(model, plan, 2, x)


def test_albert_shared_layer_splits_once_the_projection_before_it_is_whole() -> None:
    """The first pass ties ALBERT's shared layer to embedding_hidden_mapping_in (its first
    call reads that layer's split output), whose split ends at a norm: a plan keeps it whole,
    so the trace runs again with its output whole, and the shared layer splits like any
    attention and MLP. check_plan sees the same settled trace."""
    model = albert()
    plan = tpplan.infer_plan(model)
    prefix = "albert.encoder.albert_layer_groups.0.albert_layers.0."
    assert rule_for(plan, model, prefix + "attention.query").style == "colwise"
    assert rule_for(plan, model, prefix + "attention.dense").style == "rowwise"
    assert rule_for(plan, model, prefix + "ffn_output").style == "rowwise"
    mapping = rule_for(plan, model, "albert.encoder.embedding_hidden_mapping_in")
    assert mapping.output == "replicate" or mapping.style == "replicate"
    assert "native_layer_norm" in mapping.why
    assert tpplan.check_plan(plan, model, tp_size=2) == []
    for tp in (2, 4):
        assert_parity(model, plan, tp, _tokens())


def test_mlp() -> None:
    model = Mlp()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    assert styles(plan, model) == {"fc1": ("colwise", None), "fc2": ("rowwise", None)}
    assert "gelu" in rule_for(plan, model, "fc1").why
    assert_parity(model, plan, 2, x)


def test_norm_over_features_ends_the_split() -> None:
    """A LayerNorm needs all of fc1's features, so fc1's output cannot stay split: each
    layer only splits its weight, its output gathered at once."""
    model = NormedMlp()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    assert styles(plan, model) == {"fc1": ("colwise", "replicate"), "fc2": ("colwise", "replicate")}
    why = rule_for(plan, model, "fc1").why
    assert "native_layer_norm" in why and "normalizes over the split features" in why
    assert_parity(model, plan, 2, x)


def test_names_do_not_matter() -> None:
    """The same computation under other attribute names, declared in another order."""
    plain, odd = block(PLAIN_NAMES), block(ODD_NAMES)
    ids = token_batch(batch=2, seq=8)
    p1, p2 = (
        tpplan.infer_plan(plain, example_inputs=ids),
        tpplan.infer_plan(odd, example_inputs=ids),
    )
    s1, s2 = styles(p1, plain, sharded_only=False), styles(p2, odd, sharded_only=False)
    assert {r: s1.get(PLAIN_NAMES[r]) for r in ROLES} == {r: s2.get(ODD_NAMES[r]) for r in ROLES}
    assert styles(p1, plain) == {
        "embed": ("vocab_parallel", None),
        "q": ("colwise", None), "k": ("colwise", None), "v": ("colwise", None), "o": ("rowwise", None),
        "up": ("colwise", None), "down": ("rowwise", None),
        "head": ("colwise", "replicate"),
    }  # fmt: skip
    assert_parity(odd, p2, 2, ids)


@pytest.mark.parametrize("tp", [2, 4])
def test_falcon_parallel_residual_with_per_head_fused_qkv(tp: int) -> None:
    """Attention and MLP read one normed input and are summed in place (`+=` on the MLP's
    output). Falcon views q|k|v by `self.num_heads`, which equals `self.num_kv_heads`: which
    one the view read cannot be told, so attention only splits its weights (gathered), the
    MLP is split, and it trains."""
    model = falcon()
    plan = tpplan.infer_plan(model)
    qkv = rule_for(plan, model, "transformer.h.0.self_attention.query_key_value")
    assert (qkv.style, qkv.output) == ("colwise", "replicate")
    assert "several attributes read in forward hold it (num_heads, num_kv_heads)" in qkv.why
    assert rule_for(plan, model, "transformer.h.0.mlp.dense_4h_to_h").style == "rowwise"
    assert_parity(model, plan, tp, _tokens())


# ---- encoder-decoders -----------------------------------------------------------------------
ENCODER_DECODERS = {"t5": t5, "bart": bart, "whisper": whisper}


def _layers(plan: Plan, model: nn.Module, part: str) -> set[tuple[str, str | None]]:
    """The styles of every module whose name contains `part`."""
    return {s for n, s in styles(plan, model).items() if part in n}


@pytest.mark.parametrize("family", sorted(ENCODER_DECODERS))
def test_encoder_decoder_self_and_cross_attention(family: str) -> None:
    """Self-attention of encoder and decoder is split by heads; cross-attention (queries
    from the decoder, keys and values from the encoder) is split or, where it cannot stay
    split, gathered; forward and backward match the unsharded model at tp 2 and 4."""
    model = ENCODER_DECODERS[family]()
    plan = tpplan.infer_plan(model)
    self_attn, cross = {
        "t5": ("SelfAttention", "EncDecAttention"),
        "bart": ("self_attn", "encoder_attn"),
        "whisper": ("self_attn", "encoder_attn"),
    }[family]
    assert ("colwise", None) in _layers(plan, model, f"encoder.block.0.layer.0.{self_attn}.q") | (
        _layers(plan, model, f"encoder.layers.0.{self_attn}.q_proj")
    ), plan.to_yaml()
    assert ("rowwise", None) in _layers(plan, model, f"decoder.block.1.layer.0.{self_attn}.o") | (
        _layers(plan, model, f"decoder.layers.1.{self_attn}.out_proj")
    )
    assert _layers(plan, model, cross) <= {
        ("colwise", None),
        ("rowwise", None),
        ("colwise", "replicate"),
    }
    assert _layers(plan, model, cross)
    inputs = tpplan._runtime.inputs.example_inputs(model, batch=2, seq=8)
    for tp in (2, 4):
        result = verify_plan(
            model, tpplan.infer_plan(model, tp_size=tp), tp_size=tp, backward=True, inputs=inputs
        )
        assert result.ok, result.worst


def test_t5_relative_position_bias_is_split_by_heads() -> None:
    """T5's bias table has one column per head: split by columns, it joins the heads' region."""
    model = t5()
    plan = tpplan.infer_plan(model)
    rule = rule_for(plan, model, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias")
    assert rule.style == "colwise"
    for name in ("encoder.embed_tokens", "decoder.embed_tokens"):
        assert rule_for(plan, model, name).style == "vocab_parallel"  # tied, split alike
    assert not [r for r in plan.rules if r.match == "shared"]  # never called: follows the tie


def test_positional_embeddings_given_the_ids_are_not_token_lookups() -> None:
    """BART's and Whisper's positional embeddings take the token ids but look up positions."""
    for model in (bart(), whisper()):
        plan = tpplan.infer_plan(model)
        rule = rule_for(plan, model, "model.decoder.embed_positions")
        assert rule.style == "replicate" and "computed inside forward" in rule.why


# ---- tp sizes -------------------------------------------------------------------------------
def test_tp_past_the_kv_heads_shares_them() -> None:
    """4 key/value heads cannot split 8 ways: each goes whole to the 2 ranks holding its
    query heads (replicate_heads), the query heads split 8 ways, so attention is split the
    Megatron way with no gather."""
    model = llama_gqa()
    plan = tpplan.infer_plan(model, tp_size=8)
    sharded = styles(plan, model)
    for p, style in (("q_proj", "colwise"), ("k_proj", "colwise"), ("o_proj", "rowwise")):
        assert sharded[f"model.layers.0.self_attn.{p}"] == (style, None)
    k_proj = rule_for(plan, model, "model.layers.0.self_attn.k_proj")
    assert k_proj.replicate_heads and "or be a multiple of it" in k_proj.why
    assert sharded["model.layers.0.mlp.down_proj"] == ("rowwise", None)
    assert_parity(model, plan, 8, _tokens())


def test_odd_tp_shards_what_it_can() -> None:
    """tp 3 divides the MLP (96) but not the heads (8 query heads in 4 groups of 2): those
    split unevenly, whole groups per rank (4, 2 and 2 query heads: `uneven` with `group`);
    the vocab (128) splits unevenly too (43, 43 and 42 rows: `uneven`)."""
    model = llama_gqa()
    plan = tpplan.infer_plan(model, tp_size=3)
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert set(styles(plan, model)) == {
        f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")
    } | {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in attention} | {
        "model.embed_tokens",
        "lm_head",
    }
    assert all(r.uneven for r in plan.rules if r.match in ("model.embed_tokens", "lm_head"))
    groups = {r.match.rpartition(".")[2]: r.uneven_group() for r in plan.rules}
    assert [groups[p] for p in attention] == [2, 1, 1, 2]
    # whole groups on every rank: num_key_value_groups stays as it is, no rule divides it
    assert plan.attributes == []
    assert tpplan.check_plan(plan, model, tp_size=3) == []
    # ranks of 2 and 1 key/value heads: simulated ranks cannot run it (one process decides
    # views for all of them), real ones do (test_processes.py's uneven heads at tp 3)
    assert_parity(model, _even_attention(plan), 3, _tokens())


def _even_attention(plan: Plan) -> Plan:
    """`plan` less its rules of heads split unevenly (their attention kept whole)."""
    return plan.model_copy(
        update={"rules": [r for r in plan.rules if r.uneven_group() is None], "attributes": []}
    )


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_plan_without_tp_checks_at_2_and_4_and_round_trips(family: str) -> None:
    model = HF_FAMILIES[family]()
    plan = tpplan.infer_plan(model)
    assert tpplan.check_plan(plan, model, tp_size=2) == []
    assert tpplan.check_plan(plan, model, tp_size=4) == []
    assert Plan.from_yaml(plan.to_yaml()) == plan
    # head_dim lets check_plan refuse a tp that splits a head
    assert tpplan.check_plan(plan, model, tp_size=16)


def test_meta_model_gives_the_same_plan() -> None:
    cpu = llama_gqa()
    with torch.device("meta"):
        meta = LlamaForCausalLM(cpu.config)
    assert tpplan.infer_plan(meta) == tpplan.infer_plan(cpu)


def test_llama_405b_on_meta(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = LlamaConfig(
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    start = time.perf_counter()
    plan = tpplan.infer_plan(model)
    with capsys.disabled():
        print(f"\n405B infer_plan: {time.perf_counter() - start:.2f} s")
    assert len(plan.rules) == 9  # one rule per role, every layer under one pattern
    assert tpplan.check_plan(plan, model, tp_size=8) == []
    assert rule_for(plan, model, "model.layers.125.self_attn.k_proj").head_dim == 128


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + y


def test_untraceable_model_says_what_to_pass() -> None:
    with pytest.raises(tpplan.TpplanError, match="example_inputs"):
        tpplan.infer_plan(_TwoInputs())


def test_inputs_of_a_one_input_module_are_made_up_from_its_first_layer() -> None:
    """An MLP's forward(x): features of its first Linear's width, with no inputs given."""
    plan = tpplan.infer_plan(Mlp(), tp_size=2)
    assert rule_for(plan, Mlp(), "fc1").style == "colwise"


def test_mixture_of_experts_traces_and_keeps_the_numbers() -> None:
    """The experts' grouped matmul has a bf16-only fake kernel; the trace still runs in fp32
    and the attention is split. The experts themselves stay whole until the tracer knows them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, num_experts=4,
        num_experts_per_tok=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    plan = tpplan.infer_plan(model)
    assert styles(plan, model)["model.layers.0.self_attn.o_proj"] == ("rowwise", None)
    assert_parity(model, plan, 2, _tokens())


def test_per_head_norms_scaled_by_one_plus_weight_keep_their_gradients() -> None:
    """Gemma 3 scales its per-head q/k norms by `1 + weight` (found by the benchmark): the
    weight's gradient must come out whole on every rank."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, pad_token_id=0, sliding_window=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    assert_parity(model, tpplan.infer_plan(model), 2, _tokens())


@pytest.mark.parametrize("tp", [2, 4])
def test_a_merge_sized_by_a_stored_width_divides_it(tp: int) -> None:
    """Megatron-BERT merges its heads with `view(*shape[:-2], self.all_head_size)`: the
    width read just before the view is divided per rank and the attention stays split."""
    import transformers

    cfg = transformers.MegatronBertConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MegatronBertForMaskedLM(cfg).eval()
    plan = tpplan.infer_plan(model, tp_size=tp)
    (attr,) = plan.attributes
    assert attr.match == "bert.encoder.layer.*.attention.self"
    assert attr.divide == ["all_head_size"]
    dense = "bert.encoder.layer.0.attention.output.dense"
    assert styles(plan, model)[dense] == ("rowwise", None)
    assert_parity(model, plan, tp, _tokens())


class _GroupedRotary(nn.Module):
    """CodeGen's attention as transformers 5.24 writes it, with names that mean nothing: the
    fused projection holds `groups` blocks of [q | v | k], the per-block width is computed
    from `groups` (width // groups), and the rotary half-swap ends in `flatten`, whose view
    is sized by the tensor itself. `groups` equals the head count by chance."""

    def __init__(self, width: int = 64, heads: int = 4, groups: int = 4) -> None:
        super().__init__()
        self.width, self.hd, self.groups = width, width // heads, groups
        self.a = nn.Linear(width, 3 * width, bias=False)
        self.b = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        heads = (*shape, -1, self.hd)
        local = self.width // self.groups
        qvk = self.a(x).view(*shape, -1, 3 * local)
        q, v, k = qvk.split(local, dim=-1)
        q, k, v = (t.reshape(heads) for t in (q, k, v))
        q = torch.stack((-q[..., 1::2], q[..., ::2]), dim=-1).flatten(-2)  # rotary half-swap
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.b(out.transpose(1, 2).reshape(*shape, -1))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_count_that_equals_an_attribute_by_chance_is_not_divided(tp: int) -> None:
    """A flatten keeps the heads dim at the shard's own size; that the count equals an
    attribute read earlier (`groups`, which sizes each block as width // groups) is no
    evidence. Dividing `groups` would double each block's width on a shard and mix q with v
    silently (CodeGen under transformers 5.24: logits off by 0.48)."""
    torch.manual_seed(0)
    model = nn.Sequential(_GroupedRotary())
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    assert plan.attributes == []
    assert styles(plan, model) == {"0.a": ("colwise", None), "0.b": ("rowwise", None)}
    assert_parity(model, plan, tp, x)


@pytest.mark.parametrize("tp", [2, 4])
def test_codegen_keeps_the_numbers(tp: int) -> None:
    """transformers' CodeGen: q|v|k interleaved over four blocks in one projection, split
    contiguously (each rank holds whole blocks), with nothing divided."""
    import transformers

    cfg = transformers.CodeGenConfig(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.CodeGenForCausalLM(cfg).eval()
    plan = tpplan.infer_plan(model, tp_size=tp)
    assert plan.attributes == []
    assert styles(plan, model)["transformer.h.0.attn.qkv_proj"] == ("colwise", None)
    assert_parity(model, plan, tp, _tokens())


def test_a_merge_whose_width_cannot_be_traced_to_one_attribute_runs_on_dtensors() -> None:
    """XGLM merges batch and heads with `bsz * self.num_heads`, computed before two other
    ops: no attribute read right before the view holds the merged size, so the split cannot
    run on local tensors (instead of failing at apply or guessing which to divide); the
    attention runs as a DTensor region, whose global shapes need no attribute divided."""
    import transformers

    cfg = transformers.XGLMConfig(
        vocab_size=128, d_model=64, ffn_dim=128, num_layers=2, attention_heads=4,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.XGLMForCausalLM(cfg).eval()
    plan = tpplan.infer_plan(model, tp_size=2)
    q = rule_for(plan, model, "model.layers.0.self_attn.q_proj")
    assert (q.style, q.output, q.local_output) == ("colwise", None, False)
    assert [r.match for r in plan.regions] == ["model.layers.*.self_attn"]
    assert not plan.attributes
    assert_parity(model, plan, 2, _tokens())


class _GroupedLinear(nn.Linear):
    """A Linear by type whose forward is block-diagonal (DeepSeek-V4's grouped output
    projection): its weight rows are per-group blocks, not output features to split."""

    def __init__(self, per_group: int, out: int, groups: int) -> None:
        super().__init__(per_group, out, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        y = torch.bmm(x.reshape(-1, self.groups, x.shape[-1]).transpose(0, 1), w)
        return y.transpose(0, 1).reshape(*x.shape[:-2], -1)


class _GroupedMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(128, 32)
        self.grouped = _GroupedLinear(8, 64, 4)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 32)
        self.head = nn.Linear(32, 128)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        h = self.grouped(x.unflatten(-1, (4, 8)))
        return self.head(x + self.down(torch.relu(self.up(h))))


def test_a_linear_subclass_is_judged_by_what_its_forward_computes() -> None:
    model = _GroupedMixer()
    plan = tpplan.infer_plan(model, example_inputs=_tokens())
    sharded = styles(plan, model)
    assert "grouped" not in sharded and sharded["up"] == ("colwise", None)
    assert_parity(model, plan, 2, _tokens())


class _CountingLinear(nn.Linear):
    """A Linear subclass whose forward reads an integer attribute (Llama 4's router reads
    top_k): probing it must not count as a read of the traced forward."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out, bias=False)
        self.top_k = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (self.top_k / 2)


class _LiteralHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(128, 32)
        self.router = _CountingLinear(32, 32)
        self.q = nn.Linear(32, 32)
        self.o = nn.Linear(32, 32)
        self.head = nn.Linear(32, 128)
        self.head_dim = 16

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.router(self.embed(ids))
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 2, self.head_dim)  # a literal head count
        return self.head(self.o(torch.tanh(q).reshape(b, t, 32)))


def test_a_probe_of_a_linear_subclass_leaves_no_reads_behind() -> None:
    """Found by the benchmark on Llama 4: the probe's read of top_k = 2 was taken for the
    head count of a view with a literal 2, and top_k was divided: a wrong forward."""
    model = _LiteralHeads()
    plan = tpplan.infer_plan(model, example_inputs=_tokens())
    assert plan.attributes == []
    q = rule_for(plan, model, "q")
    assert "no module attribute read in forward holds it" in q.why
    assert_parity(model, plan, 2, _tokens())


class _IndexedBlocks(nn.Module):
    """Runs its blocks by index up to a stored layer count (as Gemma 3n does with its
    per-layer inputs), which a copy shortened to a prefix of blocks cannot run."""

    def __init__(self, layers: int = 10) -> None:  # past 8 blocks, stacks are shortened
        super().__init__()
        torch.manual_seed(0)
        self.n_layers = layers
        self.embed = nn.Embedding(128, 32)
        self.blocks = nn.ModuleList(Mlp() for _ in range(layers))
        self.head = nn.Linear(32, 128)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i in range(self.n_layers):
            x = x + self.blocks[i](x)
        return self.head(x)


def test_a_model_that_indexes_its_blocks_is_traced_whole() -> None:
    model = _IndexedBlocks()
    plan = tpplan.infer_plan(model, example_inputs=_tokens())
    sharded = styles(plan, model)
    assert all(sharded[f"blocks.{i}.fc1"] == ("colwise", None) for i in range(10))
    assert_parity(model, plan, 2, _tokens())


class _LastBlockExtra(nn.Module):
    """Identical blocks, but the last one also gets a tensor added to its hidden features
    (as NeoMME hands value embeddings to its first and last global layers only)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.extra = nn.Embedding(128, 32), nn.Embedding(128, Mlp().fc1.out_features)
        self.blocks = nn.ModuleList(Mlp() for _ in range(3))
        self.head = nn.Linear(32, 128)
        self.extra_at = {2}  # chosen once, from the config, as NeoMME does

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i, blk in enumerate(self.blocks):
            extra = self.extra(ids) if i in self.extra_at else None
            h = blk.fc1(x)
            h = h + extra if extra is not None else h
            x = x + blk.fc2(torch.relu(h))
        return self.head(x)


def test_a_short_stack_is_traced_block_by_block() -> None:
    """A prefix of blocks would not show that the last block adds a whole tensor to its
    split features; up to 8 blocks every block is traced, and that one stays whole."""
    model = _LastBlockExtra()
    plan = tpplan.infer_plan(model, example_inputs=_tokens())
    sharded = styles(plan, model)
    assert sharded["blocks.0.fc1"] == ("colwise", None)
    assert sharded.get("blocks.2.fc1", ("colwise", "replicate")) == ("colwise", "replicate")
    assert_parity(model, plan, 2, _tokens())


class _PaddedMlp(nn.Module):
    """fc1's features padded by F.pad on the sequence dim (`beside`) or on the features
    themselves (`on_features`) before fc2 contracts them."""

    def __init__(self, pad: str, dim: int = 32, hidden: int = 48) -> None:
        super().__init__()
        self.pad = pad
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden + (2 if pad == "on_features" else 0), dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        if self.pad == "beside":  # a sequence padded to whole chunks, cut back after
            return self.fc2(torch.nn.functional.pad(h, (0, 0, 0, 3)))[:, : x.shape[1]]
        return self.fc2(torch.nn.functional.pad(h, (1, 1)))


def test_padding_beside_the_split_dim_keeps_the_split() -> None:
    model = _PaddedMlp("beside")
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    assert styles(plan, model) == {"fc1": ("colwise", None), "fc2": ("rowwise", None)}
    assert "constant_pad_nd" in rule_for(plan, model, "fc1").why
    assert_parity(model, plan, 2, x)


def test_padding_the_split_dim_ends_the_split() -> None:
    model = _PaddedMlp("on_features")
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    assert styles(plan, model)["fc1"] == ("colwise", "replicate")
    assert "pads the split dim" in rule_for(plan, model, "fc1").why
    assert_parity(model, plan, 2, x)


class _SmallGate(nn.Module):
    """A big projection beside a small one whose output is normed over its features: the
    small one cannot stay split, whatever its size."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.big = nn.Linear(dim, 512)
        self.small = nn.Linear(dim, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(x) * self.norm(self.small(x)).sum(-1, keepdim=True)


def test_a_small_layer_whose_output_cannot_stay_split_still_splits_its_weight() -> None:
    model = _SmallGate()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x, tp_size=2)
    assert styles(plan, model)["small"] == ("colwise", "replicate")
    assert "normalizes over the split features" in rule_for(plan, model, "small").why
    assert_parity(model, plan, 2, x)


def test_without_a_tp_size_only_layers_that_divide_by_8_are_gathered() -> None:
    """A plan inferred for no tp size must not refuse tp 4 or 8 for a 4-feature gate."""
    model = _SmallGate()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    assert "small" not in styles(plan, model)
    assert styles(plan, model)["big"] == ("colwise", "replicate")  # 512 features divide by 8
    for tp in (2, 4, 8):
        assert tpplan.check_plan(plan, model, tp_size=tp) == []


class _Tower(nn.Module):
    """A vision tower written by hand: 4x4 patches, a patch projection plus positions, one MLP
    block. It has a config naming its image size, as transformers' towers do, unless `config`
    is False."""

    def __init__(self, *, config: bool = True, dim: int = 32, hidden: int = 48) -> None:
        super().__init__()
        if config:
            self.config = types.SimpleNamespace(image_size=8, num_channels=3)
        self.patch = nn.Linear(3 * 4 * 4, dim)
        self.positions = nn.Parameter(torch.randn(4, dim) * 0.1)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        b = pixel_values.shape[0]
        patches = pixel_values.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5)
        h = self.patch(patches.reshape(b, -1, 3 * 4 * 4)) + self.positions
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))


class _TextAndTower(nn.Module):
    """Token ids, and optionally pixels whose tower's features go in front of the tokens'.
    Traced on token ids alone, the tower never runs."""

    def __init__(self, *, tower_config: bool = True, shared: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.mlp = Mlp(32, 48)
        self.tower = _Tower(config=tower_config)
        if shared:
            self.tower.fc2.weight = self.mlp.fc2.weight
        self.head = nn.Linear(32, 64)

    def forward(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.embed(input_ids)
        if pixel_values is not None:
            h = torch.cat([self.tower(pixel_values), h], dim=1)
        return self.head(h + self.mlp(h))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_part_the_forward_does_not_call_is_traced_on_its_own(tp: int) -> None:
    torch.manual_seed(0)
    model = _TextAndTower()
    plan = tpplan.infer_plan(model)
    got = styles(plan, model)
    assert got["tower.fc1"] == ("colwise", None) and got["tower.fc2"] == ("rowwise", None)
    assert got["tower.patch"] == ("colwise", "replicate")  # whole positions are added to it
    assert "traced on its own" in rule_for(plan, model, "tower.fc1").why
    assert got["mlp.fc1"] == ("colwise", None)  # the text part as before
    g = torch.Generator().manual_seed(1)
    x = {
        "input_ids": torch.randint(0, 64, (2, 5), generator=g),
        "pixel_values": torch.randn(2, 3, 8, 8, generator=g),
    }
    assert_parity(model, plan, tp, x)


def test_a_part_that_cannot_run_alone_is_traced_layer_by_layer() -> None:
    """No config names the tower's image size: its layers are traced one by one, each on
    features as wide as it takes, so each is split and its output gathered."""
    torch.manual_seed(0)
    model = _TextAndTower(tower_config=False)
    plan = tpplan.infer_plan(model, tp_size=2)
    got = styles(plan, model)
    assert got["tower.fc1"] == got["tower.fc2"] == ("colwise", "replicate")
    assert "traced on its own" in rule_for(plan, model, "tower.fc1").why
    g = torch.Generator().manual_seed(1)
    x = {
        "input_ids": torch.randint(0, 64, (2, 5), generator=g),
        "pixel_values": torch.randn(2, 3, 8, 8, generator=g),
    }
    assert_parity(model, plan, 2, x)


def test_a_part_sharing_a_parameter_with_the_rest_stays_whole() -> None:
    model = _TextAndTower(shared=True)
    plan = tpplan.infer_plan(model)
    assert "tower.fc1" not in styles(plan, model)
    assert "shares a parameter" in rule_for(plan, model, "tower.fc1").why


class _PackedTower(nn.Module):
    """A tower fed patches packed as rows, with each image's (frames, height, width) in
    patches (Qwen2-VL's way): one attention block over all of them. (Its width differs from
    the 32 rows two images make, so the trace cannot take one for the other.)"""

    def __init__(self, dim: int = 24, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.patch = nn.Linear(2 * 3 * 4 * 4, dim)  # 2 frames of 3 channels of 4x4 pixels
        self.positions = nn.Embedding(16, dim)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        n = pixel_values.shape[0]
        where = torch.arange(n) % (grid_thw[0, 1] * grid_thw[0, 2])
        h = (self.patch(pixel_values) + self.positions(where)).unsqueeze(0)  # (1, n, dim)
        x = self.norm(h)
        q, k, v = (p(x).view(1, n, -1, self.head_dim).transpose(1, 2) for p in self.qkv)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        return (h + self.proj(a.reshape(1, n, -1)))[0]


class _Projector(nn.Module):
    def __init__(self, dim: int = 24, hidden: int = 64, out: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _TextAndPackedTower(nn.Module):
    """Token ids, and optionally packed patches: the tower's features, projected, go in front
    of each sequence's tokens. Given token ids alone, neither the tower nor the projector runs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.tower = _PackedTower()
        self.projector = _Projector()
        self.mlp = Mlp(32, 48)
        self.head = nn.Linear(32, 64)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed(input_ids)
        if pixel_values is not None:
            v = self.projector(self.tower(pixel_values, image_grid_thw))
            h = torch.cat([v.view(h.shape[0], -1, h.shape[-1]), h], dim=1)
        return self.head(h + self.mlp(h))


def test_a_packed_patch_tower_and_its_projector_are_traced_on_their_own() -> None:
    """Inputs made up for the parts text does not reach: packed patches with their grid for
    the tower, features as wide as its first layer takes for the projector."""
    torch.manual_seed(0)
    model = _TextAndPackedTower()
    plan = tpplan.infer_plan(model, tp_size=2)
    got = styles(plan, model)
    assert got["tower.qkv.0"] == ("colwise", None) and got["tower.proj"] == ("rowwise", None)
    assert got["projector.fc1"] == ("colwise", None)
    assert got["projector.fc2"] == ("rowwise", None)
    for name in ("tower.qkv.0", "projector.fc1"):
        assert "traced on its own" in rule_for(plan, model, name).why
    g = torch.Generator().manual_seed(1)
    grid = torch.tensor([[1, 2, 2], [1, 2, 2]])
    x = {
        "input_ids": torch.randint(0, 64, (2, 5), generator=g),
        "pixel_values": torch.randn(8, 2 * 3 * 4 * 4, generator=g),
        "image_grid_thw": grid,
    }
    assert_parity(model, plan, 2, x)


def test_check_traces_a_part_the_forward_does_not_call_on_its_own() -> None:
    """A hand edit inside the tower (its closing layer made whole) is found by data flow,
    as in the parts the forward does call."""
    model = _TextAndPackedTower()
    plan = tpplan.infer_plan(model, tp_size=2)
    assert tpplan.check_plan(plan, model, tp_size=2) == []
    rules = [
        tpplan.Rule(match=r.match, style="replicate", why="edited")
        if r.match == "tower.proj"
        else r
        for r in plan.rules
    ]
    broken = Plan.model_validate({**plan.model_dump(exclude_none=True), "rules": rules})
    problems = tpplan.check_plan(broken, model, tp_size=2)
    assert {p.kind for p in problems} == {"unclosed_region"}
    assert all((p.module or "").startswith("tower.qkv") for p in problems)
    assert "tower.proj, which the plan does not make rowwise" in problems[0].message


class _WeightOnly(nn.Module):
    """A layer never called, whose weight the forward multiplies by directly (Jamba's
    dt_proj)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 48)
        self.fc2 = nn.Linear(48, 32)
        self.direct = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x))) + x @ self.direct.weight.t()


def test_a_layer_whose_weight_the_forward_uses_directly_is_not_split_alone() -> None:
    model = _WeightOnly()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x, tp_size=2)
    assert "direct" not in styles(plan, model)
    assert "uses its parameters directly" in rule_for(plan, model, "direct").why
    assert_parity(model, plan, 2, x)  # (its bias gets no gradient on either side)


class _ClassToken(nn.Module):
    """A 1-D class embedding expanded to (batch, 1, width) with the width read off the
    projection's split output, then put in front of the patches (Llama 4's vision tower)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.patch = nn.Linear(dim, dim)
        self.cls = nn.Parameter(torch.randn(dim))
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x)
        cls = self.cls.expand(h.shape[0], 1, h.shape[-1])
        return self.fc(torch.cat([h, cls], dim=1))


def test_an_expand_that_adds_leading_dims_to_a_vector_is_traced() -> None:
    model = _ClassToken()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    assert styles(plan, model)["patch"] == ("colwise", "replicate")
    assert_parity(model, plan, 2, x)


class _StackedRotary(nn.Module):
    """Heads rotated pairwise with `stack((-x2, x1), -1)` (an interleaved rotary), then
    merged back and contracted."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.fc1(x).view(b, t, -1, self.head_dim)
        turned = torch.stack((-h[..., 1::2], h[..., ::2]), dim=-1).flatten(-2)
        return self.fc2((0.6 * h + 0.8 * turned).reshape(b, t, -1))


def test_tensors_stacked_alike_stay_split() -> None:
    model = _StackedRotary()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    assert styles(plan, model) == {"fc1": ("colwise", None), "fc2": ("rowwise", None)}
    assert "stack" in rule_for(plan, model, "fc1").why
    assert_parity(model, plan, 2, x)


class _GatedHeads(nn.Module):
    """A per-head output gate viewed with `view_as` the attention output (Beam): its count
    of heads comes from the other tensor's shape, read in C++, and is each shard's own."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.v = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        v = self.v(x).view(b, t, -1, self.head_dim)
        gated = v * torch.sigmoid(self.gate(x).view_as(v))
        return self.o(gated.reshape(b, t, -1))


def test_a_view_as_a_split_tensor_keeps_the_split() -> None:
    model = _GatedHeads()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x)
    want = {"v": ("colwise", None), "gate": ("colwise", None), "o": ("rowwise", None)}
    assert styles(plan, model) == want
    for tp in (2, 4):
        assert_parity(model, plan, tp, x)


class _ScaledInPlace(NormedMlp):
    """A layer's output normed over its features (so gathered), scaled in place first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h.mul_(2.0)
        return self.fc2(self.norm(h))


def test_a_gathered_output_may_be_changed_in_place_while_training() -> None:
    model = _ScaledInPlace()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, example_inputs=x, tp_size=2)
    assert styles(plan, model)["fc1"] == ("colwise", "replicate")
    assert_parity(model, plan, 2, x)


class _TwoPaths(nn.Module):
    """Token ids through one MLP; with `extra` features, a second MLP of the same structure
    runs on those too. Traced on token ids alone, the second one never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.text_mlp = Mlp(32, 48)
        self.other_mlp = Mlp(32, 48)
        self.head = nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + self.text_mlp(h)
        if extra is not None:
            h = torch.cat([self.other_mlp(extra), h], dim=1)
        return self.head(h)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_part_that_did_not_run_takes_the_decisions_of_its_twin_that_did(tp: int) -> None:
    torch.manual_seed(0)
    model = _TwoPaths()
    plan = tpplan.infer_plan(model)
    got = styles(plan, model)
    assert got["other_mlp.fc1"] == ("colwise", None) and got["other_mlp.fc2"] == ("rowwise", None)
    assert (
        "as text_mlp, which has the same structure and ran"
        in rule_for(plan, model, "other_mlp.fc1").why
    )
    g = torch.Generator().manual_seed(1)
    x = {
        "input_ids": torch.randint(0, 64, (2, 5), generator=g),
        "extra": torch.randn(2, 3, 32, generator=g),
    }
    assert_parity(model, plan, tp, x)


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_pieces_viewed_before_the_heads_split_by_heads(tp: int) -> None:
    """The literal 3 before the heads counts the fused pieces: q|k|v are `parts`, each rank
    its own heads of each, and the head count and merged width are divided."""
    model = nn.Sequential(PiecesThenHeads())  # a plan divides submodules' attributes
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    qkv = rule_for(plan, model, "0.qkv")
    assert (qkv.style, qkv.parts, qkv.output) == ("colwise", [32, 32, 32], None)
    assert styles(plan, model)["0.proj"] == ("rowwise", None)
    assert sorted(plan.attributes[0].divide) == ["attn_dim", "num_heads"]
    assert_parity(model, plan, tp, x)


def test_pieces_and_heads_of_one_count_are_told_apart_by_how_the_view_is_written() -> None:
    """Three heads viewed as (3, 3, head_dim): the sizes alone cannot say which 3 counts the
    pieces, but the view as written can: `reshape(b, n, 3, self.num_heads, self.head_dim)`
    gives the pieces as a number and the heads as an attribute. So the pieces are the
    layer's `parts`, the head count is divided, and the attention runs on local shards."""
    model = nn.Sequential(PiecesThenHeads(dim=24, num_heads=3))
    x = torch.randn(2, 6, 24, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, tp_size=3, example_inputs=x)
    qkv = rule_for(plan, model, "0.qkv")
    assert (qkv.parts, qkv.local_output) == ([24, 24, 24], None)
    assert [a.divide for a in plan.attributes] == [["attn_dim", "num_heads"]]
    assert not plan.regions
    assert_parity(model, plan, 3, x)


class _UnflattenHeads(nn.Module):
    """diffusers' processors: heads carved by `unflatten(-1, (-1, attn.head_dim))`, whose
    view runs with the -1 resolved to the head count."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            m(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
            for m in (self.to_q, self.to_k, self.to_v)
        )
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2, 3)
        return self.to_out(out)


@pytest.mark.parametrize("tp", [2, 4])
def test_heads_carved_by_unflatten_with_minus_one_split(tp: int) -> None:
    model = _UnflattenHeads()
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    for name in ("to_q", "to_k", "to_v"):
        assert styles(plan, model)[name] == ("colwise", None)
    assert styles(plan, model)["to_out"] == ("rowwise", None)
    assert not plan.attributes  # -1 takes each rank's own head count
    assert_parity(model, plan, tp, x)


@pytest.mark.parametrize("size", [16, 32])
def test_images_for_a_first_convolution_are_made_up_at_a_size_the_model_takes(size: int) -> None:
    """A ViT's forward(images) with position embeddings for one image size: images of the
    patch embedding's channels, at the first side its forward runs on (tried on fake
    tensors), so infer and apply need no inputs."""
    model = seeded(Vit, image=size, patch_embed="conv", fused=False)
    made = tpplan._runtime.inputs.example_inputs(model)
    assert list(made) == ["images"] and made["images"].shape == (2, 3, size, size)
    plan = tpplan.infer_plan(model, tp_size=2)
    assert rule_for(plan, model, "blocks.0.mlp.0").style == "colwise"


class _WindowAttention(nn.Module):
    """Swin's: fused qkv viewed as (B, N, 3, heads, -1), and a relative position bias looked
    up by rows in a (positions, heads) table, one column per head, added to the logits."""

    def __init__(self, dim: int = 32, num_heads: int = 4, tokens: int = 6) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.randn(2 * tokens - 1, num_heads))
        pos = torch.arange(tokens)
        self.register_buffer("index", (pos[:, None] - pos[None, :] + tokens - 1).flatten())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        bias = self.relative_position_bias_table[self.index].view(n, n, -1).permute(2, 0, 1)
        attn = (q @ k.transpose(-2, -1) + bias.unsqueeze(0)).softmax(-1)
        return x + self.proj((attn @ v).transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_bias_table_of_one_column_per_head_is_split_with_the_heads(tp: int) -> None:
    """The table's rows are looked up, its columns meet the split heads one for one: each
    rank holds its own heads' columns (split_params on dim 1), the head size written -1 is
    each rank's own, and the attention splits the Megatron way, forward and gradients at
    parity."""
    model = nn.Sequential(_WindowAttention())
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    table = rule_for(plan, model, "0")
    assert (table.style, table.shard) == ("split_params", {"relative_position_bias_table": 1})
    assert "one column per head" in table.why
    assert (rule_for(plan, model, "0.qkv").parts, styles(plan, model)["0.proj"]) == (
        [32, 32, 32],
        ("rowwise", None),
    )
    assert_parity(model, plan, tp, x)


# ---- the words of a reason ------------------------------------------------------------------
_LLAMA_TP3 = {"num_hidden_layers": 1, "vocab_size": 513, "hidden_size": 96, "head_dim": 16}


@pytest.mark.parametrize(
    ("family", "config", "tp", "module", "said"),
    [
        # a parallel loss takes no uneven head (without one, the vocab splits unevenly)
        ("gpt2", {"n_layer": 1, "_loss_parallel": True}, 2, "lm_head", "tp 2 does not divide its 50257 vocab entries"),
        (
            "llama",
            {**_LLAMA_TP3, "num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 100},
            3,
            "model.layers.0.mlp.up_proj",
            "kept whole: tp 3 does not divide its 100 features",
        ),
        (
            "llama",
            {**_LLAMA_TP3, "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 96},
            3,
            "model.layers.0.self_attn.k_proj",
            "kept whole: tp 3 does not divide its 2 key/value heads",
        ),
        (
            "llama",
            {**_LLAMA_TP3, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 96},
            3,
            "model.layers.0.self_attn.q_proj",
            "kept whole: tp 3 does not divide its 2 heads; nor can its heads split unevenly (2 "
            "query heads in 2 key/value groups have no split into whole heads at tp 3)",
        ),
        (
            "phi3",
            {**_LLAMA_TP3, "num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 100, "pad_token_id": 0, "eos_token_id": 0},
            3,
            "model.layers.0.mlp.gate_up_proj",
            "kept whole: tp 3 does not divide its 100 features per fused piece",
        ),
    ],
    ids=["vocab entries", "features", "key/value heads", "heads", "fused pieces"],
)  # fmt: skip
def test_a_region_kept_whole_names_what_tp_does_not_divide(
    family: str, config: dict[str, object], tp: int, module: str, said: str
) -> None:
    """The blocks tp must divide are named as the trace saw them: a vocab head's vocab
    entries (not heads), a key/value head count, heads, features, a fused piece's features."""
    config = dict(config)
    loss_parallel = bool(config.pop("_loss_parallel", False))
    model = build_model(family, config)
    plan = tpplan.infer_plan(model, tp_size=tp, loss_parallel=loss_parallel)
    why = rule_for(plan, model, module).why
    assert why.endswith(said), why
    assert "(heads)" not in why
