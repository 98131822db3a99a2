"""A one-line progress bar for loading a checkpoint, drawn by rank 0 on a terminal only.

`Progress` counts bytes as they are loaded. It draws nothing when stderr is not a terminal
(logs and CI stay clean) and nothing on ranks other than 0 (one bar, not one per rank).
"""

from __future__ import annotations

import sys
import time

from .ranks import rank

__all__ = ["Progress"]


class Progress:
    """A one-line progress bar on stderr, from rank 0, only when stderr is a terminal."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = max(total, 1), label, 0
        self.on = rank() == 0 and sys.stderr.isatty()
        self._last = 0.0

    def __enter__(self) -> Progress:
        return self

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.on and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            sys.stderr.write(
                f"\r{self.label} [{bar:<30}] {frac:4.0%} "
                f"{self.done / 2**20:,.0f}/{self.total / 2**20:,.0f} MiB"
            )
            sys.stderr.flush()

    def __exit__(self, *exc: object) -> None:
        if self.on:
            sys.stderr.write("\n")
            sys.stderr.flush()
