"""The unit tier as the tests see it: which test files can hold a unit test."""

from __future__ import annotations

from pathlib import Path

import pytest

__all__ = ["COLLECTED", "UNIT_MARK", "may_hold_unit_tests"]

# every test a session collected, before `-m` deselected any (tests/conftest.py)
COLLECTED = pytest.StashKey[list[pytest.Item]]()

# how every unit test is marked: `pytestmark = pytest.mark.unit` or `@pytest.mark.unit`
UNIT_MARK = "mark.unit"


def may_hold_unit_tests(path: Path) -> bool:
    """Whether a test file names the unit mark: one that does not holds no unit test, since
    the mark is only ever applied in a test file's own source (tests/test_tiers.py checks it
    on every run that collects the whole suite)."""
    return UNIT_MARK in path.read_text()
