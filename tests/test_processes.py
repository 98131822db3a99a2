"""The real engine: torchrun starts gloo processes that apply a plan and check parity."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def torchrun(script: Path, nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_gloo_parity(tp: int) -> None:
    run = torchrun(HERE / "gloo_parity.py", tp)
    assert run.returncode == 0, run.stdout + run.stderr
    # ranks print concurrently, so their lines may share a line of stdout
    ranks = sorted(int(r) for r in re.findall(rf"rank (\d+)/{tp} worst", run.stdout))
    assert ranks == list(range(tp)), run.stdout
