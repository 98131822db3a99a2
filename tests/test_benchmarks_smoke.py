"""Benchmark scripts the README names but no machine here can run for real: their smoke modes
on CPU, so the script itself does not rot before a GPU run. They check the code path, not the
numbers (CPU times of a tiny model say nothing about GPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _results_state() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in RESULTS.glob("*")} if RESULTS.is_dir() else {}


# A gloo process group of one, a 1-layer tiny Llama and 2 timed calls: ~12 s on 2 cores,
# most of it importing torch and transformers; slow for that, not for processes.
@pytest.mark.slow
def test_gpu_overhead_smoke_on_cpu_prints_its_table_and_saves_nothing() -> None:
    before = _results_state()
    # the script makes its own group of one unless torchrun's variables are set
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = ["--smoke-cpu", "--no-plot", "--layers", "1", "--warmup", "1", "--iters", "2"]
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu_overhead.py", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("SMOKE RUN ON CPU")
    assert "| case | plain ms | torch styles ms | over plain | logits Δ | tpplan ms |" in run.stdout
    assert "| 1 token |" in run.stdout
    # a smoke run's times are not a result: benchmarks/results/ must be as it was
    assert _results_state() == before
