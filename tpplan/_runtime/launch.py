"""launch: run a function on N local ranks with the process group initialised, from a
notebook or a plain script, on top of torch's own elastic launcher (what torchrun runs).

tpplan starts no processes and opens no sockets of its own: this is a thin call into
torch.distributed.launcher. Start at `launch`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import TpplanError

__all__ = ["LaunchError", "launch"]


class LaunchError(TpplanError, RuntimeError):
    """A launched rank failed; the message names the rank and carries its error."""


def _on_rank(fn: Callable[..., Any], args: Sequence[Any], backend: str | None) -> Any:
    """Runs in each child: init the default process group, call fn, tear down."""
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        import os

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    try:
        result = record(fn)(*args)
        # All ranks leave together: gloo can abort a process torn down while peers still
        # talk. If the barrier breaks, a peer has failed, and its own error is the one to
        # report, not this rank's lost connection.
        with contextlib.suppress(RuntimeError):
            dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def _message(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
    return str(message).strip() or f"exit code {failure.exitcode}"


def _first_cause(failures: dict[int, Any], nprocs: int) -> str:
    """The failure that started it: when one rank raises, its peers then fail on a closed
    connection. Earliest first; at equal times (seconds), a rank that lost its peer is the
    consequence, not the cause."""

    def lost_peer(rank: int) -> bool:
        return "by peer" in _message(failures[rank])

    order = sorted(failures, key=lambda r: (failures[r].timestamp, lost_peer(r), r))
    first = order[0]
    others = (
        f" (then rank(s) {', '.join(str(r) for r in order[1:])} failed too)" if order[1:] else ""
    )
    return f"rank {first} of {nprocs} failed: {_message(failures[first])}{others}"


def launch(
    fn: Callable[..., Any],
    *,
    nprocs: int,
    args: Sequence[Any] = (),
    backend: str | None = None,
    start_method: str = "spawn",
) -> list[Any]:
    """Run `fn(*args)` on `nprocs` local ranks and return their results, rank 0 first.

    Every rank has the default process group initialised (NCCL when CUDA is available,
    else gloo), so `init_device_mesh` works inside `fn`. `fn` and `args` must be picklable
    (a module-level function) under the default "spawn" start method; "fork" also takes
    functions defined in a notebook. An error on any rank is raised here as LaunchError,
    naming the rank.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}.")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"tpplan-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # a free port on loopback, as torchrun --standalone
        max_restarts=0,
        start_method=start_method,
    )
    try:
        with _signal_handlers_kept():
            results = elastic_launch(config, _on_rank)(fn, tuple(args), backend)
    except ChildFailedError as e:
        raise LaunchError(_first_cause(e.failures, nprocs)) from None
    return [results[r] for r in sorted(results)]


_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """torch's elastic launcher sets this process's handlers for SIGTERM and friends (to
    stop its children) and leaves them set: afterwards a SIGTERM only raises an exception
    inside whatever runs, and a test runner or a notebook kernel no longer stops on it. The
    caller's handlers are put back when the launch returns."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers belong to the main thread; the launcher sets none elsewhere
        return
    numbers = [getattr(signal, name) for name in _SIGNALS if hasattr(signal, name)]
    kept = {n: signal.getsignal(n) for n in numbers}
    try:
        yield
    finally:
        for n, handler in kept.items():
            if handler is not None:  # set from outside Python: nothing to put back
                signal.signal(n, handler)
