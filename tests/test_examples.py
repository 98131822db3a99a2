"""Every example runs as its README says and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").rglob("*.py"))
# Checked more closely by a test of its own below; run once, not twice.
OWN_TESTS = {"lightning_tp.py"}


def test_there_are_examples() -> None:
    assert EXAMPLES


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", [p for p in EXAMPLES if p.name not in OWN_TESTS], ids=lambda p: p.name
)
def test_example_runs(script: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.slow
def test_lightning_example_trains_a_sharded_model() -> None:
    """examples/lightning_tp.py: Lightning's ModelParallelStrategy on 2 CPU ranks (gloo) with
    `configure_model` as the one line apply_plan(...): the parameters end up DTensors and two
    training steps give a finite loss. TPPLAN_CHECK_INPUTS=1 makes every forward verify that
    both tp ranks got the same batch from Lightning's sampler (it raises otherwise)."""
    import re

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
