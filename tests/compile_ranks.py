"""Run by torchrun from test_processes.py: torch.compile (inductor, CPU) of an applied model
runs forward and backward on real gloo ranks and matches the eager unsharded model."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from models import tiny_llama, token_batch
from rank_exit import finish

import tpplan

# inductor fuses and reorders float math; 1e-4 on fp32 leaves room for that and still
# catches a wrong split (errors of order 1).
TOL = 1e-4


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref, model = tiny_llama(layers=1), tiny_llama(layers=1)
    x = token_batch()
    want = ref(x).logits
    want.square().mean().backward()
    tpplan.apply_plan(model, mesh, Path(__file__).parent / "plans" / "llama.yaml")
    compiled = torch.compile(model)
    got = compiled(x).logits
    got.square().mean().backward()
    err = (got - want).abs().max().item()
    g = model.model.layers[0].self_attn.q_proj.weight.grad
    g = g.full_tensor() if isinstance(g, DTensor) else g
    gerr = (g - ref.model.layers[0].self_attn.q_proj.weight.grad).abs().max().item()
    print(f"rank {dist.get_rank()} compiled logits {err:.2e} grad {gerr:.2e}", flush=True)
    bad = max(err, gerr) > TOL
    finish(f"compiled model differs: logits {err:.2e}, q_proj grad {gerr:.2e}" if bad else None)


if __name__ == "__main__":
    main()
