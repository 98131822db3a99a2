"""Tiny models for the tracer's tests: Hugging Face families from small configs, and
hand-written blocks whose module names can be changed without changing the computation.
Each builder imports its transformers classes itself: the unit tier imports this file but
builds none of them, and importing transformers was 2 s of its start in each process."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 128
_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def _build(cls: type[nn.Module], config: object, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return cls(config).eval()


def llama_mha(seed: int = 0) -> nn.Module:
    """8 query heads and 8 key/value heads of head_dim 8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build(LlamaForCausalLM, LlamaConfig(**_SMALL, num_key_value_heads=8), seed)


def llama_gqa(seed: int = 0) -> nn.Module:
    """8 query heads sharing 4 key/value heads (grouped-query attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build(LlamaForCausalLM, LlamaConfig(**_SMALL, num_key_value_heads=4), seed)


def qwen2(seed: int = 0) -> nn.Module:
    """Biases on q/k/v projections."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _build(Qwen2ForCausalLM, Qwen2Config(**_SMALL, num_key_value_heads=4), seed)


def qwen3(seed: int = 0) -> nn.Module:
    """Per-head RMSNorm on queries and keys (q_norm, k_norm) inside the attention region."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _build(Qwen3ForCausalLM, Qwen3Config(**_SMALL, num_key_value_heads=4, head_dim=8), seed)


def opt(seed: int = 0) -> nn.Module:
    """Views by a stored head count, `view(bsz, -1, self.num_heads, self.head_dim)`: 4 heads
    of 16 so the count is not also the head size; fc1 -> relu -> fc2 MLP; tied embeddings."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        ffn_dim=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )
    return _build(OPTForCausalLM, cfg, seed)


def gpt2(seed: int = 0, *, tied: bool = True) -> nn.Module:
    """Conv1D layers (weights stored (in, out)); one c_attn producing q|k|v, cut apart by
    `split(self.split_size)`; tied input embedding and head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=8, n_positions=64,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied,
    )  # fmt: skip
    return _build(GPT2LMHeadModel, cfg, seed)


def phi3(seed: int = 0) -> nn.Module:
    """One gate_up_proj cut by `chunk(2)`; one qkv_proj cut by slices at positions computed
    from the config in forward (GQA: 8 query heads, 4 key/value heads)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(
        **_SMALL, num_key_value_heads=4, pad_token_id=0, bos_token_id=0, eos_token_id=0
    )
    return _build(Phi3ForCausalLM, cfg, seed)


class FusedAttention(nn.Module):
    """One Linear producing q|k|v of unequal sizes (8 query heads, 4 key/value heads of 8),
    cut by `split([self.q_size, self.kv_size, self.kv_size])`; with `literal_sizes` the
    sizes are written as numbers, which no rank-local fix can reach."""

    def __init__(self, *, literal_sizes: bool) -> None:
        super().__init__()
        self.q_size, self.kv_size, self.head_dim = 64, 32, 8
        self.literal_sizes = literal_sizes
        self.qkv = nn.Linear(64, 128)
        self.out = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        sizes = [64, 32, 32] if self.literal_sizes else [self.q_size, self.kv_size, self.kv_size]
        q, k, v = (
            p.view(b, t, -1, self.head_dim).transpose(1, 2) for p in self.qkv(x).split(sizes, -1)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(a.transpose(1, 2).reshape(b, t, -1))


class FusedGqa(nn.Module):
    def __init__(self, *, literal_sizes: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.attn = FusedAttention(literal_sizes=literal_sizes)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.attn(x))


def fused_gqa(seed: int = 0, *, literal_sizes: bool = False) -> FusedGqa:
    torch.manual_seed(seed)
    return FusedGqa(literal_sizes=literal_sizes).eval()


class Mlp(nn.Module):
    """fc1 -> gelu -> fc2 on float features."""

    def __init__(self, dim: int = 32, hidden: int = 48) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class NormedMlp(nn.Module):
    """fc1 -> LayerNorm over its features -> fc2: the norm needs all of fc1's features."""

    def __init__(self, dim: int = 32, hidden: int = 48) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.fc1(x)))


ROLES = ("embed", "norm1", "q", "k", "v", "o", "norm2", "up", "down", "head")
PLAIN_NAMES = {r: r for r in ROLES}
# Other names, declared in another order: the tracer must not care.
ODD_NAMES = {
    "embed": "lookup",
    "norm1": "n_a",
    "q": "alpha",
    "k": "beta",
    "v": "gamma",
    "o": "delta",
    "norm2": "n_b",
    "up": "widen",
    "down": "narrow",
    "head": "readout",
}


class Block(nn.Module):
    """A one-block decoder written by hand; `names` picks each role's attribute name."""

    def __init__(
        self, names: dict[str, str], *, dim: int = 32, heads: int = 4, hidden: int = 48
    ) -> None:
        super().__init__()
        self.names = names
        self.head_dim = dim // heads
        shapes: dict[str, nn.Module] = {
            "embed": nn.Embedding(VOCAB, dim),
            "norm1": nn.LayerNorm(dim),
            "q": nn.Linear(dim, dim),
            "k": nn.Linear(dim, dim),
            "v": nn.Linear(dim, dim),
            "o": nn.Linear(dim, dim),
            "norm2": nn.LayerNorm(dim),
            "up": nn.Linear(dim, hidden),
            "down": nn.Linear(hidden, dim),
            "head": nn.Linear(dim, VOCAB, bias=False),
        }
        for role in sorted(shapes, key=lambda r: names[r]):
            setattr(self, names[role], shapes[role])

    def part(self, role: str) -> nn.Module:
        return getattr(self, self.names[role])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.part("embed")(ids)
        h = self.part("norm1")(x)
        b, t, _ = h.shape
        q, k, v = (
            self.part(r)(h).view(b, t, -1, self.head_dim).transpose(1, 2) for r in ("q", "k", "v")
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.part("o")(a.transpose(1, 2).reshape(b, t, -1))
        x = x + self.part("down")(F.gelu(self.part("up")(self.part("norm2")(x))))
        return self.part("head")(x)


def block(names: dict[str, str] = PLAIN_NAMES, seed: int = 0) -> Block:
    torch.manual_seed(seed)
    return Block(names).eval()


def bert(seed: int = 0) -> nn.Module:
    """An encoder (bidirectional attention, post-norm, GELU MLP) with a masked-LM head whose
    decoder is tied to the word embedding."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
        intermediate_size=128, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    return _build(BertForMaskedLM, cfg, seed)


def t5(seed: int = 0) -> nn.Module:
    """Encoder-decoder; a per-head relative position bias (an Embedding looked up at computed
    positions, one column per head) added to every self-attention's scores; tied embeddings."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=8, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=8, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return _build(T5ForConditionalGeneration, cfg, seed)


def bart(seed: int = 0) -> nn.Module:
    """Encoder-decoder with learned positions (an Embedding subclass given the token ids,
    looking up positions it computes) and a final logits bias."""
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    return _build(BartForConditionalGeneration, cfg, seed)


def whisper(seed: int = 0) -> nn.Module:
    """Audio encoder (conv front end on mel features) and text decoder with cross-attention;
    views by a stored head count, so 4 heads of 16 (a count equal to the head size could be
    either attribute, and the tracer would keep the layers whole)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32, max_target_positions=32,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0,
        suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    return _build(WhisperForConditionalGeneration, cfg, seed)


def falcon(seed: int = 0) -> nn.Module:
    """Parallel residual (attention and MLP read the same normed input), one fused
    query_key_value viewed per head, and an in-place residual add on the MLP's output."""
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        new_decoder_architecture=False, multi_query=False, parallel_attn=True, bias=True,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _build(FalconForCausalLM, cfg, seed)


def gpt_neox(seed: int = 0) -> nn.Module:
    """One query_key_value viewed as (heads, 3 * head_size): each head's q, k and v side by
    side, the per-head interleaved layout; the inner size is computed, `3 * self.head_size`."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64,
    )  # fmt: skip
    return _build(GPTNeoXForCausalLM, cfg, seed)


def gemma3(seed: int = 0) -> nn.Module:
    """Per-head q/k norms whose forward asks the weight for its device (`weight.float()`):
    a query, not a use outside the attention region."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(**_SMALL, num_key_value_heads=4, head_dim=8)
    return _build(Gemma3ForCausalLM, cfg, seed)


class WidthFromShard(nn.Module):
    """Views its fused q|k|v per head with an inner size computed from the fused output's own
    width (`qkv.size(-1) // self.n_head`). On a shard that width is the shard's, so the view
    would cut heads wrongly on every rank; it equals `3 * self.head_dim` only by value."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head, self.head_dim = 4, 8
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        scale = self.head_dim**-0.5
        per_head = qkv.view(b, t, -1, qkv.size(-1) // self.n_head)
        q, k, v = per_head.transpose(1, 2).split(self.head_dim, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, scale=scale)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class SinkAttention(nn.Module):
    """Attention with a learnt per-head sink, as GraniteSWA computes it: each head's output is
    scaled by sigmoid(logsumexp(logits) - sink). Names mean nothing on purpose.
    With `also_whole`, the sinks' mean is also added to every output feature: a use of the
    whole parameter next to the per-head one."""

    def __init__(self, *, also_whole: bool = False) -> None:
        super().__init__()
        self.n_head, self.head_dim, self.also_whole = 4, 8, also_whole
        self.a, self.b, self.c = (nn.Linear(32, 32) for _ in range(3))
        self.d = nn.Linear(32, 32)
        self.s = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, t, _ = x.shape
        q, k, v = (
            m(x).view(bsz, t, self.n_head, self.head_dim).transpose(1, 2)
            for m in (self.a, self.b, self.c)
        )
        logits = q @ k.transpose(2, 3) * self.head_dim**-0.5
        scale = (torch.logsumexp(logits, dim=-1) - self.s.view(1, -1, 1)).sigmoid()
        y = (logits.softmax(-1) @ v) * scale.unsqueeze(-1)
        out = self.d(y.transpose(1, 2).reshape(bsz, t, -1))
        return out + self.s.mean() if self.also_whole else out


class SinkBlock(nn.Module):
    """SinkAttention as a residual block's submodule (`z`), as models hold it."""

    def __init__(self, *, also_whole: bool = False) -> None:
        super().__init__()
        self.z = SinkAttention(also_whole=also_whole)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.z(x)


def gpt_oss(seed: int = 0) -> nn.Module:
    """Sinks joined to the attention logits along the keys (`cat`), one per head; its
    experts hold biases."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    return _build(GptOssForCausalLM, cfg, seed)


def deepseek_v3(seed: int = 0) -> nn.Module:
    """Multi-head latent attention: q and k/v pass through small normed latents (q_a_proj,
    kv_a_proj_with_mqa), then per-head projections (q_b_proj; kv_b_proj, each head's k and v
    side by side) whose keys are assembled in a buffer made with `new_empty` to the local
    head count, next to a rotary part broadcast with `expand` to it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=64,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, max_position_embeddings=64,
    )  # fmt: skip
    return _build(DeepseekV3ForCausalLM, cfg, seed)


def qwen3_moe(implementation: str | None = None, *, seed: int = 0, width: int = 32) -> nn.Module:
    """Qwen3's mixture of experts (4 experts, 2 per token, each `width` features wide), its
    experts' forward chosen by `implementation` (transformers' `_experts_implementation`:
    "eager", "grouped_mm", ...)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=width,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, num_experts=4,
        num_experts_per_tok=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    model = _build(Qwen3MoeForCausalLM, cfg, seed)
    if implementation is not None:
        model.config._experts_implementation = implementation
    return model


class PiecesThenHeads(nn.Module):
    """timm's fused attention: one qkv Linear viewed as (B, N, 3, heads, head_dim), the
    pieces' dim moved first and unbound into q, k, v; heads merged by a stored width."""

    def __init__(self, dim: int = 32, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.attn_dim = num_heads, dim // num_heads, dim
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(out.transpose(1, 2).reshape(b, n, self.attn_dim))


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(x.mean(-1, keepdim=True))  # one gate per token, from the whole input
        return x + self.down(torch.relu(self.up(x)) * g)


class GatedBlock(nn.Module):
    """A projection, then an MLP whose hidden features are scaled by a per-token gate
    computed from its (unsplit, weight-derived) input."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.blk = nn.Linear(8, 32), _Gated()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blk(self.inp(x))


def albert(seed: int = 0) -> nn.Module:
    """One layer's weights shared by every layer: its first call takes the output of
    embedding_hidden_mapping_in (a Linear whose output is normed whole), the next ones
    its own output."""
    from transformers import AlbertConfig, AlbertForMaskedLM

    cfg = AlbertConfig(
        vocab_size=VOCAB, embedding_size=32, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
    )  # fmt: skip
    return _build(AlbertForMaskedLM, cfg, seed)
