"""The progress bar of a checkpoint load: huggingface_hub's tqdm, the bar transformers'
`from_pretrained` shows, drawn by rank 0 only.

`Progress` counts bytes as they are loaded. tqdm draws on a terminal and, through
`tqdm.auto`, as a widget in a notebook; elsewhere (logs, CI, a pipe) it draws nothing
(`disable=None`), and neither do ranks other than 0 (one bar, not one per rank). It obeys
what silences transformers' bars: `HF_HUB_DISABLE_PROGRESS_BARS=1` and
`huggingface_hub.utils.disable_progress_bars()`.
"""

from __future__ import annotations

import sys
from typing import Any

from huggingface_hub.utils import tqdm

from .._runtime.ranks import rank

__all__ = ["Progress"]


class Progress:
    """tqdm's bar over `total` bytes on stderr, from rank 0, on a terminal or a notebook."""

    def __init__(self, total: int, label: str) -> None:
        self._bar: Any = tqdm(
            total=max(total, 1),
            desc=label,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            disable=True if rank() != 0 else None,  # None: off where stderr is no terminal
            name="tpplan",
        )

    def __enter__(self) -> Progress:
        return self

    def advance(self, nbytes: int) -> None:
        self._bar.update(nbytes)

    def __exit__(self, *exc: object) -> None:
        self._bar.close()
