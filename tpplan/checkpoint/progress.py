"""The progress bar of a checkpoint load: tqdm's, the bar transformers' `from_pretrained`
shows, drawn by rank 0 only.

`Progress` counts bytes as they are loaded. tqdm draws on a terminal and, through
`tqdm.auto`, as a widget in a notebook; elsewhere (logs, CI, a pipe) and on ranks other
than 0 (one bar, not one per rank) nothing is drawn.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm as plain_tqdm
from tqdm.auto import tqdm
from tqdm.autonotebook import tqdm as picked

from .ranks import rank

__all__ = ["Progress"]


class Progress:
    """tqdm's bar over `total` bytes on stderr, from rank 0, on a terminal or a notebook."""

    def __init__(self, total: int, label: str) -> None:
        # inside a notebook (whose stderr is no terminal) tqdm.auto draws a widget
        off_terminal = picked is plain_tqdm and not sys.stderr.isatty()
        self._bar: Any = tqdm(
            total=max(total, 1),
            desc=label,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            disable=rank() != 0 or off_terminal,
        )

    def __enter__(self) -> Progress:
        return self

    def advance(self, nbytes: int) -> None:
        self._bar.update(nbytes)

    def __exit__(self, *exc: object) -> None:
        self._bar.close()
