"""Developer sessions. `nox` alone runs the default ones, tests, zoo, lint, typecheck and docs:
what CI and the README run. `nox -s unit` is the tier that answers in under a minute; `nox` alone
runs it first inside `tests` and logs its time, so that CI's log shows it drift.

torch is pinned first in every session that installs it: 2.13.0 is the CPU build the
project is tested against, and unpinned pip would fetch a multi-GB CUDA build instead. Only
`torch_next` (opt-in) takes the newest release, from the CPU wheel index.
"""

from __future__ import annotations

import re
import time

import nox

nox.options.sessions = ["tests", "zoo", "lint", "typecheck", "docs"]
nox.options.reuse_venv = "yes"

TORCH = "torch==2.13.0"


def _install(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{','.join(extras)}]" if extras else ".")


def _without_zoo(posargs: list[str]) -> list[str]:
    """pytest's arguments with the zoo tests deselected: each `-m EXPR` given becomes
    `-m "(EXPR) and not zoo"` (pytest keeps the last -m, so each is rewritten), and without
    one, `-m "not zoo"` comes first."""
    out: list[str] = []
    args = iter(posargs)
    found = False
    for arg in args:
        if arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            expr = arg[2:].removeprefix("=") or next(args, "")
            out += ["-m", f"({expr}) and not zoo"]
            found = True
        else:
            out.append(arg)
    return out if found else ["-m", "not zoo", *out]


def _workers(posargs: list[str]) -> list[str]:
    """pytest-xdist's arguments unless the caller gave its own `-n`: as many workers as
    CPUs, at most 4, each test file on one worker (a file's module fixtures, such as the
    generate matrix's launches, then run once), one torch thread each (they share the
    cores). On 2 cores the suite takes about 28 minutes this way, about 50 in one process."""
    if any(a == "-n" or a.startswith(("-n", "--numprocesses")) for a in posargs):
        return []
    return ["-n", "auto", "--maxprocesses", "4", "--dist", "loadfile"]


def _unit_tier(session: nox.Session) -> None:
    """`pytest -m unit`, the docs' command for the tier (docs/development.md), then its wall time (startup and
    collection included) as a line of the log. One process: a second xdist worker imports
    torch and collects the tier again, and beside other jobs on 2 cores two workers took 49 s
    where one took 38 (issue 34)."""
    start = time.monotonic()
    session.run("pytest", "-m", "unit", *session.posargs)
    session.log(f"unit tier: {time.monotonic() - start:.1f} s (issue 34's goal: 30 s on 2 cores)")


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite, slow multi-process tests included (pass `-- -m 'not slow'` to skip
    them), but not the zoo: its packages are the `zoo` session's to install. Without
    arguments (CI, the README's `nox`) the unit tier runs first on its own: its time goes
    to the log, and a failure there stops the session before the half-hour run. The whole
    suite then runs the rest (`-m "not unit"`): the tier's tests have passed already."""
    _install(session, "test")
    posargs = list(session.posargs)
    if not posargs:
        _unit_tier(session)
        posargs = ["-m", "not unit"]
    args = [*_workers(posargs), *_without_zoo(posargs)]
    session.run("pytest", *args, env={"OMP_NUM_THREADS": "1"})


@nox.session
def zoo(session: nox.Session) -> None:
    """The model zoo (`pytest -m zoo`, tests/test_zoo.py): plans inferred for torchtitan,
    timm, diffusers, nanoGPT and transformers models, which need the `zoo` extra installed
    here; on as many workers as the suite, each model's tests on one."""
    _install(session, "test", "zoo")
    # timm requires torchvision, and pip takes PyPI's: a CUDA build that cannot load beside
    # CPU torch ("operator torchvision::nms does not exist"). Left installed, it breaks
    # transformers too (which imports torchvision whenever it is installed), and with it the
    # collection of the other test files. timm needs it only for data transforms:
    # tests/model_zoo/torchvision_stub.py stands in for it.
    session.run("python", "-m", "pip", "uninstall", "--yes", "--quiet", "torchvision")
    # workers as for the suite, each model's tests on one (its group, tests/conftest.py)
    workers = _workers(session.posargs)
    workers = [w if w != "loadfile" else "loadgroup" for w in workers]
    session.run("pytest", "-m", "zoo", *workers, *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def docs(session: nox.Session) -> None:
    """The docs site (docs/, mkdocs.yml) built into site/ with `mkdocs build --strict`: any
    warning, a broken link or anchor, a reference that does not resolve, fails it. Its
    reference pages are generated from the code by docs/hooks.py, which imports only
    tpplan's plan and command-line modules, and mkdocstrings reads docstrings from the
    source: no torch or transformers to install, so the session takes seconds in CI."""
    light = [r for r in _requirements("dependencies") if not r.startswith("transformers")]
    session.install("--no-deps", "-e", ".")
    session.install(*light, *_requirements("docs"))
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(default=False)
def unit(session: nox.Session) -> None:
    """The unit tier: schema, patterns, split algebra, messages, each style on the fake
    process group (`pytest -m unit`); under a minute on 2 cores. Arguments go to pytest."""
    _install(session, "test")
    _unit_tier(session)


@nox.session(default=False)
def torch_next(session: nox.Session) -> None:
    """The unit tier on the newest torch release (CPU build), past pyproject.toml's `<2.14`:
    tests/test_torch_compat.py first, whose failures name the private torch name that
    moved (tpplan/_runtime/torch_compat.py), then the whole tier. Opt-in: it downloads the
    release. Run it when torch releases; what fails is what to mend before the bound moves."""
    session.install("--upgrade", "--index-url", "https://download.pytorch.org/whl/cpu", "torch")
    # --no-deps keeps the torch above (the pin would take it back to 2.13); the other
    # dependencies and the test extra are installed by name, torch left out
    session.install("--no-deps", "-e", ".")
    session.install(*_requirements("dependencies"), *_requirements("test"))
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("pytest", "-m", "unit", "tests/test_torch_compat.py", *session.posargs)
    session.run("pytest", "-m", "unit", *session.posargs)


def _requirements(group: str) -> list[str]:
    """The requirements pyproject.toml lists in `dependencies` (group "dependencies") or in
    an extra, all but torch's."""
    project = nox.project.load_toml("pyproject.toml")["project"]
    found = project[group] if group == "dependencies" else project["optional-dependencies"][group]
    return [r for r in found if re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0] != "torch"]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, as linter and formatter check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(default=False)
def benchmarks(session: nox.Session) -> None:
    """The benchmarks/ scripts that need no GPU, one after another (about 8 minutes on 2
    cores); tables print, PNGs go to benchmarks/plots/ and results to
    benchmarks/results/. Opt-in: `nox -s benchmarks`, never part of the default run. Pass
    script names to run a subset: `nox -s benchmarks -- infer_time memory_tp`."""
    _install(session, "bench")
    scripts = session.posargs or ["infer_time", "memory_tp", "collectives", "forward_gloo"]
    for name in scripts:
        session.run("python", f"benchmarks/{name}.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the package."""
    _install(session)
    session.install("mypy", "types-PyYAML")
    session.run("mypy")
