"""Attention whose heads tp does not divide (issue 35 h): tiny transformers models of any
head counts (each built seeded, the same weights on every rank) and the hand plan that
splits a Qwen2's heads unevenly (compile/uneven_heads.py), for the tests and the gloo script
that run them on real ranks."""

from __future__ import annotations

from typing import Any

import transformers as tr

import tpplan

from .models import seeded

HEAD_DIM = 8
VOCAB = 64


def _decoder(model: type[Any], config: type[Any], heads: int, kv_heads: int, **fields: Any) -> Any:
    """A seeded tiny decoder of `heads` query and `kv_heads` key/value heads of HEAD_DIM,
    width `HEAD_DIM * heads` unless `fields` say otherwise."""
    sizes = {
        "vocab_size": VOCAB,
        "hidden_size": HEAD_DIM * heads,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 64,
    }
    return seeded(model, config=config(**{**sizes, **fields}))


def qwen2(heads: int, kv_heads: int) -> Any:
    """A tiny Qwen2 (of width 64 whatever its heads: head_dim stated)."""
    return _decoder(tr.Qwen2ForCausalLM, tr.Qwen2Config, heads, kv_heads, hidden_size=64, head_dim=HEAD_DIM)  # fmt: skip


def llama(heads: int, kv_heads: int) -> Any:
    return _decoder(tr.LlamaForCausalLM, tr.LlamaConfig, heads, kv_heads, head_dim=HEAD_DIM)


def qwen3(heads: int, kv_heads: int) -> Any:
    """A tiny Qwen3: q/k norms per head."""
    return _decoder(tr.Qwen3ForCausalLM, tr.Qwen3Config, heads, kv_heads, head_dim=HEAD_DIM)


def phi3(heads: int, kv_heads: int) -> Any:
    """A tiny Phi-3: q|k|v fused in one Linear of unequal pieces, cut at config sizes."""
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    return _decoder(tr.Phi3ForCausalLM, tr.Phi3Config, heads, kv_heads, **ids)


def gpt_neox(heads: int, kv_heads: int = 0) -> Any:
    """A tiny GPT-NeoX: q|k|v fused, viewed as heads of the three side by side (its heads are
    their own: `kv_heads` is not used)."""
    return _decoder(tr.GPTNeoXForCausalLM, tr.GPTNeoXConfig, heads, heads)


def gpt2(heads: int, kv_heads: int = 0) -> Any:
    """A tiny GPT-2: q|k|v fused in c_attn in equal pieces (`kv_heads` is not used)."""
    config = tr.GPT2Config(
        vocab_size=VOCAB,
        n_embd=HEAD_DIM * heads,
        n_layer=2,
        n_head=heads,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return seeded(tr.GPT2LMHeadModel, config=config)


def falcon(heads: int, kv_heads: int = 1) -> Any:
    """A tiny Falcon of multi-query attention (Falcon-7B's layout): q|k|v fused as its query
    heads, then one key and one value head, viewed `(B, T, self.num_heads + 2, D)` and cut at
    `[..., :-2, :]`, `[..., [-2], :]`, `[..., [-1], :]` (`kv_heads` is not used)."""
    config = tr.FalconConfig(
        vocab_size=VOCAB,
        hidden_size=HEAD_DIM * heads,
        num_hidden_layers=2,
        num_attention_heads=heads,
        new_decoder_architecture=False,
        multi_query=True,
        parallel_attn=True,
        bias=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return seeded(tr.FalconForCausalLM, config=config)


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
