"""Attention whose heads tp does not divide (issue 35 h): a tiny Qwen2 of any head counts
and the plan that splits its heads unevenly (compile/uneven_heads.py), for the tests and the
gloo script that run it on real ranks."""

from __future__ import annotations

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import tpplan

HEAD_DIM = 8
VOCAB = 64


def qwen2(heads: int, kv_heads: int, *, layers: int = 2) -> Qwen2ForCausalLM:
    """A seeded tiny Qwen2 with `heads` query and `kv_heads` key/value heads."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def gpt2(heads: int, kv_heads: int = 0, *, layers: int = 2) -> GPT2LMHeadModel:
    """A seeded tiny GPT-2 of `heads` heads of HEAD_DIM (q|k|v fused in c_attn; `kv_heads`
    is not used: its heads are their own)."""
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=HEAD_DIM * heads,
        n_layer=layers,
        n_head=heads,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def phi3(heads: int, kv_heads: int, *, layers: int = 2) -> Phi3ForCausalLM:
    """A seeded tiny Phi-3 of `heads` query and `kv_heads` key/value heads of HEAD_DIM, its
    q|k|v fused in one Linear of unequal pieces, cut at sizes from its config."""
    config = Phi3Config(
        vocab_size=VOCAB,
        hidden_size=HEAD_DIM * heads,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return Phi3ForCausalLM(config).eval()


def uneven_plan(heads: int, kv_heads: int, tp: int) -> tpplan.Plan:
    """The plan splitting the attention's heads unevenly at `tp` (the key/value heads
    shared whole past their count), the MLP and the vocab as usual."""
    group = heads // kv_heads
    attn = "model.layers.*.self_attn"
    kv = {"replicate_heads": True} if tp > kv_heads else {"uneven": True}
    why = "heads tp does not divide, split unevenly"
    rules = [
        {"match": "model.embed_tokens", "style": "vocab_parallel", "why": "the vocab"},
        {
            "match": f"{attn}.q_proj",
            "style": "colwise",
            "head_dim": HEAD_DIM,
            "uneven": True,
            "group": group,
            "why": why,
        },
        {
            "match": f"{attn}.[kv]_proj",
            "style": "colwise",
            "head_dim": HEAD_DIM,
            **kv,
            "why": why,
        },
        {
            "match": f"{attn}.o_proj",
            "style": "rowwise",
            "head_dim": HEAD_DIM,
            "uneven": True,
            "group": group,
            "why": why,
        },
        {"match": "model.layers.*.mlp.[gu]*_proj", "style": "colwise", "why": "the MLP"},
        {"match": "model.layers.*.mlp.down_proj", "style": "rowwise", "why": "the MLP"},
    ]
    attributes = []
    if tp > kv_heads:
        attributes.append(
            {
                "match": attn,
                "divide": ["num_key_value_groups"],
                "by": "replicas",
                "of": "k_proj",
                "uneven": "q_proj",
                "why": why,
            }
        )
    return tpplan.Plan.model_validate({"tpplan": 17, "rules": rules, "attributes": attributes})
