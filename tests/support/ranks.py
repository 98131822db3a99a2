"""The tests' torchrun helpers: `torchrun` starts a rank script (tests/*_ranks.py,
gloo_parity.py, fsdp_tp_step.py) on gloo processes, and `finish` is how a rank script ends:
all ranks meet, tear down, and leave at once.

With torch 2.13 on gloo a process sometimes aborts after its work is done ("terminate called
without an active exception") while background threads wind down at interpreter exit; the
barrier and os._exit keep that noise from failing a run whose results are already printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

__all__ = ["ENV", "finish", "torchrun"]

# one thread per rank: the ranks share the machine's cores
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(
    script: Path, *launcher_args: str, script_args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """`python -m torch.distributed.run LAUNCHER_ARGS SCRIPT SCRIPT_ARGS`, its output kept."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher_args, str(script), *script_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=ENV)


def finish(failure: str | None) -> None:
    """End this rank: exit 1 printing `failure` when there is one, else 0."""
    dist.barrier()
    dist.destroy_process_group()
    if failure:
        print(failure, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failure else 0)
