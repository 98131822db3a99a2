"""What tests/test_torch_state.py and its gloo ranks (tests/torch_state_ranks.py) share: the
models, each with a fused parameter whose layout a reordered shard would corrupt, and the
Adam step they train."""

from __future__ import annotations

import torch

from support.infer_models import gpt2, phi3, qwen3_moe

__all__ = ["MODELS", "adam", "adam_step"]

MODELS = {"gpt2": gpt2, "phi3": phi3, "qwen3_moe": lambda seed=0: qwen3_moe(seed=seed)}


def adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Adam over the model's parameters."""
    # eps near the gradients' size: an ulp of noise in a near-zero gradient moves no update
    # visibly, while moments in the wrong order move every update by about lr
    return torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)


def adam_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    """One step of `opt` on the mean square of the model's logits for `tokens`."""
    model(tokens).logits.square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
