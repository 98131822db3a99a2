"""Run by torchrun from test_torch_state.py: real gloo ranks save and load an applied model
and its Adam state through torch's own APIs only (get_state_dict, dcp.save, dcp.load,
set_state_dict, dcp_to_torch_save); tpplan only applies the plan.

`save MODEL FOLDER` (tp 2): one Adam step, then dcp.save of the model's and optimizer's state
dicts; rank 0 converts the folder with dcp_to_torch_save and compares every tensor with the
unsharded run. `load MODEL FOLDER` (any tp): a model built from another seed, applied at
this tp, loaded by plain dcp.load + set_state_dict; its logits and Adam moments must be the
unsharded run's, and one more step must train exactly like it. Each rank prints one line
with "MODE ok" that the test counts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from support.models import token_batch
from support.ranks import finish
from support.torch_state import MODELS, adam, adam_step

import tpplan

TOL = 1e-5  # fp32 sums in another order (~1e-7); a piece out of place is off by ~1e-2


def _reference(name: str, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = MODELS[name]()
    opt = adam(model)
    for seed in range(1, steps + 1):
        adam_step(model, opt, token_batch(seed=seed))
    return model, opt


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    if got.keys() != want.keys():
        return float("inf"), f"keys differ: {sorted(got.keys() ^ want.keys())[:4]}"
    errs = {}
    for k, v in got.items():
        v = v.full_tensor() if isinstance(v, DTensor) else v
        errs[k] = (v.float() - want[k].float()).abs().max().item()
    k = max(errs, key=errs.__getitem__)
    return errs[k], k


def _moments(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {f"{k}.{m}": s[m] for k, s in full["state"].items() for m in ("exp_avg", "exp_avg_sq")}


def _apply(name: str, seed: int, world: int) -> torch.nn.Module:
    model = MODELS[name](seed)
    mesh = init_device_mesh("cpu", (world,))
    return tpplan.apply_plan(model, mesh, tpplan.infer_plan(model, tp_size=world))


def save(name: str, folder: Path, rank: int, world: int) -> list[str]:
    ref, _ = _reference(name, steps=1)
    model = _apply(name, 0, world)
    opt = adam(model)
    adam_step(model, opt, token_batch(seed=1))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder / "dcp")
    dist.barrier()
    failures = []
    if rank == 0:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(folder / "dcp", folder / "whole.pt")
        whole = torch.load(folder / "whole.pt", weights_only=False)
        err, where = _worst(whole["model"], ref.state_dict())
        if err > TOL:
            failures.append(f"dcp_to_torch_save: {where} off by {err:.2e}")
    return failures


def load(name: str, folder: Path, rank: int, world: int) -> list[str]:
    ref, ref_opt = _reference(name, steps=1)
    model = _apply(name, 1, world)  # other weights: only the load can make them right
    opt = adam(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder / "dcp")
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    failures = []
    x = token_batch(seed=7)
    with torch.no_grad():
        err = (model(x).logits - ref(x).logits).abs().max().item()
    if err > TOL:
        failures.append(f"logits off by {err:.2e}")
    err, where = _worst(_moments(model, opt), _moments(ref, ref_opt))
    if err > TOL:
        failures.append(f"Adam state {where} off by {err:.2e}")
    adam_step(ref, ref_opt, token_batch(seed=2))
    adam_step(model, opt, token_batch(seed=2))
    err, where = _worst(dict(model.named_parameters()), dict(ref.named_parameters()))
    if err > TOL:
        failures.append(f"after one more step {where} off by {err:.2e}")
    return failures


def main() -> None:
    mode, name, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = (save if mode == "save" else load)(name, folder, rank, world)
    print(f"rank {rank}/{world} {mode} {'ok' if not failures else 'FAILED'}", flush=True)
    finish("; ".join(f"rank {rank}: {f}" for f in failures) or None)


if __name__ == "__main__":
    main()
