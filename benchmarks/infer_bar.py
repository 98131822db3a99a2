"""The tracer's report card: how far `infer_plan` gets on the architectures transformers ships.

Run: `python benchmarks/infer_bar.py` (all of it, about 20 minutes on 2 cores; `--only
llama,gpt2` for a subset, `--part plan|noplan|time`, `--render` to re-print the last results
from benchmarks/results/infer_bar.json without running anything, short as
benchmarks/README.md shows them; `--render --full` prints every table, as the run writes them
to benchmarks/results/infer_bar.md).

The bar comes from the issue "Tracer", and this script reports it rather than asserting it:

1. plan: every model type whose config class ships a non-empty hand-written
   `base_model_tp_plan`, built on CPU from a shrunk config with random weights. For each:
   forward parity at tp 2 of `infer_plan(model, tp_size=2)` applied on simulated ranks against
   the unsharded model (max abs difference <= 1e-4 in fp32; where the forward needs more than
   token ids, the tracer and both runs get the benchmark's own inputs, `INPUTS`); parameter
   bytes per rank of our plan against what transformers' hand-written plan would shard; and
   how many modules our plan gives the same style as theirs, with every disagreement and our
   `why`.
2. noplan: popular architectures that ship no hand-written plan: the same parity, and
   parameter bytes per rank at tp 2 as a fraction of the model (target <= 0.6).
3. time: `infer_plan` on a Llama-3-405B-sized config on the meta device (target <= 2 s),
   and at a few depths to show how it grows.

The hand-written plans are read here as an oracle only (`model.tp_plan`, the plan
transformers itself would apply: `base_model_tp_plan` under the base model's prefix, the
head's `_tp_plan`, and the token embedding it adds on its own); nothing from them reaches
tpplan. Each architecture runs in a fresh subprocess (this same file with `--worker`), so a
crash or a hang costs one row, not the table. Start reading at `main`; the per-architecture
work is `_run_one`, the comparison with transformers' plan `_compare`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _common

HERE = Path(__file__).resolve().parent
NAME = "infer_bar"
RESULTS = HERE / "results" / f"{NAME}.json"
MARK = "INFER_BAR_RESULT "

# fp32 forward of a two-layer model: a sharded run sums the same products in another order,
# which moves the last bits only (~1e-6); a wrong shard or a missing reduction is off by O(0.1).
TOL = 1e-4
TP = 2
NOPLAN_TARGET = 0.6
TIME_TARGET_S = 2.0

# Popular architectures without a hand-written plan in transformers 5.23 (checked at run time:
# one that gains a plan is reported as such). The issue names the first twenty.
NOPLAN = [
    "gpt2", "opt", "bloom", "falcon", "gptj", "gpt_neo", "codegen", "mpt", "gpt_bigcode",
    "bert", "roberta", "deberta-v2", "albert", "electra", "t5", "bart", "whisper",
    "clip_text_model", "stablelm", "persimmon", "xglm", "biogpt", "distilbert", "xlm-roberta",
    "mbart", "pegasus", "mt5", "modernbert", "megatron-bert", "gpt_oss", "jetmoe", "openai-gpt",
]  # fmt: skip

# Encoders are built with their masked-LM head even where transformers also has a causal one.
ENCODERS = {
    "bert", "roberta", "deberta-v2", "albert", "electra", "distilbert", "xlm-roberta",
    "modernbert", "megatron-bert",
}  # fmt: skip

# ---- small configs --------------------------------------------------------------------------
# Generic config fields and their small values; each is set only where the config has the
# field (under this name or the one its attribute_map points to). Sub-configs (text, vision,
# audio) are shrunk the same way.
SMALL: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
    "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128,
    # encoder-decoders and older decoders
    "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "ffn_dim": 128, "d_ff": 128, "d_kv": 16,
    "n_inner": 128, "word_embed_proj_dim": 64, "embedding_size": 64,
    "max_source_positions": 16, "max_target_positions": 64, "num_mel_bins": 16,
    # mixtures of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "moe_num_experts": 4,
    "moe_k": 2, "moe_topk": 2, "top_k_experts": 2, "num_shared_experts": 1,
    # latent attention (DeepSeek style)
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16, "rotary_dim": 8,
    # linear attention and state-space layers
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_head_dim": 16,
    "mamba_d_state": 16, "ssm_state_size": 16, "mamba_dt_rank": 8, "time_step_rank": 8,
    # vision towers
    "image_size": 32, "patch_size": 8, "projection_dim": 64, "out_hidden_size": 64,
    "vision_output_dim": 64,
    # Gemma 3n/4 per-layer token embeddings
    "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16,
}  # fmt: skip

# Fields the modeling code reads even where the default config leaves them None (a None
# head_dim of Ministral, a None expert count of dots1): filled with the SMALL value (key/value
# heads: as many as query heads). Expert fields only for models that have experts.
FILL_NONE = {"head_dim", "num_key_value_heads", "sliding_window"}
FILL_NONE_EXPERTS = {
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "top_k_experts",
    "n_shared_experts",
    "moe_intermediate_size",
}

# Rotary sections for the small head (16 dims, 8 rotary pairs; GLM-4V MoE ropes half of them),
# where the modeling code would otherwise use its built-in sections for head_dim 128.
MROPE_SECTIONS = {
    "qwen2_vl_text": [2, 3, 3], "qwen2_5_vl_text": [2, 3, 3], "qwen2_5_omni_text": [2, 3, 3],
    "paddleocr_vl_text": [2, 3, 3], "glm4v_text": [2, 3, 3], "glm_image_text": [2, 3, 3],
    "glm_ocr_text": [2, 3, 3], "glm4v_moe_text": [1, 1, 2],
    # Ernie 4.5 VL: (height, width, time), interleaving height with width, so the first two match
    "ernie4_5_vl_moe_text": [3, 3, 2],
    # HunYuan-VL's default config names no sections, which its rotary embedding needs (a
    # TypeError at any size): four, adding up to the small head's rotary half
    "hunyuan_vl_text": [2, 2, 2, 2],
}  # fmt: skip

# Per-architecture fixes on top of SMALL, where the generic values do not build.
OVERRIDES: dict[str, dict[str, Any]] = {
    # no layer reads another's key/value cache (the default shares the last 15 of 35)
    "gemma3n_text": {"num_kv_shared_layers": 0},
    # attention every 2nd layer, experts every 2nd from the first (defaults: 1 in 8 layers)
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    # one global and one local attention layer (the default pattern is for 24 layers)
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # a mamba layer and an attention layer (the default is all mamba)
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # its default Mamba width (mamba_d_ssm 1024) must equal mamba_n_heads * mamba_d_head,
    # which SMALL sets to 8 * 16; transformers 5.24 validates it when the config is built
    "falcon_h1": {"mamba_d_ssm": 128},
    # sliding-window layers, but the default leaves the window unset
    "step3p5": {"sliding_window": 16},
    # its default leaves layer_types None, which its own modeling code cannot read
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # its default names no rope per layer type, which its own modeling code reads (a KeyError
    # at any size): rope on the sliding layers, none on the full ones, as its config allows
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": None,
        },
    },
    # its default leaves mlp_layer_types None, which its own modeling code indexes per layer:
    # a dense first layer and a sparse one, as DeepSeek models start
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"]},
    # its validator wants the adapter's input as wide as the tower (and its output as wide as
    # the text model's hidden size, here the same 64)
    "dots3_note_vision_encoder": {"adapter_in_dim": 64, "adapter_out_dim": 64},
    # its modeling code reads a shared expert's size that the config class does not declare
    # (checkpoints carry it as an extra field)
    "qwen3_omni_moe_talker_text": {"shared_expert_intermediate_size": 64},
    # its attention layers always build the QSA token indexer, whose fields the default leaves
    # unset (its validator wants all or none): a small indexer, one key head as it requires
    "qwen4_exp_text": {
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 4,
        "indexer_compress_ratio": 2,
    },
    # its sparse (DSA) attention takes no rope: the rope part of each head stays 0, which the
    # generic latent-attention sizes would make 8 and its validator rejects; its linear
    # attention and indexer heads have names of their own (64 heads of 128 by default)
    "glm5_next_text": {
        "qk_rope_head_dim": 0,
        "head_dim": 0,
        "linear_num_heads": 4,
        "linear_head_dim": 16,
        "index_n_heads": 4,
        "index_head_dim": 16,
    },
    # its audio tower is a pyramid of 4 resolutions, one entry per layer in each list, which
    # the validator checks: all 4 kept, narrower
    "muse_spark": {
        "audio_config": {"num_hidden_layers": 4, "hidden_sizes": [16, 16, 32, 32]},
        "projector_hidden_size": 64,
    },
    # halves of an encoder-decoder whose composite config hands them its dropout rate: built
    # alone, they need it given
    "t5_gemma_module": {"dropout_rate": 0.0},
    "t5gemma2_text": {"dropout_rate": 0.0},
    "t5gemma2_decoder": {"dropout_rate": 0.0},
    # the pixel shuffle (ratio 0.5) folds 2x2 patches into one of 4 x hidden_size features,
    # which the adapter's first layer takes as intermediate_size; its second layer is square
    "llama4_vision_model": {
        "intermediate_size": 256,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
    },
}
# the projector reads the tower's merged patches (64 wide, 2x2 merged); shrunk alike, it
# would read 64 and fail on any image; and a projector as narrow as the rest
OVERRIDES["muse_glimmer"] = {"out_hidden_size": 256, "projector_hidden_size": 128}
# the same tower inside the multimodal model (traced on its own there: see infer_plan)
OVERRIDES["llama4"] = {"vision_config": OVERRIDES["llama4_vision_model"]}

# ---- inputs beyond token ids ---------------------------------------------------------------
# tpplan's example_inputs makes up token ids, audio features or a batch of images from the
# forward signature. These forwards need more: patches already cut and packed with the grid
# they came from, a position per patch, or hidden states of the model they assist. Each is
# built from the small config, from a generator of its own, and given alike to infer_plan,
# the unsharded run and the sharded run, so all three follow the same path.
BATCH, SEQ = 2, 8


def _packed_patches(patch_dim: int, g: Any, key: str = "pixel_values") -> dict[str, Any]:
    """Qwen2-VL-style towers: every image's patches as rows of one 2-D tensor, and each
    image's (frames, height, width) in patches; 4x4 patches fit a 2x2 spatial merge."""
    import torch

    grid = torch.tensor([[1, 4, 4]] * BATCH)
    rows = int(grid.prod(-1).sum())
    return {key: torch.randn(rows, patch_dim, generator=g), "grid_thw": grid}


def _gemma4_vision(config: Any, g: Any) -> dict[str, Any]:
    """Patchified images and each patch's (x, y); 6x6 patches so the 3x3 pooling kernel
    leaves 4 soft tokens per image."""
    import torch

    side = 6
    xy = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1)
    return {
        "pixel_values": torch.rand(BATCH, side * side, 3 * config.patch_size**2, generator=g),
        "pixel_position_ids": xy.reshape(1, -1, 2).expand(BATCH, -1, -1).clone(),
    }


def _muse_glimmer_assistant(config: Any, g: Any) -> dict[str, Any]:
    """A draft model: embeddings of the block it denoises, and the target model's hidden
    states of the tokens before it, one slice per layer it reads."""
    import torch

    width = config.hidden_size * len(config.target_layer_ids)
    return {
        "noise_embeds": torch.randn(BATCH, config.block_size, config.hidden_size, generator=g),
        "context_hidden_states": torch.randn(BATCH, SEQ, width, generator=g),
    }


def _code_predictor(config: Any, g: Any) -> dict[str, Any]:
    """One generation step after the first: the step picks the embedding table and head."""
    import torch

    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "generation_steps": 1}


def _embeds(config: Any, g: Any) -> dict[str, Any]:
    """Embeddings in place of token ids."""
    import torch

    return {"inputs_embeds": torch.randn(BATCH, SEQ, config.hidden_size, generator=g)}


def _cross_attending(config: Any, g: Any) -> dict[str, Any]:
    """A decoder alone: its token ids and the encoder output it attends to."""
    import torch

    return {
        "input_ids": torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g),
        "encoder_hidden_states": torch.randn(BATCH, SEQ + 2, config.hidden_size, generator=g),
    }


def _ocr2_encoder(config: Any, g: Any) -> dict[str, Any]:
    """Image patch embeddings followed by the learned queries: attention is bidirectional
    over the first num_patches positions and causal after them."""
    return {**_embeds(config, g), "num_patches": SEQ // 2}


def _time_conditioned(config: Any, g: Any) -> dict[str, Any]:
    """Token ids and the time conditioning the model around it computes (an embedding of
    the delay, one vector for the batch) and every layer's norm reads."""
    import torch

    return {
        "input_ids": torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g),
        "t_cond": torch.randn(1, 1, config.hidden_size, generator=g),
    }


INPUTS: dict[str, Any] = {
    # patches with their (x, y), pooled 3x3 into soft tokens
    "gemma4_vision": _gemma4_vision,
    # packed patches of 2 frames each (patch_temporal) and their grid
    "muse_glimmer_vision": lambda c, g: _packed_patches(c.patch_temporal * 3 * c.patch_size**2, g),
    # packed patches of one frame, under the name hidden_states
    "ernie4_5_vl_moe_vision": lambda c, g: _packed_patches(
        c.in_channels * c.patch_size**2, g, key="hidden_states"
    ),
    # packed patches of one frame, as Qwen2-VL takes them
    "dots3_note_vision_encoder": lambda c, g: _packed_patches(c.num_channels * c.patch_size**2, g),
    # a speculative draft model: no token ids at all
    "muse_glimmer_assistant": _muse_glimmer_assistant,
    # fed embeddings by the talker around it: its own token path reads an embed_tokens it
    # does not have (its table is codec_embedding)
    "qwen3_omni_moe_talker_text": _embeds,
    # a decoder built alone attends to an encoder output it must be given
    "t5gemma2_decoder": _cross_attending,
    # embeddings of patches and queries, and where the patches end
    "deepseek_ocr2_encoder": _ocr2_encoder,
    # its layers' adaptive norms need the time conditioning, which only the outer model makes
    "voxtral_realtime_text": _time_conditioned,
    # token ids alone leave the generation step None
    "qwen3_omni_moe_talker_code_predictor": _code_predictor,
}


def _muse_glimmer_images(config: Any, g: Any) -> dict[str, Any]:
    """Text with one image per sequence: the image's packed patches and grid, and as many
    image tokens as the merged patches it yields."""
    import torch

    vision = config.vision_config
    patches = _packed_patches(
        vision.patch_temporal * 3 * vision.patch_size**2, g, key="pixel_values"
    )
    patches["image_grid_thw"] = patches.pop("grid_thw")
    per_image = int(patches["image_grid_thw"][0].prod()) // vision.merge_size**2
    ids = torch.randint(0, config.text_config.vocab_size, (BATCH, SEQ), generator=g)
    ids[:, 1 : 1 + per_image] = config.image_token_id
    return {"input_ids": ids, **patches}


# Inputs for the two runs only: infer_plan gets none and traces text alone, as a user's call
# would. The parts text does not reach (a vision tower and its projector) are then traced on
# their own, and these inputs check those decisions with numbers.
RUN_INPUTS: dict[str, Any] = {
    "muse_glimmer": _muse_glimmer_images,
}


def model_inputs(model_type: str, model: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Keyword inputs for the unsharded and the sharded run, and what to pass infer_plan as
    example_inputs: the same dict where INPUTS made it, else None (the tracer guesses its
    own from the forward signature, as a user's call would)."""
    import inspect

    import torch

    from tpplan._runtime.inputs import example_inputs

    make = INPUTS.get(model_type) or RUN_INPUTS.get(model_type)
    if make is not None:
        inputs = make(model.config, torch.Generator().manual_seed(0))
    else:
        inputs = example_inputs(model, batch=BATCH, seq=SEQ)
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False  # no cache to fill: not part of the math compared
    return inputs, inputs if model_type in INPUTS else None


_TOKEN_IDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
)
_ABSENT = object()


def _field(cls: type, name: str) -> str:
    return getattr(cls, "attribute_map", {}).get(name, name)


def _get(config: Any, name: str) -> Any:
    """A config field, _ABSENT when the config has none. A field a heterogeneous config
    (Gemma 4, dots3) holds per layer raises on a plain read: its global value is returned."""
    try:
        return getattr(config, name)
    except AttributeError:
        return _ABSENT
    except Exception:  # a per-layer field: its global value
        return config._getattr_without_heterogeneous_validation(name)


def _per_layer_overrides(config: Any) -> dict[int, dict[str, Any]]:
    """{layer: {field: value}} of a heterogeneous config (Gemma 4, dots3), else {}."""
    if "_heterogeneity_spec" not in vars(config):
        return {}
    from transformers.integrations.heterogeneity import configuration_utils as het

    return het._get_explicit_per_layer_overrides(config)


def _has_experts(default: Any) -> bool:
    plan = getattr(type(default), "base_model_tp_plan", None) or {}
    counts = [_get(default, n) for n in FILL_NONE_EXPERTS]
    return any("expert" in k for k in plan) or any(isinstance(c, int) and c > 1 for c in counts)


def _small_kwargs(default: Any, overrides: dict[str, Any], model_type: str = "") -> dict[str, Any]:
    """Constructor kwargs that shrink the config `default` (an instance of its class)."""
    from transformers import PretrainedConfig

    cls = type(default)
    kw: dict[str, Any] = {}
    subs = {n: v for n, v in vars(default).items() if isinstance(v, PretrainedConfig)}
    fill = FILL_NONE | (FILL_NONE_EXPERTS if _has_experts(default) else set())
    for name, value in SMALL.items():
        real = _field(cls, name)
        old = _get(default, real)
        if real in subs or old is _ABSENT or (old is None and name not in fill):
            continue
        if isinstance(getattr(cls, real, None), property):
            continue  # derived from other fields (Falcon's head_dim)
        # a per-layer list (Ernie 4.5 VL's expert sizes) gets the small value for each entry
        kw[real] = (
            [value] * len(old) if isinstance(old, list) and not isinstance(value, list) else value
        )
    # Keep grouped-query attention grouped: fewer key/value heads than query heads when the
    # full-size model has fewer (None means as many).
    heads, kv = _get(default, "num_attention_heads"), _get(default, "num_key_value_heads")
    if isinstance(heads, int) and (isinstance(kv, int) or kv is None):
        small_heads = kw.get(_field(cls, "num_attention_heads"), heads)
        kw[_field(cls, "num_key_value_heads")] = 2 if kv is not None and kv < heads else small_heads
    # Latent attention ropes only part of each head: there head_dim is the rope part.
    rope = _get(default, "qk_rope_head_dim")
    if isinstance(rope, int) and _get(default, "head_dim") == rope:
        kw["head_dim"] = SMALL["qk_rope_head_dim"]
    _shrink_rope_sections(default, kw, model_type)
    _shrink_layer_lists(default, kw)
    kw.update({k: v for k, v in overrides.items() if k not in subs})
    vocab = kw.get(_field(cls, "vocab_size"), _get(default, "vocab_size"))
    for name in _TOKEN_IDS:  # special token ids must fall inside the small vocab
        value = _get(default, name)
        if isinstance(value, int) and isinstance(vocab, int) and value >= vocab and name not in kw:
            kw[name] = vocab - 1
    for name, sub in subs.items():  # overrides name a sub-config's fields in a dict of their own
        # per-layer lists of the full-size sub-config would contradict the small layer count
        full = {k: v for k, v in sub.to_dict().items() if not _per_layer(sub, v)}
        kw[name] = {**full, **_small_kwargs(sub, overrides.get(name, {}))}
    return kw


def _per_layer(config: Any, value: Any) -> bool:
    layers = _get(config, "num_hidden_layers")
    return (
        isinstance(value, list) and isinstance(layers, int) and layers > 2 and len(value) == layers
    )


def _shrink_layer_lists(default: Any, kw: dict[str, Any]) -> None:
    """Hybrid models list a kind per layer (sliding/full attention, linear attention, dense
    or sparse MLP) or give layers fields of their own (heterogeneous configs): keep the first
    layer of every distinct combination, so each kind is traced (two layers of a hybrid with
    one full-attention layer in four would have none), and cut every per-layer list of the
    config to the same layers. Per-layer fields that SMALL shrinks take the small value."""
    layers = _get(default, "num_hidden_layers")
    if not isinstance(layers, int) or layers < 2:
        return
    lists = {
        name: value
        for name, value in vars(default).items()
        if isinstance(value, list) and len(value) == layers
        and not isinstance(getattr(type(default), name, None), property)  # Jamba's: derived
    }  # fmt: skip
    kinds = [n for n in lists if n.endswith("layer_types")]
    per_layer = _per_layer_overrides(default)
    if not kinds and not per_layer:
        return
    first: dict[str, int] = {}
    for i in range(layers):
        own = {k: v for k, v in per_layer.get(i, {}).items() if _field(type(default), k) not in kw}
        first.setdefault(repr(([lists[n][i] for n in kinds], sorted(own.items()))), i)
    keep = sorted(first.values())
    keep = keep * 2 if len(keep) == 1 else keep
    for name, value in lists.items():
        kw[name] = [value[i] for i in keep]
    if per_layer:
        kw["per_layer_config"] = {
            new: {k: kw.get(k, v) for k, v in per_layer.get(old, {}).items()}
            for new, old in enumerate(keep)
        }
    kw[_field(type(default), "num_hidden_layers")] = len(keep)


def _shrink_rope_sections(default: Any, kw: dict[str, Any], model_type: str) -> None:
    """Multimodal rope (Qwen2-VL, GLM-4V) splits each head's rotary dims into sections that
    must add up to the rotary half of the head: scale them to the small head. Where the
    default config leaves the sections to the modeling code (a built-in [16, 24, 24] for
    head_dim 128), MROPE_SECTIONS gives them."""
    rope = _get(default, "rope_parameters")
    if not isinstance(rope, dict):
        return
    if model_type in MROPE_SECTIONS:
        kw["rope_parameters"] = {**rope, "mrope_section": MROPE_SECTIONS[model_type]}
        return
    heads, hidden, old = (
        _get(default, n) for n in ("num_attention_heads", "hidden_size", "head_dim")
    )
    if (
        "mrope_section" not in repr(rope)
        or not isinstance(heads, int)
        or not isinstance(hidden, int)
    ):
        return
    old = old if isinstance(old, int) else hidden // heads
    new = kw.get("head_dim") or kw.get("hidden_size", hidden) // kw.get(
        "num_attention_heads", heads
    )

    def scaled(params: dict[str, Any]) -> dict[str, Any]:
        out = {k: scaled(v) if isinstance(v, dict) else v for k, v in params.items()}
        sections = params.get("mrope_section")
        if isinstance(sections, list) and sections:
            target = max(len(sections), round(sum(sections) * new / old))
            cut = [max(1, round(x * new / old)) for x in sections]
            cut[-1] += target - sum(cut)
            out["mrope_section"] = cut
        return out

    kw["rope_parameters"] = scaled(rope)


def small_config(model_type: str) -> Any:
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    return cls(**_small_kwargs(cls(), OVERRIDES.get(model_type, {}), model_type))


# Model classes the lookup below cannot find: no class declares the config (T5Gemma's encoder
# and decoder take the module config but are typed with the composite one).
MODEL_CLASSES = {"t5_gemma_module": "T5GemmaEncoder"}


def _modeling(config: Any) -> Any:
    """The modeling module of the config's family; None for a family that ships only a
    config (InternLM 3, IQuest-Coder: transformers builds them with Llama's classes)."""
    import importlib.util

    name = type(config).__module__.replace(".configuration_", ".modeling_")
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)


def model_class(model_type: str, config: Any) -> type:
    """The arch's main task class: seq2seq for encoder-decoders, masked LM for encoders,
    causal LM (or the multimodal one, for a composite config) for decoders, else the base
    model; for a config no auto class names, a model class of its own modeling module; for
    a family with no modeling module, the class the auto mapping names."""
    import transformers
    from transformers import PreTrainedModel
    from transformers.models.auto import modeling_auto as auto

    modeling = _modeling(config)
    if model_type in MODEL_CLASSES:
        return getattr(modeling, MODEL_CLASSES[model_type])
    kinds = ["CAUSAL_LM", "IMAGE_TEXT_TO_TEXT", "MULTIMODAL_LM", "MASKED_LM", ""]
    if model_type in ENCODERS:
        kinds = ["MASKED_LM", ""]
    if getattr(config, "is_encoder_decoder", False):
        kinds = ["SEQ_TO_SEQ_CAUSAL_LM", "SPEECH_SEQ_2_SEQ", *kinds]
    mapped = []
    for kind in kinds:
        mapping = getattr(
            auto, f"MODEL_FOR_{kind}_MAPPING_NAMES" if kind else "MODEL_MAPPING_NAMES"
        )
        name = mapping.get(model_type)
        name = name if isinstance(name, str) or not name else name[0]
        # some mapped classes are not exported at the top level (VoxtralRealtimeTextModel)
        cls = name and (getattr(transformers, name, None) or getattr(modeling, name, None))
        # Llama4ForCausalLM is the causal class of llama4 but takes its text config
        if cls and isinstance(config, cls.config_class):
            return cls
        mapped += [cls] if cls else []
    if modeling is None:
        # a config-only family: the class AutoModelForCausalLM would build it with
        if mapped:
            return mapped[0]
        raise LookupError(f"no model class for '{model_type}' and no modeling module")
    found = [
        c for c in vars(modeling).values()
        if isinstance(c, type) and issubclass(c, PreTrainedModel) and c.config_class is type(config)
    ]  # fmt: skip
    # stand-alone halves of a model (DeepSeek-OCR 2's vision encoder, T5Gemma 2's decoder)
    # have a class named for the half only
    suffixes = (
        "ForCausalLM",
        "ForConditionalGeneration",
        "ForMaskedLM",
        "Model",
        "Encoder",
        "Decoder",
    )
    for suffix in suffixes:
        for c in found:
            if c.__name__.endswith(suffix) and not c.__name__.endswith("PreTrainedModel"):
                return c
    raise LookupError(f"no model class for '{model_type}' ({type(config).__name__})")


def plan_archs() -> list[str]:
    """Model types whose config class ships a non-empty hand-written base_model_tp_plan."""
    from transformers import CONFIG_MAPPING

    return sorted(
        k for k in CONFIG_MAPPING if getattr(CONFIG_MAPPING[k], "base_model_tp_plan", None)
    )


# ---- transformers' plan, as an oracle -------------------------------------------------------
# Styles that split a module's parameters, and the dim each parameter is split on (None:
# the parameter stays whole), following transformers/distributed/tensor_parallel.py.
def _hf_shard_dim(style: str, pname: str, ndim: int) -> int | None:
    if style in ("colwise", "colwise_gather_output", "colwise_rep", "local_colwise"):
        return ndim - 2 if ndim > 1 else 0
    if style in ("rowwise", "rowwise_split_input", "rowwise_rep", "local_rowwise"):
        return None if pname == "bias" or ndim == 1 else ndim - 1
    if style == "packed_colwise":
        return ndim - 2 if ndim > 1 else ndim - 1
    if style == "packed_rowwise":
        return None if ndim == 1 else ndim - 1
    if style == "embedding_rowwise":
        return 0
    if style == "embedding_colwise":
        return 1
    return None  # replicate, replicated_with_grad_allreduce, moe_tp_experts, all_reduce, ...


# transformers' style names in tpplan's terms (a label both sides are compared by).
_HF_LABELS = {
    "colwise": "colwise",
    "local_colwise": "colwise",
    "colwise_gather_output": "colwise→replicate",
    "colwise_rep": "colwise→replicate",
    "rowwise": "rowwise",
    "local_rowwise": "rowwise",
    "rowwise_split_input": "rowwise(input replicate)",
    "rowwise_rep": "rowwise(input replicate)",
    "packed_colwise": "colwise(parts)",
    "replicated_with_grad_allreduce": "replicate_grad_sum",
    "embedding_rowwise": "vocab_parallel",
    "replicate": "replicate",
}


def _our_label(rule: Any) -> str:
    if rule is None or rule.style == "replicate":
        return "replicate"
    if rule.style == "colwise":
        if rule.output == "replicate":
            return "colwise→replicate"
        return "colwise(parts)" if rule.parts else "colwise"
    if rule.style == "rowwise" and rule.input == "replicate":
        return "rowwise(input replicate)"
    return rule.style


def _hf_plan(model: Any) -> dict[str, str]:
    """The plan transformers would apply to this model, patterns relative to the model."""
    plan = getattr(model, "tp_plan", None)
    if plan:
        return dict(plan)
    out = {
        f"{model.base_model_prefix}.{k}": v
        for k, v in (model.config.base_model_tp_plan or {}).items()
    }
    return {**out, **(getattr(type(model), "_tp_plan", None) or {})}


def _expand(plan: dict[str, str], names: list[str]) -> dict[str, str]:
    from tpplan.plan.patterns import match_names

    out: dict[str, str] = {}
    for pattern, style in plan.items():
        for n in match_names(pattern, names):
            out[n] = style
    return out


def _hf_bytes_per_rank(model: Any, hf: dict[str, str]) -> int:
    """Parameter bytes one rank would hold under transformers' plan at tp 2."""
    per_param: dict[int, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner, _, pname = name.rpartition(".")
        style = hf.get(name) or hf.get(owner)
        dim = _hf_shard_dim(style, pname, p.dim()) if style else None
        size = p.numel() * p.element_size()
        if dim is not None and p.shape[dim] > 0:
            size = size // p.shape[dim] * math.ceil(p.shape[dim] / TP)
        # a tied parameter is split when any of its owners splits it
        per_param[id(p)] = min(per_param.get(id(p), size), size)
    return sum(per_param.values())


def _compare(model: Any, plan: Any) -> dict[str, Any]:
    """Module for module: transformers' style against ours, on every module either side
    does not leave replicated."""
    from tpplan.plan.patterns import match_names, wildcard

    modules = [n for n, _ in model.named_modules() if n]
    params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    hf = _expand(_hf_plan(model), modules + params)
    ours: dict[str, Any] = {}
    for rule in plan.rules:
        for n in match_names(rule.match, modules):
            ours[n] = rule
    agree, total = 0, 0
    diffs: dict[tuple[str, str, str], dict[str, Any]] = {}
    for name in sorted(set(hf) | {n for n, r in ours.items() if r.style != "replicate"}):
        # a parameter named by transformers' plan is compared with the rule of its module
        rule = ours.get(name)
        if rule is None and name in params:
            rule = ours.get(name.rpartition(".")[0])
        theirs = _HF_LABELS.get(hf.get(name, "replicate"), f"hf:{hf.get(name)}")
        mine = _our_label(rule)
        if theirs == "replicate" and mine == "replicate":
            continue
        total += 1
        if theirs == mine:
            agree += 1
            continue
        key = (wildcard(name), theirs, mine)
        entry = diffs.setdefault(
            key, {"module": key[0], "theirs": theirs, "ours": mine, "count": 0}
        )
        entry["count"] += 1
        entry.setdefault("why", rule.why if rule is not None else "(no rule)")
    return {"agree": agree, "total": total, "disagreements": list(diffs.values())}


# ---- one architecture, in a worker process --------------------------------------------------
def _reason(e: BaseException) -> dict[str, str]:
    """One line for the table, and the deepest tpplan frame the error passed through."""
    text = " ".join(str(e).split())
    reason = f"{type(e).__name__}: {text}"[:300]
    where = ""
    for frame in traceback.extract_tb(e.__traceback__):
        if "/tpplan/" in frame.filename:
            where = f"tpplan/{frame.filename.rsplit('/tpplan/', 1)[1]}:{frame.lineno} {frame.name}"
    return {"reason": reason, "where": where}


def _bytes_per_rank(model: Any) -> int:
    """Parameter bytes the most loaded simulated rank holds once a plan is applied."""
    from torch.distributed.tensor import DTensor

    from tpplan._runtime.local import rank_values

    total = 0
    for p in model.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        total += max(v.numel() for v in rank_values(local)) * p.element_size()
    return total


def _max_diff(got: Any, want: Any) -> float:
    """Max abs difference over the simulated ranks (a DTensor is gathered whole first)."""
    from tpplan._runtime.local import rank_values

    worst = 0.0
    for value in rank_values(got):
        if value.shape != want.shape:
            return math.inf
        worst = max(worst, (value.detach().double() - want.detach().double()).abs().max().item())
    return worst


def _source_hash() -> str:
    """A hash of tpplan's sources as this worker imported them: others edit the tree while a
    run goes on, and rows made from different sources should say so."""
    import hashlib

    import tpplan

    digest = hashlib.sha1()
    for path in sorted(Path(tpplan.__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


def _run_one(model_type: str, part: str) -> dict[str, Any]:
    import copy

    import torch
    from transformers.utils import logging as hf_logging

    import tpplan
    from tpplan._runtime.local import simulated_ranks
    from tpplan._runtime.tree import first_tensor

    hf_logging.set_verbosity_error()
    res: dict[str, Any] = {"arch": model_type, "part": part, "source": _source_hash()}
    start = time.perf_counter()

    def fail(status: str, e: BaseException) -> dict[str, Any]:
        res.update(status=status, **_reason(e), seconds=round(time.perf_counter() - start, 2))
        return res

    try:
        config = small_config(model_type)
        cls = model_class(model_type, config)
        res["class"] = cls.__name__
        torch.manual_seed(0)
        model = cls(config).float().eval()
    except Exception as e:
        return fail("build failed", e)
    res["has_hf_plan"] = bool(getattr(type(config), "base_model_tp_plan", None))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    res["param_bytes"] = total
    if res["has_hf_plan"]:
        try:
            names = [n for n, _ in model.named_modules() if n] + [
                n for n, _ in model.named_parameters(remove_duplicate=False)
            ]
            res["theirs_fraction"] = (
                _hf_bytes_per_rank(model, _expand(_hf_plan(model), names)) / total
            )
        except Exception as e:
            res["theirs_error"] = _reason(e)["reason"]
    try:
        inputs, given = model_inputs(model_type, model)
        # the unsharded run: its output and the gradients of a loss on it
        ref = copy.deepcopy(model)
        want = first_tensor(ref(**inputs))
        if want is None:
            raise ValueError("the model returned no tensor")
        want.float().pow(2).mean().backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        want = want.detach()
    except Exception as e:
        return fail("reference failed", e)
    try:
        t0 = time.perf_counter()
        plan = tpplan.infer_plan(model, tp_size=TP, example_inputs=given)
        res["infer_s"] = round(time.perf_counter() - t0, 3)
    except Exception as e:
        return fail("infer failed", e)
    res["sharded_rules"] = sum(r.style != "replicate" for r in plan.rules)
    if res["has_hf_plan"]:
        try:
            res["compare"] = _compare(model, plan)
        except Exception as e:
            res["compare_error"] = _reason(e)["reason"]
    # forward parity is the bar; the gradients of the same loss are reported beside it
    with simulated_ranks(TP) as mesh:
        sharded = copy.deepcopy(model)
        try:
            tpplan.apply_plan(sharded, mesh, plan)
        except Exception as e:
            return fail("apply failed", e)
        res["ours_fraction"] = _bytes_per_rank(sharded) / total
        try:
            got = first_tensor(sharded(**inputs))
            res["fwd_diff"] = _max_diff(got, want)
        except Exception as e:
            return fail("sharded forward failed", e)
        try:
            got.float().pow(2).mean().backward()
            worst, rel, where = 0.0, 0.0, ""
            for name, p in sharded.named_parameters():
                if name not in ref_grads:
                    continue
                g, want_g = p.grad, ref_grads[name]
                err = math.inf if g is None else _max_diff(g, want_g)
                if err > worst:
                    scale = want_g.abs().max().item()
                    worst, rel, where = err, err / scale if scale else math.inf, name
            res["bwd_diff"], res["bwd_rel"], res["bwd_worst"] = worst, rel, where
        except Exception as e:
            res["bwd_error"] = _reason(e)["reason"]
    ok = res["fwd_diff"] <= TOL
    res["status"] = "ok" if ok else "parity failed"
    if not ok:
        res["reason"] = f"max abs diff {res['fwd_diff']:.3g} > {TOL}"
    res["seconds"] = round(time.perf_counter() - start, 2)
    return res


def _run_timing(layers: int) -> dict[str, Any]:
    """infer_plan on a Llama-3-405B-shaped model of `layers` layers on the meta device: the
    first call in a fresh process (what the CLI pays) and a second one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    import tpplan

    hf_logging.set_verbosity_error()
    config = LlamaConfig(
        hidden_size=16384, num_hidden_layers=layers, num_attention_heads=128,
        num_key_value_heads=8, intermediate_size=53248, vocab_size=128256,
    )  # fmt: skip
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    build = time.perf_counter() - t0
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        plan = tpplan.infer_plan(model, tp_size=8)
        times.append(time.perf_counter() - t0)
    return {
        "layers": layers,
        "params": sum(p.numel() for p in model.parameters()),
        "build_s": round(build, 3),
        "first_s": round(times[0], 3),
        "second_s": round(times[1], 3),
        "sharded_rules": sum(r.style != "replicate" for r in plan.rules),
    }


def _worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(HERE.parent))
    if args.part == "time":
        result = _run_timing(int(args.worker))
    else:
        result = _run_one(args.worker, args.part)
    print(MARK + json.dumps(result), flush=True)


# ---- the driver -----------------------------------------------------------------------------
def _spawn(task: tuple[str, str], timeout: float) -> dict[str, Any]:
    arch, part = task
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", arch, "--part", part]
    # two workers share two cores: one thread each, or they fight over both
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    base = {"arch": arch, "part": part} if part != "time" else {"layers": int(arch), "part": part}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {
            **base,
            "status": "timeout",
            "reason": f"no result within {timeout:.0f} s",
            "seconds": timeout,
        }
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
    return {
        **base,
        "status": "crashed",
        "reason": f"exit {proc.returncode}: {tail[0][:300]}",
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _fmt_diff(x: Any) -> str:
    return "" if x is None else ("inf" if x == math.inf else f"{x:.1e}")


def _bwd_wrong(r: dict[str, Any]) -> bool:
    """A parameter gradient off by a sizeable part of itself: not rounding. (Tiny gradients,
    ~1e-7, can be off by a few percent of themselves from summation order alone.)"""
    return r.get("bwd_rel", 0) > 1e-2 and r.get("bwd_diff", 0) > 1e-6


def _fmt_bwd(r: dict[str, Any]) -> str:
    if r.get("bwd_error"):
        return "error"
    text = _fmt_diff(r.get("bwd_diff"))
    if _bwd_wrong(r):
        text += f" ⚠ {'.'.join(r['bwd_worst'].split('.')[-2:])} rel {r['bwd_rel']:.2f}"
    return text


def _fmt_frac(x: Any) -> str:
    return "" if x is None else f"{x:.3f}"


def _note(r: dict[str, Any]) -> str:
    if r.get("status") == "ok":
        return ""
    text = r.get("reason", "")
    if r.get("where"):
        text += f" (at {r['where']})"
    return text.replace("|", "\\|")[:220]


def _render_plan(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| arch | class | status | fwd Δ | bwd Δ | ours/rank | theirs/rank | ≥ theirs | agree | infer s | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours, theirs = r.get("ours_fraction"), r.get("theirs_fraction")
        enough = (
            ""
            if ours is None or theirs is None or r.get("status") != "ok"
            else ("yes" if ours <= theirs + 1e-9 else "no")
        )
        cmp = r.get("compare")
        agree = f"{cmp['agree']}/{cmp['total']}" if cmp else ""
        out.append(
            f"| {r['arch']} | {r.get('class', '')} | {r['status']} | {_fmt_diff(r.get('fwd_diff'))} "
            f"| {_fmt_bwd(r)} | {_fmt_frac(ours)} | {_fmt_frac(theirs)} | {enough} "
            f"| {agree} | {r.get('infer_s', '')} | {_note(r)} |"
        )
    return out


def _render_noplan(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        f"| arch | class | status | fwd Δ | bwd Δ | params/rank | ≤ {NOPLAN_TARGET} | sharded rules | infer s | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        frac = r.get("ours_fraction")
        meets = (
            ""
            if frac is None or r.get("status") != "ok"
            else ("yes" if frac <= NOPLAN_TARGET else "no")
        )
        note = _note(r) or ("has a hand-written plan now" if r.get("has_hf_plan") else "")
        out.append(
            f"| {r['arch']} | {r.get('class', '')} | {r['status']} | {_fmt_diff(r.get('fwd_diff'))} "
            f"| {_fmt_bwd(r)} | {_fmt_frac(frac)} | {meets} | {r.get('sharded_rules', '')} "
            f"| {r.get('infer_s', '')} | {note} |"
        )
    return out


def _render_disagreements(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| arch | module | n | theirs | ours | our why |", "|---|---|---|---|---|---|"]
    for r in rows:
        for d in (r.get("compare") or {}).get("disagreements", []):
            why = " ".join(d["why"].split()).replace("|", "\\|")[:160]
            out.append(
                f"| {r['arch']} | {d['module']} | {d['count']} | {d['theirs']} | {d['ours']} | {why} |"
            )
    return out


def _render_pairs(rows: list[dict[str, Any]]) -> list[str]:
    """Disagreements counted by (theirs, ours) over all architectures."""
    modules: Counter[tuple[str, str]] = Counter()
    archs: dict[tuple[str, str], list[str]] = defaultdict(list)
    for r in rows:
        for d in (r.get("compare") or {}).get("disagreements", []):
            key = (d["theirs"], d["ours"])
            modules[key] += d["count"]
            if r["arch"] not in archs[key]:
                archs[key].append(r["arch"])
    out = ["| theirs | ours | modules | archs | e.g. |", "|---|---|---|---|---|"]
    for key, n in modules.most_common():
        out.append(
            f"| {key[0]} | {key[1]} | {n} | {len(archs[key])} | {', '.join(archs[key][:4])} |"
        )
    return out


def _failure_class(r: dict[str, Any]) -> str:
    """A failure's reason with names and numbers taken out, so like failures group."""
    reason = r.get("reason", "")
    if r["status"] == "parity failed":
        return "parity failed"
    # the tracer's wrapper names the model; what went wrong is the inner error
    reason = re.sub(
        r"^TraceError: could not run \S+ on fake tensors to trace it \(", "trace: ", reason
    )
    reason = re.sub(r"\)\. Pass example_inputs .*$", "", reason)
    reason = re.sub(
        r"\b\w+(ForCausalLM|ForConditionalGeneration|ForMaskedLM|Model|Config)\b", "<model>", reason
    )
    reason = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", reason)
    reason = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", reason)
    where = f" @ {r['where'].split(':')[0]}" if r.get("where") else ""
    return f"{r['status']}: {reason[:120]}{where}"


def _render_failures(rows: list[dict[str, Any]]) -> list[str]:
    groups: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if r.get("status") != "ok":
            groups[_failure_class(r)].append(r.get("arch", str(r.get("layers"))))
        elif _bwd_wrong(r):
            groups["forward at parity, a gradient wrong (see bwd Δ)"].append(r["arch"])
    out = ["| failure | archs | e.g. |", "|---|---|---|"]
    for key, archs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        key = key.replace("|", "\\|")
        out.append(f"| {key} | {len(archs)} | {', '.join(archs[:4])} |")
    return out


def _render_time(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| layers | params | build s | infer s (first call) | infer s (second) | s / layer | ≤ 2 s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["layers"]):
        if "first_s" not in r:
            out.append(f"| {r['layers']} | | | {r['status']}: {r.get('reason', '')} | | | |")
            continue
        meets = "yes" if r["first_s"] <= TIME_TARGET_S else "no"
        out.append(
            f"| {r['layers']} | {r['params'] / 1e9:.0f} B | {r['build_s']:.2f} | {r['first_s']:.2f} "
            f"| {r['second_s']:.2f} | {r['first_s'] / r['layers']:.3f} | {meets} |"
        )
    return out


def _summary(rows: list[dict[str, Any]], part: str) -> str:
    n = len(rows)
    ok = [r for r in rows if r["status"] == "ok"]
    built = [r for r in rows if r["status"] != "build failed"]
    wrong = [r["arch"] for r in ok if _bwd_wrong(r)]
    text = f"{n} archs, {len(built)} built, {len(ok)} at parity (fwd Δ ≤ {TOL})"
    text += f" (of which {len(wrong)} with a wrong gradient: {', '.join(wrong)})" if wrong else ""
    if part == "plan":
        enough = [r for r in ok if r.get("ours_fraction", 9) <= r.get("theirs_fraction", -1) + 1e-9]
        agree = sum((r.get("compare") or {}).get("agree", 0) for r in rows)
        total = sum((r.get("compare") or {}).get("total", 0) for r in rows)
        full = [
            r for r in rows if r.get("compare") and r["compare"]["agree"] == r["compare"]["total"]
        ]
        text += (
            f", {len(enough)} at parity and sharding at least as much as the hand-written plan; "
            f"modules agreeing with it: {agree}/{total}; archs agreeing on every module: {len(full)}"
        )
    elif part == "noplan":
        meets = [r for r in ok if r.get("ours_fraction", 9) <= NOPLAN_TARGET]
        text += f", {len(meets)} at parity with params/rank ≤ {NOPLAN_TARGET}"
    return text + "."


def render(results: dict[str, Any]) -> str:
    lines = [
        f"tpplan {results.get('tpplan', '?')}; transformers {results.get('transformers', '?')}, "
        f"torch {results.get('torch', '?')}; tp {TP}.",
        "",
    ]
    plan = results.get("plan", [])
    noplan = results.get("noplan", [])
    sources = Counter(r.get("source", "?") for r in plan + noplan)
    if len(sources) > 1:
        lines += [
            f"Rows come from {len(sources)} states of tpplan's sources (edited during the run): "
            + ", ".join(f"{h} ({n} rows)" for h, n in sources.most_common()),
            "",
        ]
    if plan:
        lines += ["### 1. Architectures with a hand-written plan", "", _summary(plan, "plan"), ""]
        every, kinds, each = _render_plan(plan), _render_pairs(plan), _render_disagreements(plan)
        summary = (
            f"Every architecture ({len(every) - 2} rows), the disagreements by kind "
            f"({len(kinds) - 2} rows) and every disagreement ({len(each) - 2} rows)"
        )
        tables = [*every, "", "Disagreements by kind (theirs → ours):", "", *kinds, ""]
        tables += ["Every disagreement (module patterns; n = modules):", "", *each]
        lines += [*_common.fold(summary, tables), ""]
    if noplan:
        lines += [
            "### 2. Architectures without a hand-written plan",
            "",
            _summary(noplan, "noplan"),
            "",
        ]
        table = _render_noplan(noplan)
        lines += [*_common.fold(f"Every architecture ({len(table) - 2} rows)", table), ""]
    if plan or noplan:
        lines += ["### Failure classes (both tables)", "", *_render_failures(plan + noplan), ""]
    if results.get("time"):
        lines += ["### 3. Inference time, Llama-3-405B shape on the meta device (tp 8)", ""]
        lines += [*_render_time(results["time"]), ""]
    return "\n".join(lines)


def _revision() -> str:
    """The commit the results were made at, and the tpplan files changed since (read only)."""

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=HERE.parent)
        return run.stdout

    changed = [ln[3:] for ln in git("status", "--porcelain", "tpplan").splitlines()]
    return git("rev-parse", "--short", "HEAD").strip() + (
        f" + changes to {', '.join(changed)}" if changed else ""
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types (e.g. llama,gpt2)")
    parser.add_argument(
        "--part",
        choices=["plan", "noplan", "time"],
        action="append",
        help="repeatable; default all",
    )
    parser.add_argument("--jobs", type=int, default=2, help="workers at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per architecture")
    parser.add_argument("--depths", default="8,32,64,126", help="layers for the timing part")
    _common.render_flags(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(argparse.Namespace(worker=args.worker, part=args.part[0]))
        return
    if args.render:
        print(_common.rendered(render(json.loads(RESULTS.read_text())), NAME, full=args.full))
        return

    import torch
    import transformers

    parts = args.part or ["plan", "noplan", "time"]
    only = set(args.only.split(",")) if args.only else None
    tasks: list[tuple[str, str]] = []
    if "plan" in parts:
        tasks += [(a, "plan") for a in plan_archs() if only is None or a in only]
    if "noplan" in parts:
        tasks += [(a, "noplan") for a in NOPLAN if only is None or a in only]
    # merge into earlier results, so a subset run updates its rows only
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results.update(
        transformers=transformers.__version__, torch=torch.__version__, tpplan=_revision()
    )
    done: dict[tuple[str, str], dict[str, Any]] = {}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for r in pool.map(lambda t: _spawn(t, args.timeout), tasks):
            done[(r["arch"], r["part"])] = r
            print(f"[{time.perf_counter() - t0:6.0f}s] {r['part']:6} {r['arch']:32} {r['status']:22} {_note(r)[:100]}",
                  file=sys.stderr, flush=True)  # fmt: skip
    wanted = {"plan": set(plan_archs()), "noplan": set(NOPLAN)}
    for part in ("plan", "noplan"):
        # rows of archs no longer listed go; so do all old rows of a part run in full
        old = [] if part in parts and only is None else results.get(part, [])
        rows = {r["arch"]: r for r in old if r["arch"] in wanted[part]}
        rows.update({a: r for (a, p), r in done.items() if p == part})
        if rows:
            results[part] = [rows[a] for a in sorted(rows)]
    if "time" in parts and only is None:
        # one at a time: the timings are the point, so nothing else runs beside them
        results["time"] = [_spawn((d, "time"), 600) for d in args.depths.split(",")]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    _common.save_tables(render(results), NAME)
    print(_common.rendered(render(results), NAME))


if __name__ == "__main__":
    main()
