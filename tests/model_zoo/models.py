"""The zoo's models: each built tiny from its own package's classes, with random weights and
no download, and the inputs its forward takes.

`ZOO` maps a name ("torchtitan.llama3") to an `Entry`: how to build the model and its
inputs, and which of its modules are attention and MLP blocks. `build(name)` makes one.

The sizes are the published models' shapes shrunk until a forward and backward on simulated
ranks take about a second, keeping what a tp split depends on: every head count and every
MLP width divisible by 4, so tp 2 and tp 4 both split them, and at least two blocks per
stack where the package allows it (tpplan traces the first blocks of a long stack and
repeats their rules; two blocks check the repeat). Head counts differ from the
published ones where those divide by no tp size (ViT-Tiny's 3).

The packages are imported inside the builders, so this module imports without them.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .clip import Clip
from .nanogpt import NanoGpt
from .torchvision_stub import use_if_broken

__all__ = ["ZOO", "Entry", "Inputs", "build"]

Inputs = torch.Tensor | dict[str, Any]
"""What the model's forward takes: one positional tensor, or keyword inputs."""

BATCH = 2


def _generator() -> torch.Generator:
    """Inputs come from a generator of their own: building one moves no global RNG."""
    return torch.Generator().manual_seed(1)


# ---- torchtitan 0.2.2 ---------------------------------------------------------------------
_TITAN = {
    # name: (model class, its args dataclass), both in torchtitan.models.<name>.model
    "llama3": ("Transformer", "TransformerModelArgs"),
    "qwen3": ("Qwen3Model", "Qwen3ModelArgs"),
    "deepseek_v3": ("DeepSeekV3Model", "DeepSeekV3ModelArgs"),
    "llama4": ("Transformer", "TransformerModelArgs"),
}


def _titan(name: str, **args: Any) -> tuple[nn.Module, Inputs]:
    """A torchtitan model from its own args dataclass, initialized by its own
    `init_weights` (what torchtitan's trainer calls after building on the meta device)."""
    model_cls, args_cls = _TITAN[name]
    model_args = getattr(importlib.import_module(f"torchtitan.models.{name}.model.args"), args_cls)
    cls = getattr(importlib.import_module(f"torchtitan.models.{name}.model.model"), model_cls)
    model = cls(model_args(**args))
    with torch.no_grad():
        model.init_weights()
    tokens = torch.randint(0, args["vocab_size"], (BATCH, 16), generator=_generator())
    return model, tokens


def _llama3() -> tuple[nn.Module, Inputs]:
    """Grouped-query attention (8 query heads of 8, 4 key/value heads), SwiGLU MLP (its
    hidden size rounds up to torchtitan's multiple_of, 256), complex-number rotary."""
    return _titan(
        "llama3", dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=128, max_seq_len=64
    )


def _qwen3() -> tuple[nn.Module, Inputs]:
    """Heads wider than dim / n_heads (8 of 16 on a 64-wide model), RMSNorm on q and k per
    head, and the token embedding tied to the output head."""
    return _titan(
        "qwen3", dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, hidden_dim=96,
        qk_norm=True, vocab_size=128, max_seq_len=64, enable_weight_tying=True,
    )  # fmt: skip


def _deepseek_v3() -> tuple[nn.Module, Inputs]:
    """Multi-head latent attention (keys and values through a rank-16 bottleneck, a rotary
    part and a plain part per head) with every layer dense: torchtitan's mixture-of-experts
    layer counts tokens per expert with torch.histc on integer tensors, which has no CPU
    kernel, so a MoE layer cannot run forward here (n_dense_layers = n_layers)."""
    return _titan(
        "deepseek_v3", dim=64, n_layers=2, n_dense_layers=2, n_heads=4, inter_dim=128,
        vocab_size=128, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, max_seq_len=64,
    )  # fmt: skip


class _IntegerHistc(TorchFunctionMode):
    """torch.histc of an integer tensor, as CUDA computes it: CPU has no integer kernel."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.histc and not args[0].is_floating_point():
            return torch.histc(args[0].float(), *args[1:], **(kwargs or {})).to(args[0].dtype)
        return func(*args, **(kwargs or {}))


_ON_CPU: dict[type, type] = {}


def _counting_on_cpu(module: nn.Module) -> None:
    """Run `module`'s forward under `_IntegerHistc` (a subclass in its class's place, which
    copies of the model keep; the numbers are the ones CUDA computes)."""
    cls = type(module)
    if cls not in _ON_CPU:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            with _IntegerHistc():
                return cls.forward(self, *args, **kwargs)

        _ON_CPU[cls] = type(cls.__name__, (cls,), {"forward": forward})
    module.__class__ = _ON_CPU[cls]


def _llama4() -> tuple[nn.Module, Inputs]:
    """Llama 4's mixture of experts in every layer: 4 routed experts (grouped, one
    `_grouped_mm` over tokens padded per expert with `new_empty`), 1 chosen per token, one
    shared expert, grouped-query attention (8 heads, 4 key/value heads). Two CPU stand-ins,
    numbers unchanged: the router counts tokens per expert with torch.histc on integers,
    which has no CPU kernel (`_IntegerHistc`), and the padding of tokens per expert takes
    torchtitan's own CPU path (`use_cpu=True`) where it would launch a triton kernel."""
    import torchtitan.models.moe.utils as moe_utils
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter, TokenReorderer

    padding = moe_utils.generate_permute_indices
    if not isinstance(padding, functools.partial):
        moe_utils.generate_permute_indices = functools.partial(padding, use_cpu=True)
    model, tokens = _titan(
        "llama4", dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=128, max_seq_len=64,
        multiple_of=16, interleave_moe_layer_step=1,
        moe_args=MoEArgs(num_experts=4, num_shared_experts=1, top_k=1, use_grouped_mm=True),
    )  # fmt: skip
    for m in model.modules():
        if isinstance(m, (TokenChoiceTopKRouter, TokenReorderer)):
            _counting_on_cpu(m)
    return model, tokens


# ---- timm 1.0.31 --------------------------------------------------------------------------
def _timm(name: str, **args: Any) -> tuple[nn.Module, Inputs]:
    use_if_broken()  # timm imports torchvision: see torchvision_stub.py
    import timm

    sized = {} if "convnext" in name else {"img_size": 32}  # ConvNeXt takes any size
    model = timm.create_model(name, pretrained=False, num_classes=10, **sized, **args)
    images = torch.randn(BATCH, 3, 32, 32, generator=_generator())
    return model, images


def _vit() -> tuple[nn.Module, Inputs]:
    """vit_tiny_patch16_224 at its own width (192), 2 blocks of 4 heads of 48 (ViT-Tiny's 3
    heads divide by no tp size) on 16 patches of 8x8 and a class token; timm's fused qkv
    Linear cut by reshape and unbind. Narrower, the patch embedding (kept whole) would weigh
    more against the blocks than in any published ViT."""
    return _timm("vit_tiny_patch16_224", patch_size=8, depth=2, num_heads=4)


def _swin() -> tuple[nn.Module, Inputs]:
    """swin_tiny_patch4_window7_224, two stages of two blocks (4 then 8 heads of 8), windows
    of 4x4 patches, shifted in every second block, a patch merge between the stages.
    drop_path_rate 0: Swin's default drops residual paths at random, so two forwards differ."""
    return _timm(
        "swin_tiny_patch4_window7_224", window_size=4, embed_dim=32, depths=(2, 2),
        num_heads=(4, 8), drop_path_rate=0.0,
    )  # fmt: skip


def _convnext(conv_mlp: bool) -> tuple[nn.Module, Inputs]:
    """convnext_atto's layout at a quarter of its width (16, 32, 64, 128 channels), two
    blocks per stage: a 7x7 depthwise convolution, a norm over the channels, then the MLP
    (4x the channels, GELU). With `conv_mlp` (timm's default for atto to nano) the MLP is two
    1x1 convolutions on (B, C, H, W); without (tiny and up) two Linear layers on the
    channels-last (B, H, W, C) tensor."""
    return _timm(
        "convnext_atto", dims=(16, 32, 64, 128), depths=(2, 2, 2, 2), conv_mlp=conv_mlp,
        drop_path_rate=0.0,
    )  # fmt: skip


# ---- transformers (tpplan's own dependency, not pinned by the zoo extra) ---------------------
_TRANSFORMERS = f"transformers {metadata.version('transformers')}"


def _hf_deepseek_v3() -> tuple[nn.Module, Inputs]:
    """transformers' DeepSeek-V3, the other implementation of torchtitan's above: latent
    attention with a latent projection for queries as well as keys and values (ranks 32
    and 16), one dense layer then one mixture-of-experts layer (4 routed experts of 32, 2
    per token, one shared expert), whose experts' grouped matmul runs on CPU in fp32."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        num_hidden_layers=2, first_k_dense_replace=1, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, vocab_size=128,
    )  # fmt: skip
    model = DeepseekV3ForCausalLM(config)
    return model, torch.randint(0, 128, (BATCH, 16), generator=_generator())


def _hf_olmo2() -> tuple[nn.Module, Inputs]:
    """transformers' OLMo-2: q and k each normalized by an RMSNorm over every head's
    features at once (a module of its own, in float32), after the projections and before
    the heads are cut; 4 heads of 16, a SwiGLU MLP."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    config = Olmo2Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = Olmo2ForCausalLM(config)
    return model, torch.randint(0, 128, (BATCH, 16), generator=_generator())


def _hf_gpt_bigcode() -> tuple[nn.Module, Inputs]:
    """transformers' GPT-BigCode with multi-query attention: q|k|v in one Linear of unequal
    pieces (4 query heads of 16, then one key head and one value head), cut by `split` at
    attribute sizes; the key and value stay (B, 1, T, D), one head every query head reads."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    config = GPTBigCodeConfig(
        vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, multi_query=True,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    model = GPTBigCodeForCausalLM(config)
    return model, torch.randint(0, 128, (BATCH, 16), generator=_generator())


def _hf_phi3_medium() -> tuple[nn.Module, Inputs]:
    """transformers' Phi-3 shaped as Phi-3-medium: grouped-query attention in one fused
    qkv_proj of unequal pieces (8 query heads of 8, 2 key/value heads), sliced at bounds
    computed from the config every layer shares (`self.config.num_attention_heads *
    self.head_dim`), heads viewed with -1; gate|up fused, cut by chunk."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    model = Phi3ForCausalLM(config)
    return model, torch.randint(0, 128, (BATCH, 16), generator=_generator())


# ---- diffusers 0.42.1 ---------------------------------------------------------------------
def _flux() -> tuple[nn.Module, Inputs]:
    """FluxTransformer2DModel: one double-stream block (image and text tokens, each with its
    own projections, in one joint attention) and one single-stream block (attention and MLP
    side by side, one proj_out over both), 4 heads of 16, rotary positions from token ids."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=False, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    g = _generator()
    inputs: dict[str, Any] = {
        "hidden_states": torch.randn(BATCH, 16, 16, generator=g),  # 16 image tokens (packed)
        "encoder_hidden_states": torch.randn(BATCH, 8, 32, generator=g),  # 8 text tokens
        "pooled_projections": torch.randn(BATCH, 32, generator=g),
        "timestep": torch.tensor([0.5, 0.7]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
        "return_dict": False,
    }
    return model, inputs


def _sd3() -> tuple[nn.Module, Inputs]:
    """SD3Transformer2DModel: two joint blocks (the last one updates image tokens only), 4
    heads of 16, 2x2 patches of an 8x8 latent with cropped learned positions."""
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64,
        pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16,
    )  # fmt: skip
    g = _generator()
    inputs: dict[str, Any] = {
        "hidden_states": torch.randn(BATCH, 4, 8, 8, generator=g),  # (B, C, H, W) latent
        "encoder_hidden_states": torch.randn(BATCH, 8, 32, generator=g),
        "pooled_projections": torch.randn(BATCH, 32, generator=g),
        "timestep": torch.tensor([10, 20]),
        "return_dict": False,
    }
    return model, inputs


def _unet() -> tuple[nn.Module, Inputs]:
    """UNet2DConditionModel: two resolutions of 32 and 64 channels (GroupNorms of 8 groups),
    one resnet per down block and two per up block (3x3 convolutions, the time embedding
    added per channel, a 1x1 shortcut where the channels change), a cross-attention
    transformer at 32 channels (heads of 8) and in the mid block, text of 6 tokens."""
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=8,
    )  # fmt: skip
    g = _generator()
    inputs: dict[str, Any] = {
        "sample": torch.randn(BATCH, 4, 8, 8, generator=g),
        "timestep": torch.tensor([10, 20]),
        "encoder_hidden_states": torch.randn(BATCH, 6, 32, generator=g),
        "return_dict": False,
    }
    return model, inputs


# ---- nanoGPT --------------------------------------------------------------------------------
def _nanogpt() -> tuple[nn.Module, Inputs]:
    """nanoGPT has no pip package: model_zoo/nanogpt.py is upstream's model.py by hand. Two
    blocks of 4 heads of 8 on a 32-wide model."""
    model = NanoGpt(n_layer=2, n_head=4, n_embd=32, block_size=16)
    return model, torch.randint(0, 64, (BATCH, 8), generator=_generator())


# ---- CLIP on nn.MultiheadAttention -----------------------------------------------------------
def _clip() -> tuple[nn.Module, Inputs]:
    """A CLIP in open_clip's layout on torch's nn.MultiheadAttention (model_zoo/clip.py): two
    towers of two blocks, 4 heads of 16, 16 image patches of 8x8 and 12 text tokens. torch
    starts the attention's biases at zero: they are made random, so that they count."""
    model = Clip()
    g = _generator()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("in_proj_bias") or name.endswith("out_proj.bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model, {
        "image": torch.randn(BATCH, 3, 32, 32, generator=g),
        "text": torch.randint(0, 200, (BATCH, 12), generator=g),
    }


# ---- the table ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One model of the zoo."""

    package: str
    """Where its code comes from, with the version pinned by the `zoo` extra."""
    make: Callable[[], tuple[nn.Module, Inputs]]
    """Builds the model (random weights) and its example inputs."""
    blocks: dict[str, str] = field(default_factory=dict)
    """Its attention and MLP blocks: {kind: regex that module paths match in full}, read off
    the package's own source, never off tpplan's output (this is the oracle a plan is
    measured against). A kind where attention and MLP share a layer (Flux's single-stream
    block, one proj_out over both) names that whole block."""
    no_sp: str | None = None
    """Why sequence parallel does not fit it, where it does not: infer_plan refuses it, or
    the sharded forward raises (tests/test_zoo.py holds it to failing loudly instead of to
    parity)."""
    apart: str | None = None
    """Modules inside such a whole block that are neither its attention nor its MLP, whose
    collectives are not the block's (Flux's single-stream `norm`: the timestep modulation,
    which in the double-stream blocks sits outside the attention and MLP measured; a UNet
    resnet's 1x1 `conv_shortcut`, a projection of the block's input beside its pair of 3x3
    convolutions, split and gathered: tpplan cannot yet add its partial sum to conv2's
    before their one all-reduce)."""


_TITAN_BLOCKS = {
    "attention": r"layers\.\d+\.attention",
    "feed_forward": r"layers\.\d+\.feed_forward",
}
_CONVNEXT_BLOCKS = {"mlp": r"stages\.\d+\.blocks\.\d+\.mlp"}
_JOINT_BLOCKS = {
    "attn": r"transformer_blocks\.\d+\.attn",
    "ff": r"transformer_blocks\.\d+\.ff",
    "ff_context": r"transformer_blocks\.\d+\.ff_context",
}

ZOO: dict[str, Entry] = {
    "torchtitan.llama3": Entry("torchtitan 0.2.2", _llama3, _TITAN_BLOCKS),
    "torchtitan.qwen3": Entry("torchtitan 0.2.2", _qwen3, _TITAN_BLOCKS),
    "torchtitan.deepseek_v3": Entry("torchtitan 0.2.2", _deepseek_v3, _TITAN_BLOCKS),
    "torchtitan.llama4": Entry("torchtitan 0.2.2", _llama4, {
        "attention": r"layers\.\d+\.attention", "moe": r"layers\.\d+\.moe",
    }, no_sp=(
        "its routing reads the values (tokens counted per expert), so the sequence-parallel "
        "dry run on fake tensors cannot run it, and the first forward meets the stream with "
        "plain token indices: DTensor raises"
    )),
    "transformers.deepseek_v3": Entry(_TRANSFORMERS, _hf_deepseek_v3, {
        "self_attn": r"model\.layers\.\d+\.self_attn", "mlp": r"model\.layers\.\d+\.mlp",
    }, no_sp=(
        "its experts route by the values (`.item()`), which the sequence-parallel fit, a "
        "forward on fake tensors, cannot run"
    )),
    "transformers.olmo2": Entry(_TRANSFORMERS, _hf_olmo2, {
        "self_attn": r"model\.layers\.\d+\.self_attn", "mlp": r"model\.layers\.\d+\.mlp",
    }),
    "transformers.gpt_bigcode": Entry(_TRANSFORMERS, _hf_gpt_bigcode, {
        "attn": r"transformer\.h\.\d+\.attn", "mlp": r"transformer\.h\.\d+\.mlp",
    }),
    "transformers.phi3_medium": Entry(_TRANSFORMERS, _hf_phi3_medium, {
        "self_attn": r"model\.layers\.\d+\.self_attn", "mlp": r"model\.layers\.\d+\.mlp",
    }),
    "timm.vit": Entry("timm 1.0.31", _vit, {"attn": r"blocks\.\d+\.attn", "mlp": r"blocks\.\d+\.mlp"}),
    "timm.swin": Entry("timm 1.0.31", _swin, {
        "attn": r"layers\.\d+\.blocks\.\d+\.attn", "mlp": r"layers\.\d+\.blocks\.\d+\.mlp",
    }),
    "timm.convnext": Entry("timm 1.0.31", lambda: _convnext(False), _CONVNEXT_BLOCKS),
    "timm.convnext_conv": Entry("timm 1.0.31", lambda: _convnext(True), _CONVNEXT_BLOCKS),
    "diffusers.flux": Entry("diffusers 0.42.1", _flux, {
        **_JOINT_BLOCKS, "single": r"single_transformer_blocks\.\d+",
    }, apart=r"single_transformer_blocks\.\d+\.norm"),
    "diffusers.sd3": Entry("diffusers 0.42.1", _sd3, _JOINT_BLOCKS),
    "diffusers.unet": Entry("diffusers 0.42.1", _unet, {
        "resnet": r"(down_blocks|up_blocks|mid_block)\.(\d+\.)?resnets\.\d+",
        "attn": r".*attentions\.\d+\.transformer_blocks\.\d+\.attn[12]",
        "ff": r".*attentions\.\d+\.transformer_blocks\.\d+\.ff",
    }, apart=r".*resnets\.\d+\.conv_shortcut"),
    "torch.clip": Entry(f"torch {torch.__version__.split('+')[0]}", _clip, {
        "attn": r"(visual\.)?transformer\.resblocks\.\d+\.attn",
        "mlp": r"(visual\.)?transformer\.resblocks\.\d+\.mlp",
    }, no_sp=(
        "its own forward pools the text tower's stream (the end-of-text token, then a "
        "product with the projection) outside any submodule: infer_plan says so"
    )),
    "nanogpt": Entry("nanoGPT model.py, by hand", _nanogpt, {
        "attn": r"transformer\.h\.\d+\.attn", "mlp": r"transformer\.h\.\d+\.mlp",
    }),
}  # fmt: skip


def build(name: str) -> tuple[nn.Module, Inputs]:
    """The zoo model `name` and its inputs, the same on every call (seeded, the global RNG
    left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return ZOO[name].make()
