"""The pre-commit hook the README offers (`.pre-commit-hooks.yaml`), and the example project
config that uses it (examples/plan_as_code/.pre-commit-config.yaml): the hook's entry is
tpplan's own console script, and the command pre-commit would run from the example config
passes a sound plan and fails a broken one. pre-commit itself is not installed here; the
hook has `pass_filenames: false`, so the command it runs is exactly entry + args."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from tpplan.cli import main

ROOT = Path(__file__).resolve().parents[1]
HOOKS = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
EXAMPLE = yaml.safe_load(
    (ROOT / "examples" / "plan_as_code" / ".pre-commit-config.yaml").read_text()
)


def _hook() -> dict[str, Any]:
    [hook] = [h for h in HOOKS if h["id"] == "tpplan-check"]
    return hook


def _example_hooks() -> list[dict[str, Any]]:
    hooks = [h for repo in EXAMPLE["repos"] for h in repo["hooks"]]
    assert hooks, "the example .pre-commit-config.yaml lists no hooks"
    return hooks


def test_the_hook_runs_tpplan_check_from_the_projects_environment() -> None:
    """`entry` names the console script pyproject.toml installs, with the `check` command;
    `system` because the check builds the project's model with the project's torch; no
    file names, because check takes a plan, a model and a tp size, not a list of files."""
    hook = _hook()
    script, *command = shlex.split(hook["entry"])
    # tomllib is 3.11+ and tpplan supports 3.10: read the one table by hand
    pyproject = (ROOT / "pyproject.toml").read_text()
    scripts = pyproject.split("\n[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    assert f'{script} = "tpplan.cli:main"' in scripts.splitlines()
    assert command == ["check"]
    assert hook["language"] == "system" and hook["pass_filenames"] is False


def test_the_example_config_uses_only_hooks_this_repository_declares() -> None:
    declared = {h["id"] for h in HOOKS}
    assert {h["id"] for h in _example_hooks()} <= declared


@pytest.mark.parametrize("hook", _example_hooks(), ids=lambda h: h["name"])
def test_each_example_hook_runs_when_its_plan_changes(hook: dict[str, Any]) -> None:
    """pre-commit runs a hook only for changed files its `files` pattern matches: the plan
    file the hook checks must be one of them, or editing the plan would skip the check."""
    plan = hook["args"][0]
    assert re.search(hook["files"], plan), f"{hook['files']!r} does not match {plan!r}"


def _gpt2_hook_argv() -> list[str]:
    """What pre-commit runs for the example's gpt2 hook: the entry without the script name
    (main is that script), then the hook's args."""
    [hook] = [h for h in _example_hooks() if h["args"][1] == "gpt2"]
    return [*shlex.split(_hook()["entry"])[1:], *hook["args"]]


def test_the_example_hook_passes_a_sound_plan(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run from this repository's root, the hook's `plans/gpt2.yaml` is the shipped GPT-2 plan,
    checked against GPT-2 built on the meta device at its published size."""
    monkeypatch.chdir(ROOT)
    code = main(_gpt2_hook_argv())
    out = capsys.readouterr().out
    assert code == 0 and "plans/gpt2.yaml: sound at tp 2" in out


def test_the_example_hook_fails_a_broken_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The edit the walkthrough warns about: the MLP's c_proj kept whole while c_fc still
    splits, so c_proj would read a shard as the whole tensor. A commit of it must stop."""
    sound = (ROOT / "plans" / "gpt2.yaml").read_text()
    rowwise = "  - match: transformer.h.*.mlp.c_proj\n    style: rowwise\n    transposed: true\n"
    assert sound.count(rowwise) == 1
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "gpt2.yaml").write_text(
        sound.replace(rowwise, "  - match: transformer.h.*.mlp.c_proj\n    style: replicate\n")
    )
    monkeypatch.chdir(tmp_path)  # the hook's plan path is relative to the project's root
    code = main(_gpt2_hook_argv())
    out = capsys.readouterr().out
    assert code == 1
    assert "(match: transformer.h.*.mlp.c_fc)" in out and "which the plan does not make" in out
