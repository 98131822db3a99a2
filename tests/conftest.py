"""Shared test settings: no test may leave the process's signal handlers changed, each test
has an answer cache of its own (tpplan/cli/answers.py), and `pytest -m unit` imports only the
test files that can hold a unit test.

torch's elastic launcher (under tpplan.launch, `verify --processes`) sets handlers for
SIGTERM and SIGINT; left in place, a SIGTERM to pytest only fails the running test and the
run goes on. A test that leaves a handler changed fails, naming the signal."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.tiers import COLLECTED, may_hold_unit_tests

_WATCHED = [signal.SIGTERM, signal.SIGINT]


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under `-m unit` exactly, leave out the test files that hold no unit test: they import
    transformers, peft and their models. With tests/support importing transformers only where
    a model is built, the tier's collection fell from 15 s to 9 (issue 34). A file named on
    the command line is always collected (pytest asks this hook only about the files it
    finds); any other expression collects everything."""
    if config.option.markexpr.strip() != "unit":
        return None
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return True if not may_hold_unit_tests(collection_path) else None


@pytest.hookimpl(tryfirst=True)
@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep every test collected, before `-m` deselects any: tests/test_tiers.py checks the
    unit marks of the whole suite also where the unit tier is deselected (nox runs the tier
    first, then the rest with `-m "not unit"`). A zoo test of one model joins that model's
    xdist group: the zoo session's workers (`--dist loadgroup`) then each infer a model's
    plans once (test_zoo.py's cache) and share the models out."""
    config.stash[COLLECTED] = list(items)
    for item in items:
        params = getattr(item, "callspec", None)
        name = params.params.get("name") if params is not None else None
        if name is not None and item.get_closest_marker("zoo") is not None:
            item.add_marker(pytest.mark.xdist_group(str(name)))


@pytest.fixture(autouse=True)
def _signal_handlers_unchanged() -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in _WATCHED}
    yield
    changed = [signal.Signals(s).name for s in _WATCHED if signal.getsignal(s) != before[s]]
    for s in _WATCHED:
        signal.signal(s, before[s])  # the next tests run with the handlers they expect
    assert not changed, f"the test left the handlers of {', '.join(changed)} changed"


@pytest.fixture(autouse=True)
def _own_answer_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every test computes its `tpplan check` answers: none is served from the cache of an
    earlier run (the user's ~/.cache/tpplan) or of another test."""
    monkeypatch.setenv("TPPLAN_CACHE_DIR", str(tmp_path_factory.mktemp("tpplan-cache")))
