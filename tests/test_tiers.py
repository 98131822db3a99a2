"""The unit tier leaves no unit test behind: under `-m unit`, tests/conftest.py skips the test
files whose source never names the unit mark (support/tiers.py), which is sound only while
every unit test is marked in its own file's source. A run that collects the whole suite
checks that here, on the tests it collected (before `-m` deselected any: nox's run of the
suite after the tier deselects the tier)."""

from __future__ import annotations

import pytest
from support.tiers import COLLECTED, UNIT_MARK, may_hold_unit_tests


def test_every_unit_test_is_marked_in_its_own_files_source(request: pytest.FixtureRequest) -> None:
    collected = request.config.stash.get(COLLECTED, request.session.items)
    unit = [item for item in collected if item.get_closest_marker("unit")]
    if not unit:
        pytest.skip("no unit test in this session: run it with them (pytest, -m 'not slow')")
    files = {item.path for item in unit}
    root = request.config.rootpath
    hidden = sorted(str(p.relative_to(root)) for p in files if not may_hold_unit_tests(p))
    assert not hidden, (
        f"unit tests in files that never say {UNIT_MARK!r}, which `pytest -m unit` would not "
        f"collect (mark them with pytest.{UNIT_MARK} in the file itself): {', '.join(hidden)}"
    )
