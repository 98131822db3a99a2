"""Ranks, real and simulated, as code that saves and loads meets them: which rank this is,
each rank's local tensor, a barrier, and agreeing on failure so that no rank hangs.

Start at `agree_on_failure`: every step of a save that can fail on one rank is followed by
it, so all ranks raise together and none waits in a collective another rank never reaches.
The simulation is torch's private LocalTensorMode (see tpplan/_runtime/local.py); `simulated`
and `each_rank` are the only saving and loading code that knows about it. Under simulated
ranks the collectives here are skipped: every rank runs in this one process, in step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .local import outside_simulation

__all__ = ["agree_on_failure", "barrier", "cause", "each_rank", "rank", "simulated"]


def rank() -> int:
    """This process's rank; 0 without a process group (and for every simulated rank)."""
    return dist.get_rank() if dist.is_initialized() else 0


def simulated() -> bool:
    """Whether every rank runs in this process (LocalTensorMode is on)."""
    from .torch_compat import local_tensor_mode

    return local_tensor_mode() is not None


def each_rank(local: torch.Tensor, fill: Callable[[int, torch.Tensor], None]) -> None:
    """fill(rank, that rank's local tensor) for this process's rank, or for every simulated
    rank when `local` holds one value per rank."""
    from .torch_compat import LocalTensor, local_tensor_mode

    mode = local_tensor_mode()
    if mode is not None and isinstance(local, LocalTensor):
        with mode.disable():
            for r, value in sorted(local._local_tensors.items()):
                fill(r, value)
        return
    with outside_simulation():
        fill(rank(), local)


def barrier() -> None:
    """Wait for every real rank (nothing to wait for alone or under simulation)."""
    if dist.is_initialized() and not simulated() and dist.get_world_size() > 1:
        dist.barrier()


def agree_on_failure(failure: BaseException | None) -> BaseException | None:
    """Every rank learns whether any rank failed, so all of them raise (none hangs): this
    rank's own failure, else the first other rank's as a CheckpointError, else None."""
    if not dist.is_initialized() or simulated() or dist.get_world_size() == 1:
        return failure
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, None if failure is None else cause(failure))
    if failure is not None:
        return failure
    for other, text in enumerate(flags):
        if text is not None:
            return CheckpointError(f"saving failed on rank {other}: {text}")
    return None


def cause(e: BaseException) -> str:
    """One line for an error; DCP's CheckpointException carries each rank's error with its
    whole traceback, of which the first error itself is what a reader needs."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first, (inner, _) = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        return f"rank {first}: {type(inner).__name__}: {inner}"
    return f"{type(e).__name__}: {e}"
