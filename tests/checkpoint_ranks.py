"""Run by torchrun from test_checkpoint.py: real gloo ranks save and load checkpoints.

`save FOLDER` (tp 2): shard the seeded tiny Llama, check full_state_dict against the unsharded
state dict, then write FOLDER/dcp (sharded=True) and FOLDER/safetensors (sharded=False).
`load FOLDER` (any tp): build the model on the meta device, shard, materialize, load each of
the two, then load each again in one call (from_pretrained); compare logits with the
unsharded model. `fused-*` and `shared-*` do the same for GPT-2's fused q|k|v and for
key/value heads shared past their count. Each rank prints one line the test counts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).parent))
from support.models import tiny_llama, token_batch

import tpplan
import tpplan.checkpoint.dcp
from tpplan.checkpoint import full_state_dict, load_checkpoint, save_checkpoint

PLAN = Path(__file__).parent / "plans" / "llama.yaml"
TOL = 1e-5  # as in test_apply.py: sharded matmuls only reorder fp32 sums


def save(folder: Path, rank: int, world: int) -> float:
    mesh = init_device_mesh("cpu", (world,))
    model = tpplan.apply_plan(tiny_llama(), mesh, PLAN)
    want = tiny_llama().state_dict()
    got = full_state_dict(model)
    if got.keys() != want.keys():
        sys.exit(f"rank {rank}: full_state_dict keys differ: {got.keys() ^ want.keys()}")
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    save_checkpoint(model, folder / "dcp", sharded=True)
    save_checkpoint(model, folder / "safetensors", sharded=False)
    return worst


def load(folder: Path, rank: int, world: int) -> float:
    x = token_batch()
    want = tiny_llama()(x).logits
    worst = 0.0
    for fmt in ("dcp", "safetensors"):
        mesh = init_device_mesh("cpu", (world,))
        model = tpplan.apply_plan(tiny_llama(device="meta"), mesh, PLAN)
        model.to_empty(device="cpu")
        load_checkpoint(model, folder / fmt)
        # the same folder in one call: save_checkpoint wrote the config it builds from
        loaded = tpplan.from_pretrained(folder / fmt, mesh, plan=PLAN)
        with torch.no_grad():
            for m in (model, loaded):
                worst = max(worst, (m(x).logits - want).abs().max().item())
    return worst


def fused(folder: Path, rank: int, world: int, *, saving: bool, legacy: bool = False) -> float:
    """GPT-2's fused q|k|v (`parts`) through DCP: saved at one tp, loaded at another. With
    `legacy`, saved as earlier tpplan versions did (each piece a tensor of its own, split over
    the ranks) with torch's DCP, then loaded by load_checkpoint at this tp."""
    from support.infer_models import gpt2

    x = token_batch()
    ref = gpt2()
    want = ref(x).logits
    mesh = init_device_mesh("cpu", (world,))
    if legacy:
        _save_by_pieces(tpplan.apply_plan(ref, mesh), folder / "legacy-dcp")
        with torch.device("meta"):
            model = tpplan.apply_plan(gpt2(), mesh)
        model.to_empty(device="cpu")
        load_checkpoint(model, folder / "legacy-dcp")
    elif saving:
        model = tpplan.apply_plan(ref, mesh)
        save_checkpoint(model, folder / "fused-dcp", sharded=True)
    else:
        with torch.device("meta"):
            model = tpplan.apply_plan(gpt2(), mesh)
        model.to_empty(device="cpu")
        load_checkpoint(model, folder / "fused-dcp")
    with torch.no_grad():
        return (model(x).logits - want).abs().max().item()


def shared(folder: Path, rank: int, world: int, *, saving: bool) -> float:
    """Key/value heads shared past their count through DCP: 2 heads saved at tp 4 (each on
    two ranks, the weight a DTensor on a 2-D view of the mesh), loaded at tp 2 (split)."""
    x = token_batch()
    ref = tiny_llama(kv_heads=2)
    want = ref(x).logits
    mesh = init_device_mesh("cpu", (world,))
    if saving:
        model = tpplan.apply_plan(ref, mesh)  # the plan inferred at this tp
        k = model.model.layers[0].self_attn.k_proj.weight
        if k.device_mesh.ndim != 2:
            sys.exit(f"rank {rank}: k_proj is not shared at tp {world}: {k.placements}")
        save_checkpoint(model, folder / "shared-dcp", sharded=True)
    else:
        model = tpplan.apply_plan(tiny_llama(kv_heads=2, device="meta"), mesh)
        model.to_empty(device="cpu")
        load_checkpoint(model, folder / "shared-dcp")
    with torch.no_grad():
        return (model(x).logits - want).abs().max().item()


def _save_by_pieces(model: torch.nn.Module, folder: Path) -> None:
    """DCP with each fused parameter stored as one tensor per piece (`NAME.tpplan_part0`,
    ...), each split over the ranks by Shard: the layout earlier tpplan versions wrote."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    state = {}
    for name, t in model.state_dict().items():
        placement = t.placements[0] if isinstance(t, DTensor) else None
        if not isinstance(placement, _StridedShard):
            state[name] = t
            continue
        dim, pieces = placement.dim, int(placement.split_factor)
        whole = t.full_tensor()
        for i, piece in enumerate(whole.chunk(pieces, dim)):
            state[f"{name}.tpplan_part{i}"] = torch.distributed.tensor.distribute_tensor(
                piece.contiguous(), t.device_mesh, [Shard(dim)]
            )
    dcp.save(state, checkpoint_id=folder)


def main() -> None:
    mode, folder = sys.argv[1], Path(sys.argv[2])
    # tiny models: store chunks of 1 KiB, so that loading reassembles regions from many
    tpplan.checkpoint.dcp.CHUNK_BYTES = (1024, 1024)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode.startswith("fused-"):
        worst = fused(
            folder, rank, world, saving=mode == "fused-save", legacy=mode == "fused-legacy"
        )
    elif mode.startswith("shared-"):
        worst = shared(folder, rank, world, saving=mode == "shared-save")
    else:
        worst = (save if mode == "save" else load)(folder, rank, world)
    print(f"rank {rank}/{world} {mode} worst {worst:.2e}", flush=True)
    # DTensor's collectives may still be finishing on a peer; tearing the group down under
    # them aborts gloo, so the ranks meet first
    dist.barrier()
    dist.destroy_process_group()
    if worst > TOL:
        print(f"rank {rank}: {mode} differs by {worst:.2e}", file=sys.stderr, flush=True)
    # Skip interpreter teardown: with torch 2.13 on gloo, a C++ thread still joinable at
    # exit aborts about 1 run in 10 ("terminate called without an active exception"), after
    # every result is printed and the group destroyed.
    sys.stdout.flush()
    os._exit(1 if worst > TOL else 0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
