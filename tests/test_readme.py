"""The README's claims against what backs them (issue #8): its numbers against the saved
benchmark results, its tables against the files they describe. A README edit or a file change
that makes them disagree fails here instead of going unnoticed."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _one_line(text: str) -> str:
    """Markdown paragraphs wrap anywhere: compare with runs of whitespace as one space."""
    return " ".join(text.split())


def test_the_no_plan_bar_count_is_the_saved_results() -> None:
    """The sentence "at most 0.6 of the parameters per rank on N of the M popular ones" is the
    tracer bar's part 2 as benchmarks/infer_bar.py last saved it."""
    rows = json.loads((ROOT / "benchmarks" / "results" / "infer_bar.json").read_text())["noplan"]
    assert rows, "infer_bar.json holds no rows for architectures without a plan"
    within = [r for r in rows if r["status"] == "ok" and r["ours_fraction"] <= 0.6]
    claim = f"at most 0.6 of the parameters per rank on {len(within)} of the {len(rows)} popular"
    assert claim in _one_line(README)


def _shipped_table() -> dict[str, str]:
    """{name: class} from the README's shipped-plans table (the rows of `| `name` | Class |`)."""
    section = README.split("\n## Shipped plans\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (\w+) \|", section, flags=re.M)
    assert rows, "no rows found in the README's shipped-plans table"
    table = dict(rows)
    assert len(table) == len(rows), "a plan is listed twice"
    return table


def test_the_shipped_plans_table_lists_every_plan_file_and_its_class() -> None:
    """One row per file in plans/ (recursive, as tpplan finds them), each with the class the
    file is written for: a plan added, renamed or regenerated for another class fails here."""
    files = {p.stem: p for p in sorted((ROOT / "plans").rglob("*.yaml"))}
    assert files, "no plan files in plans/"
    classes = {name: yaml.safe_load(p.read_text())["model"]["class"] for name, p in files.items()}
    assert _shipped_table() == classes


def test_the_shipped_plan_count_is_the_number_of_files() -> None:
    count = len(list((ROOT / "plans").rglob("*.yaml")))
    assert f"holds a plan for each of {count} popular families" in _one_line(README)


def test_the_benchmark_scripts_nox_runs_are_the_ones_named() -> None:
    """`nox -s benchmarks` runs the default list in noxfile.py's benchmarks session; the README
    names those scripts, and every other script in benchmarks/ as run by hand."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    [session] = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "benchmarks"]
    [default] = [n for n in ast.walk(session) if isinstance(n, ast.BoolOp)]
    # `session.posargs or [...]`: the list is what runs when no script is named
    by_nox = [ast.literal_eval(e) for e in default.values[1].elts]
    assert by_nox
    text = _one_line(README.split("\n## Tests\n", 1)[1])
    named = ", ".join(f"`{name}`" for name in by_nox)
    assert (
        f"`nox -s benchmarks` runs {_count(len(by_nox))} of the CPU benchmark scripts ({named};"
        in text
    )
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")}
    by_hand = scripts - set(by_nox)
    assert by_hand and all(f"`{name}.py`" in text for name in by_hand)


def _count(n: int) -> str:
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    return words[n] if n < len(words) else str(n)


def test_the_checkpoint_memory_table_is_the_saved_results() -> None:
    """benchmarks/README.md shows the table `checkpoint_memory.py --render` prints from
    benchmarks/results/checkpoint_memory.json: a rerun whose table was not pasted, or a table
    edited by hand, fails here. (`--render` imports neither torch nor transformers.)"""
    run = subprocess.run(
        [sys.executable, "benchmarks/checkpoint_memory.py", "--render"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    table = run.stdout.strip()
    assert "| tpplan, safetensors | 2 |" in table
    assert table in (ROOT / "benchmarks" / "README.md").read_text()
