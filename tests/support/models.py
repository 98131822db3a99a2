"""Tiny models built from configs for the tests: no downloads, milliseconds to build."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

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
