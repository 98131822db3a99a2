"""`tpplan check`'s answer cache (tpplan/cli/answers.py): the same check answered again
from the cache, anything it depends on changed computed anew; and the commands that need no
model (a usage error, `schema`, a cached answer) never import torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.models import TINY_LLAMA_CONFIG, TINY_LLAMA_FLAGS
from support.plans import LLAMA_PLAN

from tpplan.cli import main
from tpplan.cli.answers import answer_key, cache_dir

ROOT = Path(__file__).resolve().parents[1]
CACHED = "(a cached result of the same check; --no-cache checks again)"


def check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, bool]:
    """(exit code, stdout, whether the answer came from the cache)."""
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, CACHED in err


def test_the_same_check_again_is_answered_from_the_cache(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [str(LLAMA_PLAN), "llama", "--tp", "2", *TINY_LLAMA_FLAGS]
    first = check(capsys, *argv)
    second = check(capsys, *argv)
    assert first == (0, first[1], False) and "sound at tp 2" in first[1]
    assert second == (0, first[1], True)  # exactly the text computed, and the same exit code


def test_a_failed_check_is_answered_from_the_cache_with_its_exit_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [str(LLAMA_PLAN), "llama", "--tp", "8", *TINY_LLAMA_FLAGS]
    code, out, _ = check(capsys, *argv)
    assert code == 1 and check(capsys, *argv) == (1, out, True)


@pytest.mark.parametrize("change", ["plan bytes", "an override", "tp", "--no-cache"])
def test_a_change_checks_again(
    change: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_bytes(LLAMA_PLAN.read_bytes())
    argv = [str(plan), "llama", "--tp", "2", *TINY_LLAMA_FLAGS]
    check(capsys, *argv)
    if change == "plan bytes":
        plan.write_bytes(LLAMA_PLAN.read_bytes() + b"# edited\n")
    elif change == "an override":
        argv += ["--set", "rms_norm_eps=1e-5"]
    elif change == "tp":
        argv[3] = "4"
    else:
        argv.append("--no-cache")
    code, out, cached = check(capsys, *argv)
    assert code == 0 and "sound" in out and not cached


def test_a_model_folder_whose_config_changed_checks_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    argv = [str(LLAMA_PLAN), str(folder), "--tp", "2"]
    _, out, _ = check(capsys, *argv)
    assert check(capsys, *argv) == (0, out, True)
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA_CONFIG, "num_hidden_layers": 3}))
    assert check(capsys, *argv) == (0, out, False)


def test_a_corrupt_cache_file_is_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(LLAMA_PLAN), "llama", "--tp", "2", *TINY_LLAMA_FLAGS]
    _, out, _ = check(capsys, *argv)
    files = list((cache_dir() / "answers").iterdir())
    assert files
    for f in files:
        f.write_text('{"key": "not json')
    assert check(capsys, *argv) == (0, out, False)
    assert check(capsys, *argv) == (0, out, True)  # computed again, and stored again


def test_a_cache_that_cannot_be_written_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TPPLAN_CACHE_DIR", str(blocker))  # a file, not a folder
    argv = [str(LLAMA_PLAN), "llama", "--tp", "2", *TINY_LLAMA_FLAGS]
    code, out, _ = check(capsys, *argv)
    assert code == 0 and "sound" in out and check(capsys, *argv)[2] is False


def test_a_model_of_the_users_own_code_is_never_cached(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert answer_key("check", str(LLAMA_PLAN), "support.models:tiny_llama", [], 2) is None
    argv = [str(LLAMA_PLAN), "support.models:tiny_llama", "--tp", "2"]
    check(capsys, *argv)
    assert check(capsys, *argv)[2] is False


@pytest.mark.unit
def test_the_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TPPLAN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert cache_dir() == Path("/xdg/tpplan")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path("~/.cache/tpplan").expanduser()


def _imports_torch(*argv: str) -> tuple[bool, subprocess.CompletedProcess[str]]:
    """Run the CLI in a fresh interpreter (this one has torch imported); whether it did."""
    code = (
        "import sys\nfrom tpplan.cli import main\nrc = main(sys.argv[1:])\n"
        "print('torch' in sys.modules, file=sys.stderr)\nsys.exit(rc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return done.stderr.rstrip().endswith("True"), done


@pytest.mark.parametrize(
    "argv",
    [
        ["schema"],
        ["check"],
        ["check", "plan.yaml", "llama", "--tp", "0"],
        ["chek", "plan.yaml"],
        ["verify", "llama"],
    ],
)
def test_schema_and_usage_errors_do_not_import_torch(argv: list[str]) -> None:
    imported, done = _imports_torch(*argv)
    assert not imported, done.stderr
    assert done.returncode == (0 if argv == ["schema"] else 2)


def test_a_cached_answer_does_not_import_torch(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["check", str(LLAMA_PLAN), "llama", "--tp", "2", *TINY_LLAMA_FLAGS]
    main(argv)
    capsys.readouterr()
    imported, done = _imports_torch(*argv)
    assert CACHED in done.stderr and not imported
    assert done.returncode == 0 and "sound at tp 2" in done.stdout
