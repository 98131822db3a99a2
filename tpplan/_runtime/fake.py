"""Fake tensors whose failures are answers: a probe run that fails says what does not fit."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["quiet_fake_tensor_log"]


@contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """A probe that fails is an answer, not an error: fake tensors log failing kernels with
    their traceback, which would read as a crash to the user."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
