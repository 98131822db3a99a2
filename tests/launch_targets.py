"""Functions for test_processes.py to launch: module-level, so spawned ranks can import them."""

from __future__ import annotations

import torch.distributed as dist


def rank_and_size(offset: int) -> int:
    return offset + 10 * dist.get_rank() + dist.get_world_size()


def fail_on_rank(bad: int) -> None:
    if dist.get_rank() == bad:
        raise ValueError(f"rank {bad} was told to fail")
