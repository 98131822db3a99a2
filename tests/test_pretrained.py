"""tpplan.from_pretrained: a model folder (or a model id in the local Hugging Face cache) to
a sharded model in one call, with the unsharded model's numbers forward and backward, at
tp 2 and 4 on simulated ranks and on real gloo processes (torchrun, tpplan.launch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.models import tiny_llama, token_batch
from support.parity import assert_matches, reference_run, sharded_run
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import tpplan
from tpplan._runtime.local import simulated_ranks

HERE = Path(__file__).parent


def _saved(folder: Path, *, tied: bool = False, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny grouped-query Llama saved by save_pretrained (safetensors and config.json)."""
    model = tiny_llama(tied=tied)
    model.generation_config.max_new_tokens = 7  # a setting of the folder's own to find again
    model.to(dtype).save_pretrained(folder)
    return folder


def _unsharded(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("tp", [2, 4])
def test_from_pretrained_matches_the_unsharded_model(tmp_path: Path, tp: int) -> None:
    """Inferred plan, default dtype and class: split parameters, eval mode, and the
    unsharded model's logits and every gradient on every rank."""
    folder = _saved(tmp_path / "llama")
    x = token_batch()
    want, params = reference_run(_unsharded(folder), x)
    with simulated_ranks(tp) as mesh:
        model = tpplan.from_pretrained(folder, mesh)
        assert type(model) is LlamaForCausalLM and not model.training
        assert model.generation_config.max_new_tokens == 7
        q = model.model.layers[0].self_attn.q_proj.weight
        assert isinstance(q, DTensor) and q.to_local().shape[0] == q.shape[0] // tp
        run = sharded_run(model, x)
    assert_matches(run, want, params, what=f"from_pretrained at tp {tp}")


def test_a_tied_model_comes_back_tied(tmp_path: Path) -> None:
    folder = _saved(tmp_path / "tied", tied=True)
    x = token_batch()
    want, params = reference_run(_unsharded(folder), x)
    with simulated_ranks(2) as mesh:
        model = tpplan.from_pretrained(folder, mesh)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        run = sharded_run(model, x)
    assert_matches(run, want, params, what="tied, tp 2")


def test_a_plan_file_and_a_model_class(tmp_path: Path) -> None:
    """plan= a file, model_class= an auto class or the model's own class: the same model."""
    folder = _saved(tmp_path / "llama")
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(tpplan.infer_plan(tiny_llama(device="meta"), tp_size=2).to_yaml())
    x = token_batch()
    want, _ = reference_run(_unsharded(folder), x)
    for cls in (AutoModelForCausalLM, LlamaForCausalLM):
        with simulated_ranks(2) as mesh:
            model = tpplan.from_pretrained(folder, mesh, plan=plan_file, model_class=cls)
            assert model._tpplan_plan == tpplan.load_plan(plan_file)
            run = sharded_run(model, x)
        assert type(model) is LlamaForCausalLM
        assert max((o - want).abs().max().item() for o in run.outputs) < 1e-5


def test_dtype_defaults_to_the_config_s(tmp_path: Path) -> None:
    folder = _saved(tmp_path / "bf16", dtype=torch.bfloat16)
    with simulated_ranks(2) as mesh:
        default = tpplan.from_pretrained(folder, mesh)
    with simulated_ranks(2) as mesh:
        asked = tpplan.from_pretrained(folder, mesh, dtype="float32")
    assert {p.dtype for p in default.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in asked.parameters()} == {torch.float32}


def test_a_folder_saved_by_save_checkpoint_reloads_at_another_tp(tmp_path: Path) -> None:
    """save_checkpoint (safetensors, with config.json) of a model from_pretrained sharded at
    tp 2, loaded again at tp 4. (A DCP folder loads the same way, on real processes.)"""
    folder = _saved(tmp_path / "llama")
    x = token_batch()
    want, params = reference_run(_unsharded(folder), x)
    with simulated_ranks(2) as mesh:
        model = tpplan.from_pretrained(folder, mesh)
        tpplan.save_checkpoint(model, tmp_path / "again", sharded=False)
    with simulated_ranks(4) as mesh:
        run = sharded_run(tpplan.from_pretrained(tmp_path / "again", mesh), x)
    assert_matches(run, want, params, what="saved at tp 2, loaded at tp 4")


def test_a_model_id_is_read_from_the_local_hub_cache(tmp_path: Path, monkeypatch) -> None:
    """An id resolves to its snapshot in the hub cache (laid out as huggingface_hub lays it)."""
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / ("a" * 40)
    _saved(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    x = token_batch()
    want, _ = reference_run(_unsharded(snapshot), x)
    with simulated_ranks(2) as mesh:
        run = sharded_run(tpplan.from_pretrained("acme/tiny", mesh), x)
    assert max((o - want).abs().max().item() for o in run.outputs) < 1e-5


def test_what_it_cannot_load_is_named_with_the_fix(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(tpplan.PretrainedError) as e:
        tpplan.from_pretrained("acme/missing")
    assert str(e.value) == (
        f"'acme/missing' is no folder, and no model of that id is in the local Hugging Face "
        f"cache ({tmp_path / 'hub'}); tpplan never downloads. Fix: pass a model folder, or "
        "download it first (hf download acme/missing)."
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(tpplan.PretrainedError, match=r"empty has no config\.json.*Fix: point"):
        tpplan.from_pretrained(tmp_path / "empty")
    folder = _saved(tmp_path / "llama")
    with pytest.raises(tpplan.MeshError) as mesh_error:
        tpplan.from_pretrained(folder)
    assert "none is initialised. Fix: run the script under torchrun" in str(mesh_error.value)
    with simulated_ranks(2) as mesh:
        with pytest.raises(tpplan.PretrainedError, match="dtype 'int8' is not a floating"):
            tpplan.from_pretrained(folder, mesh, dtype="int8")
        with pytest.raises(tpplan.PretrainedError, match="model_class 3 is not a transformers"):
            tpplan.from_pretrained(folder, mesh, model_class=3)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_from_pretrained_on_gloo_ranks(tmp_path: Path, tp: int) -> None:
    """Under torchrun, with no mesh given and no process group initialised by the script:
    every rank gets the unsharded model's logits and gradients, and holds 1/tp of the
    split weights."""
    folder = _saved(tmp_path / "llama")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={tp}", str(HERE / "pretrained_ranks.py"), str(folder)]
    run = subprocess.run(
        cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(f"/{tp} matches") == tp, run.stdout


@pytest.mark.slow
def test_from_pretrained_under_tpplan_launch(tmp_path: Path) -> None:
    from pretrained_ranks import check_rank

    folder = _saved(tmp_path / "llama")
    assert tpplan.launch(check_rank, nprocs=2, args=(str(folder),)) == [
        "0/2 matches",
        "1/2 matches",
    ]
