"""Run by torchrun from test_processes.py: real gloo ranks shard a LoRA Llama (peft) with its
inferred plan, train one step beside the unsharded PEFT model, save the adapter unsplit
(save_pretrained on every rank, rank 0 writes) and load it back unsharded, then merge. Each
rank prints its worst difference; argv[1] is a folder for the adapter."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import PeftModel
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).parent))
from support.lora import lora_llama, train_step
from support.models import tiny_llama, token_batch
from support.ranks import finish

import tpplan

TOL = 1e-5  # as in test_peft.py


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ref, tokens = lora_llama(), token_batch()  # seeded: the same on every rank
    model = tpplan.apply_plan(copy.deepcopy(ref), mesh)
    errors = {"loss": (train_step(model, tokens) - train_step(ref, tokens)).abs().item()}
    full = tpplan.full_state_dict(model)  # every rank: one gather per split tensor
    for name, value in ref.state_dict().items():
        errors[name] = (full[name] - value).abs().max().item()
    folder = Path(sys.argv[1])
    model.save_pretrained(folder)  # every rank: the adapter gathered, rank 0 writes
    loaded = PeftModel.from_pretrained(tiny_llama(), folder)
    for name, value in loaded.state_dict().items():
        errors[f"saved {name}"] = (value - full[name]).abs().max().item()
    with torch.no_grad():
        want = ref.merge_and_unload()(tokens).logits
        errors["merged logits"] = (
            (model.merge_and_unload()(tokens).logits - want).abs().max().item()
        )
    worst = max(errors, key=errors.__getitem__)
    print(f"rank {rank}/{world} worst {worst} {errors[worst]:.2e}", flush=True)
    bad = errors[worst] > TOL
    finish(f"rank {rank}: {worst} differs by {errors[worst]:.2e}" if bad else None)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
