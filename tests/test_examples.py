"""Every example runs as its README says and exits 0."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "examples"
EXAMPLES = sorted(ROOT.rglob("*.py"))
NOTEBOOKS = sorted(ROOT.rglob("*.ipynb"))
# Checked more closely by a test of its own below; run once, not twice.
OWN_TESTS = {"lightning_tp.py"}
# Run as their docstrings say, under torchrun with this many processes; the others as plain
# scripts (they start their ranks themselves).
TORCHRUN = {"hf_trainer.py": 2, "trl_sft.py": 2}
# What each example prints when it has checked its result. Each exits non-zero on a mismatch;
# the line also proves it got as far as the check (an example that returns early exits 0 too).
SAYS = {
    "fsdp_tp.py": r"^worst loss difference \S+, worst weight difference \S+ \(.*\); tolerance 1e-05$",
    "generate.py": r"^greedy tokens match \(12 new tokens x 2 prompts\)$",
    "hf_trainer.py": r"^worst difference \S+ \(tolerance 1e-04\)$",
    "infer_and_apply.py": r"^max abs difference from the unsharded model: \S+$",
    "launch_from_notebook.ipynb": r"^max abs difference from the unsharded model, per rank: \[",
    "moe_experts.py": r"^mode expert: shard ",
    "train_loop.py": r"^worst difference \S+ \(tolerance 1e-04\)$",
    "trl_sft.py": r"^worst difference \S+ \(tolerance 1e-04\)$",
    "workflow.py": r"^plan-as-code workflow done",
}


def test_there_are_examples() -> None:
    assert EXAMPLES
    assert NOTEBOOKS


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", [p for p in EXAMPLES if p.name not in OWN_TESTS], ids=lambda p: p.name
)
def test_example_runs(script: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = []
    if script.name in TORCHRUN:
        launcher = ["-m", "torch.distributed.run", "--standalone"]
        launcher.append(f"--nproc-per-node={TORCHRUN[script.name]}")
    run = subprocess.run(
        [sys.executable, *launcher, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert script.name in SAYS, "add to SAYS the line this example prints once its check passed"
    assert re.search(SAYS[script.name], run.stdout, re.M), run.stdout + run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(notebook: Path, tmp_path: Path) -> None:
    """A notebook's code cells, in order, in one fresh interpreter: what a kernel runs with
    "Run all", without Jupyter installed. The interpreter is __main__ as in a kernel, so
    start_method="fork" gets functions defined in a cell the same way."""
    cells = json.loads(notebook.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert code
    script = tmp_path / f"{notebook.stem}.py"
    script.write_text("\n\n".join(code) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=notebook.parent,  # a kernel starts in the notebook's folder
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert notebook.name in SAYS, "add to SAYS the line this notebook prints once its check passed"
    assert re.search(SAYS[notebook.name], run.stdout, re.M), run.stdout + run.stderr


@pytest.mark.slow
def test_lightning_example_trains_a_sharded_model() -> None:
    """examples/lightning_tp.py: Lightning's ModelParallelStrategy on 2 CPU ranks (gloo) with
    `configure_model` as the one line apply_plan(...): the parameters end up DTensors, two
    training steps give a finite loss, and `trainer.save_checkpoint` of the fused gate|up
    layers, consolidated, loads into plain transformers with the trained model's logits.
    TPPLAN_CHECK_INPUTS=1 makes every forward verify that both tp ranks got the same batch
    from Lightning's sampler (it raises otherwise)."""
    script = Path(__file__).resolve().parents[1] / "examples" / "lightning_tp.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TPPLAN_CHECK_INPUTS": "1"}
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stdout + run.stderr
    sharded = re.search(r"^sharded: (\d+) of (\d+) parameters are DTensors$", run.stdout, re.M)
    loss = re.search(r"^final loss: (\S+)$", run.stdout, re.M)
    assert sharded and loss, run.stdout + run.stderr
    assert 0 < int(sharded[1]) <= int(sharded[2])
    assert 0 < float(loss[1]) < float("inf")  # also false for nan
    read_back = re.search(
        r"^consolidated checkpoint in plain transformers: max logit difference (\S+)$",
        run.stdout,
        re.M,
    )
    assert read_back and float(read_back[1]) <= 1e-5, run.stdout + run.stderr
