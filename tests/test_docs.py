"""The docs site (docs/, built by `nox -s docs`): every code block in it runs, and what it
generates from the code names everything the code has.

A fenced block is either text (an illustration or a command's output) or code, and code is
run here unless it is included from a file another test runs. The line right above a block
says how (`<!-- test: KIND -->`):
- `shell`: the page's shell blocks run in order in one empty folder, with `tpplan` on PATH;
- `output` (a text block): lines a command printed, in order, in the output of the page's
  shell block right above it;
- `python`: the page's Python blocks, joined, run as one script (`tpplan.launch` starts ranks);
- `plan`: YAML through the plan schema (a whole plan, or rules as a plan's `rules:` hold them);
- `install`, `ci`: the install and CI commands, held to what `.ci/run` and pyproject say;
- `pretrained`: the one-line `from_pretrained`, run as README's first example is;
- `tests/NAME.py`: run by that test file, which names the page.
A block whose only line is `--8<-- "examples/NAME.py"` includes an example, which
tests/test_examples.py runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.pretrained import run_pretrained_line

import tpplan

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
FENCE = re.compile(
    r"^(?:<!-- test: (?P<kind>[\w./-]+) -->\n)?(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```$",
    flags=re.M | re.S,
)
KINDS = {"shell", "output", "python", "plan", "install", "ci", "pretrained"}


@dataclass(frozen=True)
class Block:
    page: Path
    kind: str | None
    lang: str
    body: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}: ```{self.lang} {self.body.splitlines()[:1]}"


def _blocks(page: Path) -> list[Block]:
    out = []
    for m in FENCE.finditer(page.read_text()):
        indent = len(m["indent"])
        body = "\n".join(line[indent:] for line in m["body"].splitlines()) + "\n"
        out.append(Block(page, m["kind"], m["lang"], body))
    return out


BLOCKS = [b for page in PAGES for b in _blocks(page)]


def _included(block: Block) -> Path | None:
    m = re.fullmatch(r'--8<-- "([^"]+)"\n', block.body)
    return ROOT / m.group(1) if m else None


@pytest.mark.unit
def test_there_are_pages_and_blocks() -> None:
    assert len(PAGES) > 15 and len(BLOCKS) > 20, (len(PAGES), len(BLOCKS))


@pytest.mark.unit
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_every_code_block_is_run_by_a_test(block: Block) -> None:
    """Text blocks aside, each block says which test runs it, or includes an example."""
    included = _included(block)
    if included is not None:
        assert included.is_file() and included.parent == ROOT / "examples", included
        return  # tests/test_examples.py runs every examples/*.py
    assert block.lang in ("python", "bash", "yaml", "text"), f"{block}: give the block a language"
    if block.lang == "text":
        assert block.kind in (None, "output"), block
        return
    assert block.kind is not None, f"{block}: say which test runs it (<!-- test: KIND -->)"
    if block.kind.startswith("tests/"):
        test = (ROOT / block.kind).read_text()
        assert str(block.page.relative_to(ROOT)) in test, f"{block.kind} does not run {block.page}"
    else:
        assert block.kind in KINDS, block


def _kind(kind: str) -> list[Path]:
    return sorted({b.page for b in BLOCKS if b.kind == kind})


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


# Each page's commands build tiny models on the meta device: 5-15 s a command on 2 cores.
@pytest.mark.slow
@pytest.mark.parametrize("page", _kind("shell"), ids=lambda p: str(p.relative_to(DOCS)))
def test_shell_blocks_run_and_print_what_the_page_shows(page: Path, tmp_path: Path) -> None:
    printed = ""
    for block in _blocks(page):
        if block.kind == "shell":
            run = subprocess.run(
                ["bash", "-e", "-c", block.body], cwd=tmp_path, env=_env(), capture_output=True,
                text=True, timeout=600,
            )  # fmt: skip
            assert run.returncode == 0, f"{block}\n{run.stdout}\n{run.stderr}"
            printed = run.stdout
        elif block.kind == "output":
            _assert_lines_in_order(block.body.splitlines(), printed.splitlines(), str(block))


def _assert_lines_in_order(want: list[str], printed: list[str], where: str) -> None:
    at = 0
    for line in want:
        try:
            at = printed.index(line, at) + 1
        except ValueError:
            raise AssertionError(f"{where}: the command no longer prints {line!r}") from None


@pytest.mark.slow
@pytest.mark.parametrize("page", _kind("python"), ids=lambda p: str(p.relative_to(DOCS)))
def test_python_blocks_run_as_one_script(page: Path, tmp_path: Path) -> None:
    script = "\n\n".join(b.body for b in _blocks(page) if b.kind == "python")
    (tmp_path / "page.py").write_text(script)
    run = subprocess.run(
        [sys.executable, "page.py"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, f"{page}\n{run.stdout}\n{run.stderr}"


def _as_plan(text: str) -> str:
    """A plan's text: the block itself, or rules as a plan's `rules:` list holds them."""
    if text.lstrip().startswith("tpplan:"):
        return text
    body = "\n".join("  " + line if line.strip() else line for line in _dedent(text).splitlines())
    return f"tpplan: {tpplan.SCHEMA_VERSION}\nrules:\n{body}\n"


def _dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text)


def _plan_texts() -> list[tuple[str, str]]:
    out = [(str(b), b.body) for b in BLOCKS if b.kind == "plan"]
    examples = (DOCS / "reference" / "style_examples.yaml").read_text()
    for style, rule in re.findall(r"^# style: (\w+)\n(.*?)(?=^# style:|\Z)", examples, re.M | re.S):
        out.append((f"style_examples.yaml: {style}", rule))
    return out


@pytest.mark.unit
@pytest.mark.parametrize(("where", "text"), _plan_texts(), ids=[w for w, _ in _plan_texts()])
def test_plan_blocks_are_valid_plans(where: str, text: str) -> None:
    plan = tpplan.Plan.from_yaml(_as_plan(text), source=where)
    assert plan.rules, where


@pytest.mark.unit
def test_the_install_commands_pin_torch_first() -> None:
    blocks = [b for b in BLOCKS if b.kind == "install"]
    assert blocks
    for block in blocks:
        first = block.body.split("&&")[0].split()
        assert first == ["pip", "install", "torch==2.13.0"], block
    pinned = re.search(r'"torch>=2\.13,<2\.14"', (ROOT / "pyproject.toml").read_text())
    assert pinned, "pyproject.toml no longer takes torch 2.13 only: change the docs with it"


def _without_flags(command: str) -> list[str]:
    return [w for w in shlex.split(command) if not w.startswith("--")]


@pytest.mark.unit
def test_the_ci_command_is_what_ci_runs() -> None:
    """The docs' CI command, flags aside, is .ci/run's, command by command."""
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith("python3")
    ]
    blocks = [b for b in BLOCKS if b.kind == "ci"]
    assert blocks
    for block in blocks:
        shown = [_without_flags(c) for c in block.body.strip().split("&&")]
        assert shown == [_without_flags(c) for c in ci], block


@pytest.mark.slow
def test_the_quickstart_one_line_runs(tmp_path: Path) -> None:
    [block] = [b for b in BLOCKS if b.kind == "pretrained"]
    page = block.page.read_text()
    [command] = re.findall(
        r"`(torchrun [^`]*)`", page.split(block.body, 1)[0].rsplit("\n## ", 1)[1]
    )
    run = run_pretrained_line(block.body, command, tmp_path)
    assert run.stdout.count("DTensor (32, 64)") == 2, run.stdout


# ---- what the site generates from the code ----------------------------------------------------
def _hooks():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_the_plan_reference_has_every_style_and_field() -> None:
    from tpplan.plan.rule import STYLE_CLASSES

    text = _hooks().styles()
    for name, cls in STYLE_CLASSES.items():
        section = text.split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]
        for field in cls.model_fields:
            if field not in ("match", "style", "why"):
                assert f"| `{field}` |" in section, (name, field)
        assert "```yaml" in section, name


@pytest.mark.unit
def test_the_cli_reference_has_every_command() -> None:
    import argparse

    from tpplan.cli import _parser

    [sub] = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    text = _hooks().cli()
    assert sub.choices
    for name in sub.choices:
        assert f"### `tpplan {name}`" in text, name


def test_the_errors_reference_has_every_public_error() -> None:
    text = _hooks().errors()
    public = [n for n in tpplan.__all__ if n.endswith("Error")]
    assert public
    for name in public:
        assert f"### {name}\n" in text, name
    assert "### TrainerSetupError\n" in text  # one defined away from tpplan/errors.py


@pytest.mark.unit
def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES:
        assert f" {page.relative_to(DOCS)}\n" in nav, page


@pytest.mark.unit
def test_no_stale_words() -> None:
    """The site says what the code does now, not what it did before a change."""
    for page in PAGES:
        text = page.read_text()
        for word in ("issue 3", "stop 4", "used to be", "not run yet"):
            assert word not in text, (page, word)
