"""The shipped plans (plans/**/*.yaml) and a small model of each one's family, for every test
that runs them: test_shipped.py (parity at two widths) and test_generate.py (the generate
matrix on gloo ranks, through generate_ranks.py). Start at `PLANS` and `plan_spec`."""

from __future__ import annotations

import shlex
from pathlib import Path

from tpplan import cli
from tpplan._runtime.models import parse_overrides
from tpplan.plan import load_plan

__all__ = ["HEADS_64", "OTHER", "PLANS", "ROOT", "SMALL", "WIDTHS", "generate_config", "plan_spec"]

ROOT = Path(__file__).resolve().parents[2]
PLANS = sorted((ROOT / "plans").rglob("*.yaml"))

# A small model of each plan's family: the config of the command that wrote the plan, with
# these fields on top. The widths a plan names (head_dim, fused parts) stay as they are;
# layers, heads, experts and the vocab shrink.
_LAYERS = {"num_hidden_layers": 2, "vocab_size": 512}
_HEADS_128 = {
    "hidden_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
}
SMALL: dict[str, dict[str, object]] = {
    "llama": {**_LAYERS, **_HEADS_128, "intermediate_size": 256},
    "mistral": {**_LAYERS, **_HEADS_128, "intermediate_size": 256},
    "qwen2": {**_LAYERS, "hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256},
    "qwen3": {**_LAYERS, **_HEADS_128, "intermediate_size": 256},
    # the experts' fused gate|up pieces are the plan's [14336, 14336]: one layer, two experts
    "mixtral": {**_HEADS_128, "num_hidden_layers": 1, "vocab_size": 512, "num_local_experts": 2, "num_experts_per_tok": 1},
    "qwen3_moe": {**_LAYERS, **_HEADS_128, "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 256},
    "gemma2": {**_LAYERS, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256},
    "gemma3": {**_LAYERS, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256},
    # the fused pieces are the plan's, q|k|v [3072] * 3 (its attention is a DTensor region)
    # and gate|up [8192] * 2: one layer
    "phi3": {"num_hidden_layers": 1, "vocab_size": 512, "hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32, "pad_token_id": 0, "eos_token_id": 0},
    "gpt2": {"n_layer": 2, "vocab_size": 512},
    # their plans name no width; heads of 128 and 64 as GPT-NeoX-20B's and Falcon-7B's (at
    # the configs' own widths, 6144 and 4544, these two were 300-400M parameters: two minutes)
    "gpt_neox": {**_LAYERS, "hidden_size": 1024, "num_attention_heads": 8, "intermediate_size": 256},
    "falcon": {**_LAYERS, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 256},
    "opt": {**_LAYERS, "ffn_dim": 256},
    "bloom": {"n_layer": 2, "vocab_size": 512},
    "bert": {**_LAYERS, "intermediate_size": 256},
    "t5": {"num_layers": 2, "num_decoder_layers": 2, "vocab_size": 512, "d_ff": 256},
    "deepseek_v3": {
        **_LAYERS, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 256, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    },
}  # fmt: skip

# A second width of each family: another head_dim, hidden size or fused width than SMALL
# (the same layers and vocab, so only widths differ), which the plan, leaving those sizes out,
# reads from the model. phi3's fused q|k|v stays at the plan's [3072] * 3: its forward cuts
# them by slices, which the trace does not read as pieces, so the plan states them.
HEADS_64 = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
OTHER: dict[str, dict[str, object]] = {
    "llama": {**SMALL["llama"], **HEADS_64, "intermediate_size": 128},
    "mistral": {**SMALL["mistral"], **HEADS_64, "intermediate_size": 128},
    "qwen2": {**SMALL["qwen2"], "hidden_size": 256, "intermediate_size": 128},
    "qwen3": {**SMALL["qwen3"], **HEADS_64, "intermediate_size": 128},
    "mixtral": {**SMALL["mixtral"], **HEADS_64, "intermediate_size": 128},
    "qwen3_moe": {**SMALL["qwen3_moe"], **HEADS_64, "moe_intermediate_size": 128},
    "gemma2": {**SMALL["gemma2"], "head_dim": 64, "intermediate_size": 128},
    "gemma3": {**SMALL["gemma3"], "head_dim": 64, "intermediate_size": 128},
    "phi3": {**SMALL["phi3"], "intermediate_size": 1024},
    "gpt2": {**SMALL["gpt2"], "n_embd": 256, "n_head": 8},
    "gpt_neox": {**SMALL["gpt_neox"], "hidden_size": 256, "num_attention_heads": 4},
    "falcon": {**SMALL["falcon"], "hidden_size": 256, "num_attention_heads": 8},
    "opt": {**SMALL["opt"], "hidden_size": 256, "num_attention_heads": 4, "word_embed_proj_dim": 256},
    "bloom": {**SMALL["bloom"], "hidden_size": 256, "n_head": 4},
    "bert": {**SMALL["bert"], "hidden_size": 256, "num_attention_heads": 8},
    "t5": {**SMALL["t5"], "d_model": 256, "d_kv": 32, "num_heads": 4},
    "deepseek_v3": {
        **SMALL["deepseek_v3"], "moe_intermediate_size": 128, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32,
    },
}  # fmt: skip
WIDTHS = {"small": SMALL, "other": OTHER}


def plan_spec(path: Path) -> tuple[str, dict[str, object]]:
    """MODEL and --set fields of the command a shipped plan records."""
    plan = load_plan(path)
    assert plan.model is not None and plan.model.command, f"{path.name} records no command"
    args = cli._parser().parse_args(shlex.split(plan.model.command)[1:])
    return args.model, parse_overrides(args.overrides)


# The model `generate` runs on: OTHER's widths, one layer where a second adds no other kind
# of layer (DeepSeek-V3's first is dense, its second has experts; Gemma's alternate sliding
# and full attention), and a sliding window of 4 tokens where the family has one, so that
# a 5-token prompt and 6 new tokens slide past it. Every layer costs apply_plan's dry run.
_ONE_LAYER = {"num_hidden_layers": 1}
_SLIDING = {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
_GENERATE: dict[str, dict[str, object]] = {
    # the plan's q|k|v pieces of 3072 as 4 heads of 768 (key/value heads not shared), on a
    # stream of 256 features: 3.5M parameters where OTHER's 3072 features make 50M
    "phi3": {
        **_ONE_LAYER,
        "hidden_size": 256,
        "head_dim": 768,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
    },
    "t5": {"num_layers": 1, "num_decoder_layers": 1},
    # a decoder (causal, with a cache), as BertLMHeadModel is used for generation
    "bert": {**_ONE_LAYER, "is_decoder": True},
    "gpt2": {"n_layer": 1},
    "bloom": {"n_layer": 1},
    "deepseek_v3": {},
    "gemma2": _SLIDING,
    "gemma3": _SLIDING,
    "mistral": {**_ONE_LAYER, "sliding_window": 4},
}


def generate_config(name: str) -> dict[str, object]:
    """The config fields of the model `generate` runs on for plan `name` (see _GENERATE)."""
    return {**OTHER[name], **_GENERATE.get(name, _ONE_LAYER)}
