"""What torch's own APIs see of an applied model: the unsharded model's layout, fused layers
included. The oracle is torch (named_parameters + full_tensor, state_dict, get_model_state_dict,
optimizer state dicts, DCP, dcp_to_torch_save), never tpplan's own checkpoint helpers.

Simulated ranks cover what needs no real process group; DCP and Lightning run on gloo
processes (tests/torch_state_ranks.py, marked slow)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.models import token_batch
from support.torch_state import MODELS, adam, adam_step
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

import tpplan
from tpplan._runtime.local import own_replicas, rank_values, simulated_ranks

HERE = Path(__file__).parent
# the fused parameter of each model whose layout a reordered shard would corrupt
FUSED = {
    "gpt2": "transformer.h.0.attn.c_attn.weight",
    "phi3": "model.layers.0.mlp.gate_up_proj.weight",
    "qwen3_moe": "model.layers.0.mlp.experts.gate_up_proj",
}


def _whole(t: torch.Tensor) -> list[torch.Tensor]:
    return rank_values(t.full_tensor() if isinstance(t, DTensor) else t)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_parameters_and_state_dict_hold_the_unsharded_layout(name: str, tp: int) -> None:
    want = MODELS[name]().state_dict()
    model = MODELS[name]()
    with simulated_ranks(tp) as mesh:
        tpplan.apply_plan(model, mesh, tpplan.infer_plan(model, tp_size=tp))
        fused = model.get_parameter(FUSED[name])
        # the fused layer is split (not kept whole), as each rank's slice of each piece
        assert isinstance(fused.placements[0], _StridedShard), fused.placements
        seen = {**dict(model.named_parameters()), **model.state_dict()}
        assert seen.keys() == want.keys()
        for key, value in seen.items():
            for rank, v in enumerate(_whole(value)):
                assert torch.equal(v, want[key]), f"{key} on rank {rank}"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_get_model_state_dict_full_equals_the_unsharded_state_dict(name: str, tp: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    want = MODELS[name]().state_dict()
    model = MODELS[name]()
    with simulated_ranks(tp) as mesh:
        tpplan.apply_plan(model, mesh, tpplan.infer_plan(model, tp_size=tp))
        got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        assert got.keys() == want.keys()
        for key, value in got.items():
            for rank, v in enumerate(_whole(value)):
                assert torch.equal(v, want[key]), f"{key} on rank {rank}"


@pytest.mark.parametrize("name", list(MODELS))
def test_adam_moments_of_a_full_optimizer_state_dict_are_the_unsharded_ones(name: str) -> None:
    """Adam's moments copy each parameter's placements, so a full optimizer state dict taken
    at tp 2 holds the unsharded run's moments, in the unsharded layout."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    ref = MODELS[name]()
    model = copy.deepcopy(ref)
    tokens = token_batch(seed=1)  # made outside the simulation: the same on every rank
    ref_opt = adam(ref)
    adam_step(ref, ref_opt, tokens)
    want = {n: ref_opt.state[p] for n, p in ref.named_parameters()}
    with simulated_ranks(2) as mesh:
        tpplan.apply_plan(model, mesh, tpplan.infer_plan(model, tp_size=2))
        own_replicas(model, 2)  # each simulated rank steps its own replicated parameters
        opt = adam(model)
        adam_step(model, opt, tokens)
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        for key, moments in full["state"].items():
            for moment in ("exp_avg", "exp_avg_sq"):
                for rank, v in enumerate(_whole(moments[moment])):
                    err = (v - want[key][moment]).abs().max().item()
                    # fp32 sums in another order, divided by sqrt(v) + eps: ~1e-7
                    assert err <= 1e-5, f"{key}.{moment} on rank {rank} off by {err:.2e}"


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", str(HERE / "torch_state_ranks.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _ok(run: subprocess.CompletedProcess[str], nproc: int, mode: str) -> None:
    assert run.returncode == 0, run.stdout + run.stderr
    # ranks print concurrently, so their lines may share a line of stdout
    done = sorted(int(r) for r in re.findall(rf"rank (\d+)/{nproc} {mode} ok", run.stdout))
    assert done == list(range(nproc)), run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_dcp_saved_at_tp2_loads_through_plain_dcp_at_tp4_and_tp1(name: str, tmp_path: Path) -> None:
    """dcp.save(get_model_state_dict(model)) and the optimizer's at tp 2; plain dcp.load and
    set_state_dict into freshly applied models at tp 4 and tp 1 give the unsharded logits,
    the unsharded Adam moments, and train on exactly like the unsharded run; and
    dcp_to_torch_save gives the unsharded state dict."""
    _ok(_torchrun(2, "save", name, str(tmp_path)), 2, "save")
    _ok(_torchrun(4, "load", name, str(tmp_path)), 4, "load")
    _ok(_torchrun(1, "load", name, str(tmp_path)), 1, "load")
