"""Tiny models for the tests, built from configs or written by hand: no downloads,
milliseconds to build. `tiny_llama` (and its sizes as a config, TINY_LLAMA_CONFIG) with
`token_batch`, `HeadNormBlock`, `SeqParallelNet`, `tiny_tokenizer`, and `Vit`, a ViT written
by hand, with its `images`; `seeded` builds any of them from a seed."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

__all__ = [
    "TINY_LLAMA_CONFIG",
    "TINY_LLAMA_FLAGS",
    "AttentionLm",
    "HeadNormBlock",
    "SeqParallelNet",
    "Vit",
    "images",
    "seeded",
    "tiny_llama",
    "tiny_tokenizer",
    "token_batch",
]

# tiny_llama()'s sizes as a Hugging Face config.json holds them, and as the command line's
# `--set` flags over the llama model type (the CLI tests' model)
TINY_LLAMA_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "vocab_size": 128,
}
TINY_LLAMA_FLAGS = [
    flag
    for key, value in TINY_LLAMA_CONFIG.items()
    if key not in ("model_type", "architectures")
    for flag in ("--set", f"{key}={value}")
]


def tiny_llama(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 8,
    kv_heads: int = 4,
    vocab: int = 128,
    device: str | torch.device = "cpu",
    seed: int = 0,
    tied: bool = False,
) -> LlamaForCausalLM:
    """head_dim 8 whatever the width, so the plans under tests/plans fit every variant;
    `tied`: the head is the token embedding."""
    # transformers is imported here, not above: the unit tier builds no Llama, and the
    # import was 2 s of the tier's start in each process
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3 // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    with torch.device(device):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).eval()


def token_batch(vocab: int = 128, *, batch: int = 2, seq: int = 8, seed: int = 0) -> torch.Tensor:
    """The same tokens on every rank: drawn from a generator of our own, not the global RNG."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


class AttentionLm(nn.Module):
    """One attention block under test in a model of its own: ids -> an embedding -> x +
    attn(x) -> a vocab head. `attn` builds the block (called between the embedding and the
    head, so that a seed gives every part the same weights whatever the block)."""

    def __init__(self, attn: Callable[[], nn.Module], vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.attn = attn()
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.attn(x))


class HeadNormBlock(nn.Module):
    """fc1 -> (heads, head_dim) -> a norm over head_dim with one shared weight -> fc2.

    The norm's weight is replicated but used on sharded heads, so its gradient on each rank
    is a partial sum: the case `replicate_grad_sum` exists for.
    """

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.fc1 = nn.Linear(dim, dim)
        self.norm = nn.RMSNorm(self.head_dim)
        self.fc2 = nn.Linear(dim, dim)
        with torch.no_grad():  # a weight far from ones, so its gradient is not trivial
            self.norm.weight.copy_(torch.linspace(0.5, 1.5, self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc1(x).unflatten(-1, (-1, self.head_dim)))  # -1: local head count
        return self.fc2(h.flatten(-2))


class SeqParallelNet(nn.Module):
    """Embedding -> pre-norm MLP block with a residual -> norm -> head: small enough to write
    a sequence-parallel plan by hand (tests/plans/seq_parallel.yaml)."""

    def __init__(self, vocab: int = 32, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.norm2 = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.mlp(self.norm1(h))
        return self.head(self.norm2(h))


class TwoBlocks(nn.Module):
    """Two blocks of one class (`make()` each), run in turn: a pattern in the plan matches
    both, and each block's collectives are counted under `TwoBlocks.blocks.<i>`."""

    def __init__(self, make: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([make(), make()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def tiny_tokenizer(vocab: int = 128) -> Any:
    """A word-level tokenizer over the tokens t0 ... t{vocab-1} (t0 pads), built in memory:
    what TRL's SFTTrainer needs beside a tiny model, without a download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    inner = Tokenizer(models.WordLevel(words, unk_token="t0"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="t0", eos_token="t1", unk_token="t0"
    )


def seeded(cls: type[nn.Module], seed: int = 0, **kwargs: object) -> nn.Module:
    """`cls(**kwargs)` in eval mode, its weights drawn from `seed` without touching the
    global RNG."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return cls(**kwargs).eval()


# ---- ViT ------------------------------------------------------------------------------------
class _VitAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, fused: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.fused = fused
        if fused:
            self.qkv = nn.Linear(dim, dim * 3)
        else:
            self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        if self.fused:  # timm: (B, N, 3, heads, hd) -> (3, B, heads, N, hd)
            qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
        else:
            q, k, v = (
                lin(x).reshape(B, N, -1, self.head_dim).transpose(1, 2)
                for lin in (self.q, self.k, self.v)
            )
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, -1))


class _VitBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, fused: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _VitAttention(dim, num_heads, fused)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Vit(nn.Module):
    """A ViT encoder written by hand: patches embedded by a Conv2d or a Linear
    (`patch_embed`), a class token, learned positions, LayerNorm, non-causal attention
    (timm's fused qkv, or separate q/k/v) and a GELU MLP, classified from the class token."""

    def __init__(
        self,
        image: int = 16,
        patch: int = 4,
        dim: int = 32,
        depth: int = 2,
        num_heads: int = 4,
        classes: int = 10,
        patch_embed: str = "conv",
        fused: bool = True,
    ) -> None:
        super().__init__()
        self.patch = patch
        if patch_embed == "conv":
            self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        else:
            self.patch_embed = nn.Linear(3 * patch * patch, dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[_VitBlock(dim, num_heads, fused) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        if isinstance(self.patch_embed, nn.Conv2d):
            return self.patch_embed(images).flatten(2).transpose(1, 2)
        b, c, _, _ = images.shape
        p = self.patch
        patches = images.unfold(2, p, p).unfold(3, p, p)  # (B, C, H/p, W/p, p, p)
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * p * p)
        return self.patch_embed(patches)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def images() -> torch.Tensor:
    """Two 16x16 RGB images, drawn from a seed: Vit's input."""
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
