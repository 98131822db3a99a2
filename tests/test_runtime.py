"""Small helpers under every stage (tpplan/_runtime/), each on its own."""

from __future__ import annotations

import signal

import pytest

from tpplan._runtime.launch import _signal_handlers_kept

pytestmark = pytest.mark.unit


def test_a_launch_puts_the_callers_signal_handlers_back() -> None:
    """torch's elastic launcher sets SIGTERM and SIGINT handlers and leaves them; after a
    launch the caller's are back, so a SIGTERM still stops a test runner or a kernel."""

    def mine(signum: int, frame: object) -> None:
        raise AssertionError("not called")

    old = signal.signal(signal.SIGTERM, mine)
    # the caller's own SIGINT handler: Python's default, or SIG_IGN where the process was
    # started in the background of a shell without job control
    old_int = signal.signal(signal.SIGINT, mine)
    try:
        with _signal_handlers_kept():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what the launcher does
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)
