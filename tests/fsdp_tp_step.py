"""Run by torchrun from test_processes.py on 4 ranks (one node or two): a 2x2 (dp, tp) mesh
trains one step; the parameters must equal the unsharded model trained on the whole batch.

With no argument, the tiny Llama and its hand-written plan; with `gpt2` or `phi3`, that model
and its inferred plan, whose fused layers (q|k|v, gate|up) are split as each rank's slice of
each piece, a layout FSDP2 must not shard along. With `fused_gqa`, a q|k|v of unequal pieces,
whose layer computes with a working copy of its own rows: two steps, so that the second
forward must see the weights the first step changed."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from support.infer_models import fused_gqa, gpt2, phi3
from support.models import tiny_llama, token_batch
from support.ranks import finish

import tpplan

TOL = 1e-5  # fp32, one SGD step of a 2-layer model


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    models = {"gpt2": gpt2, "phi3": phi3, "fused_gqa": fused_gqa}
    build = models.get(sys.argv[1] if sys.argv[1:] else "", tiny_llama)
    steps = 2 if build is fused_gqa else 1
    ref, model = build(), build()
    batch = token_batch(batch=4)
    loss_fn = torch.nn.functional.cross_entropy

    def loss(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = m(x)
        out = getattr(out, "logits", out)
        return loss_fn(out[:, :-1].flatten(0, 1), x[:, 1:].flatten())

    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(steps):
        opt.zero_grad()
        loss(ref, batch).backward()
        opt.step()

    plan = (
        Path(__file__).parent / "plans" / "llama.yaml"
        if build is tiny_llama
        else tpplan.infer_plan(model, tp_size=2)
    )
    tpplan.parallelize(model, mesh, plan, check_inputs=True)
    dp_rank = mesh["dp"].get_local_rank()
    part = batch.chunk(2)[dp_rank]  # both tp ranks of one dp rank get the same half
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        opt.zero_grad()
        loss(model, part).backward()
        opt.step()

    worst, where = 0.0, ""
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        err = (full.detach() - q.detach()).abs().max().item()
        if err > worst:
            worst, where = err, name
    # every parameter is FSDP-sharded over dp, the plan's layers over (dp, tp) as well (a
    # fused bias, kept whole over dp, over tp only)
    dims = {len(p.placements) if isinstance(p, DTensor) else 0 for p in model.parameters()}
    print(f"rank {rank} worst {where} {worst:.2e} mesh dims {sorted(dims)}", flush=True)
    # fused_gqa holds no 1-D fused bias: every parameter over (dp, tp)
    bad = worst > TOL or dims != ({2} if build is fused_gqa else {1, 2})
    finish(
        f"rank {rank}: {where} differs by {worst:.2e}; placements over mesh dims {dims}"
        if bad
        else None
    )


if __name__ == "__main__":
    main()
