"""A tiny Llama with LoRA adapters (peft) and the SGD step that trains it, for the tests of
adapters under tensor parallelism (test_peft, test_save_pretrained) and their gloo ranks
(peft_ranks.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from support.models import tiny_llama

__all__ = ["TARGETS", "lora_llama", "train_step"]

# every attention and MLP projection of the Llama
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_llama(*, r: int = 8, seed: int = 0) -> PeftModel:
    """support/models.py's tiny_llama with LoRA on every attention and MLP projection. lora_B
    is drawn nonzero: peft starts it at zero, which would hide a wrong split of it."""
    with torch.random.fork_rng():  # peft draws lora_A from the global generator
        torch.manual_seed(seed)
        config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=TARGETS)
        model = get_peft_model(tiny_llama(), config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def train_step(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """One SGD step of next-token cross-entropy on `tokens`; the loss."""
    # SGD: a step linear in the gradient (Adam's first step would magnify ulp-level noise)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    logits = model(tokens).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    return loss
