"""The tests' torchrun helpers. `finish`: how the rank scripts (tests/*_ranks.py,
gloo_parity.py, ...) end: all ranks meet, tear down, and leave at once.

With torch 2.13 on gloo a process sometimes aborts after its work is done ("terminate called
without an active exception") while background threads wind down at interpreter exit; the
barrier and os._exit keep that noise from failing a run whose results are already printed.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

__all__ = ["finish"]


def finish(failure: str | None) -> None:
    """End this rank: exit 1 printing `failure` when there is one, else 0."""
    dist.barrier()
    dist.destroy_process_group()
    if failure:
        print(failure, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failure else 0)
