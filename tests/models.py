"""Tiny models built from configs for the tests: no downloads, milliseconds to build."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(*, layers: int = 2, device: str | torch.device = "cpu", seed: int = 0) -> LlamaForCausalLM:
    """8 query heads and 4 KV heads of head_dim 8, so tp 2 and 4 split whole heads."""
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    with torch.device(device):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).eval()


def token_batch(vocab: int = 128, *, batch: int = 2, seq: int = 8, seed: int = 0) -> torch.Tensor:
    """The same tokens on every rank: drawn from a generator of our own, not the global RNG."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
