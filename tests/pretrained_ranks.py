"""A torchrun (or tpplan.launch) rank for tests/test_pretrained.py: from_pretrained with the
default mesh, then logits and gradients against the unsharded model loaded by transformers,
then save_pretrained, whose folder transformers loads as the unsharded model's weights."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import tpplan

TOL = 1e-5  # fp32, 2 layers: sharded sums differ from unsharded ones by ~1e-7


def check_rank(folder: str) -> str:
    model = tpplan.from_pretrained(folder)  # no mesh: every rank of the group
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    got, want = model(x).logits, ref(x).logits
    assert (got - want).abs().max().item() < TOL, (got - want).abs().max()
    got.pow(2).mean().backward()
    want.pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if name.endswith("down_proj.weight") or name.endswith("o_proj.weight"):
            assert p.to_local().shape[1] == q.shape[1] // world, name
        assert torch.allclose(grad, q.grad, atol=TOL), name
    # save_pretrained on every rank: the split weights gathered, rank 0 writes, all return
    # once the folder is whole
    saved = f"{folder}-saved-tp{world}"
    model.save_pretrained(saved)
    again = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(again[name], value), f"saved {name}"
    return f"{rank}/{world} matches"


if __name__ == "__main__":
    print(check_rank(sys.argv[1]), flush=True)
    dist.destroy_process_group()
