"""The README's claims against what backs them (issue #8): its numbers against the saved
benchmark results, its tables against the files they describe. A README edit or a file change
that makes them disagree fails here instead of going unnoticed."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.pretrained import run_pretrained_line

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


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
    """{name: class} from the docs' shipped-plans table (the rows of `| `name` | Class |`)."""
    page = (DOCS / "guides" / "plans-as-code.md").read_text()
    section = page.split("\n## Shipped plans\n", 1)[1].split("\n## ", 1)[0]
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
    page = (DOCS / "guides" / "plans-as-code.md").read_text()
    for text in (README, page):
        assert f"holds a plan for each of {count} popular families" in _one_line(text)


def test_the_benchmark_scripts_nox_runs_are_the_ones_named() -> None:
    """`nox -s benchmarks` runs the default list in noxfile.py's benchmarks session; the docs'
    development page names those scripts, and every other script in benchmarks/ as run by hand."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    [session] = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "benchmarks"]
    [default] = [n for n in ast.walk(session) if isinstance(n, ast.BoolOp)]
    # `session.posargs or [...]`: the list is what runs when no script is named
    by_nox = [ast.literal_eval(e) for e in default.values[1].elts]
    assert by_nox
    page = (DOCS / "development.md").read_text()
    text = _one_line(page.split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0])
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


BENCHMARKS_README = (ROOT / "benchmarks" / "README.md").read_text()
RESULTS = ROOT / "benchmarks" / "results"

# Every script with `--render`: how to make it print without redrawing its plot, and the
# results/NAME.md that holds its full render (None where the render folds nothing away).
RENDERS = [
    ("checkpoint_memory", [], None),
    ("code_styles", [], "code_styles"),
    ("code_styles", ["--single"], "code_styles_single"),
    ("collectives", ["--no-plot"], None),
    ("forward_gloo", ["--no-plot"], None),
    ("infer_bar", [], "infer_bar"),
    ("infer_time", ["--no-plot"], None),
    ("kv_heads", [], None),
    ("memory_tp", ["--no-plot"], "memory_tp"),
    ("moe_bar", [], "moe_bar"),
    ("region_cost", [], None),
    ("region_decode", [], None),
    ("runtime", ["--no-plot"], "runtime"),
    ("runtime", ["--gpu", "--no-plot"], "runtime_gpu"),
    ("tp1_overhead", [], "tp1_overhead"),
    ("zoo", [], "zoo"),
]


def _render(script: str, argv: list[str]) -> str:
    """What `benchmarks/SCRIPT.py --render ARGV` prints. It imports neither torch nor
    transformers, but for code_styles.py, whose cases are the tests' own."""
    run = subprocess.run(
        [sys.executable, f"benchmarks/{script}.py", "--render", *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@pytest.mark.parametrize(("script", "argv", "full"), RENDERS)
def test_a_benchmark_table_is_the_saved_results(
    script: str, argv: list[str], full: str | None
) -> None:
    """benchmarks/README.md shows what `SCRIPT --render` prints from
    benchmarks/results/SCRIPT.json, the short render where the tables are long: a rerun
    whose render was not pasted, or a table edited by hand, fails here."""
    table = _render(script, argv)
    assert "\n|---|" in table or f"](results/{full}.md)" in table
    assert table in BENCHMARKS_README


@pytest.mark.parametrize(
    ("script", "argv", "full"), [r for r in RENDERS if r[2]], ids=[r[2] for r in RENDERS if r[2]]
)
def test_a_full_tables_file_is_the_full_render(script: str, argv: list[str], full: str) -> None:
    """benchmarks/results/NAME.md, which the short render links to, is what `SCRIPT --render
    --full` prints: a file a rerun did not rewrite, or one edited by hand, fails here."""
    page = (RESULTS / f"{full}.md").read_text()
    assert page.strip() == _render(script, [*argv, "--full"])


def test_every_full_tables_file_is_a_render() -> None:
    """No benchmarks/results/*.md stays behind that no script renders (a renamed results
    name), and none is missing."""
    assert {p.stem for p in RESULTS.glob("*.md")} == {r[2] for r in RENDERS if r[2]}


def test_the_benchmarks_readme_holds_at_most_400_lines() -> None:
    """The current results only: each short render with its command, machine and date; the
    long tables are in results/NAME.md, and history stays in git."""
    assert BENCHMARKS_README.count("\n") <= 400


def test_the_forward_gloo_command_shown_is_the_one_that_made_its_table() -> None:
    """The settings benchmarks/results/forward_gloo.json records (rounds, warm-up, tokens,
    models) are what the command benchmarks/README.md shows parses to."""
    shown = re.search(r"Command: `python benchmarks/forward_gloo.py([^`]*)`", BENCHMARKS_README)
    assert shown, "benchmarks/README.md shows no forward_gloo.py command"
    parse = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import forward_gloo; "
        "print(json.dumps(vars(forward_gloo.command_line().parse_args(sys.argv[1:]))))"
    )
    run = subprocess.run(
        [sys.executable, "-c", parse, *shown.group(1).split()],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    args = json.loads(run.stdout)
    saved = json.loads((ROOT / "benchmarks" / "results" / "forward_gloo.json").read_text())
    keys = ("batch", "seq", "warmup", "iters")
    assert {k: args[k] for k in keys} == {k: saved[k] for k in keys}
    assert args["models"] == [r["model"] for r in saved["rows"]]


def _tour_commands() -> list[str]:
    """The shell commands of the README's five-minute tour, in order: every line of its
    ```bash blocks (step 5 is Python for the reader's own script)."""
    tour = README.split("\n## A five-minute tour\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```bash\n(.*?)^```", tour, flags=re.M | re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def _tour_script() -> tuple[str, str]:
    """Step 5 of the tour: its Python block, and the torchrun command it is run with."""
    tour = README.split("\n## A five-minute tour\n", 1)[1].split("\n## ", 1)[0]
    [script] = re.findall(r"^```python\n(.*?)^```", tour, flags=re.M | re.S)
    [command] = re.findall(r"`(torchrun [^`]*)`", tour)
    return script, command


# Three processes that each import torch and transformers, the last verifying a 2-layer
# GPT-2 forward and backward over 4 simulated ranks: ~25 s on 2 cores.
@pytest.mark.slow
def test_the_tour_runs_as_written(tmp_path: Path) -> None:
    """The tour's commands, exactly as the README writes them, one after another in an empty
    folder with the `tpplan` console script on PATH: each exits 0, check finds the plan sound
    and verify finds the sharded model equal to the unsharded one."""
    commands = _tour_commands()
    tpplan = {c.split()[1]: c for c in commands if c.startswith("tpplan ")}
    assert list(tpplan) == ["infer", "check", "verify"], commands
    # run what a reader would type: tpplan and the one-line plan edit, never an installer
    assert all(c.split()[0] in ("tpplan", "sed") for c in commands), commands
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = {}
    for command in commands:
        run = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, f"{command}\n{run.stdout}\n{run.stderr}"
        out[command] = run.stdout
    tp = {name: c.split("--tp ", 1)[1].split()[0] for name, c in tpplan.items()}
    assert f"sound at tp {tp['check']}" in out[tpplan["check"]]
    last = out[tpplan["verify"]].splitlines()[-1]
    assert last.startswith(f"tp {tp['verify']}: the sharded model matches the unsharded one")
    # step 5, the script as written, under the torchrun command the README gives
    script, command = _tour_script()
    (tmp_path / "apply_gpt2.py").write_text(script)
    run = _torchrun_as_written(command, tmp_path, env)
    assert "logits (1, 3, 50257)" in run.stdout


def _torchrun_as_written(
    command: str, cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """A README's `torchrun ...` command, run by this Python's torch; it must exit 0."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    run = subprocess.run(
        torchrun + command.split()[1:], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, f"{command}\n{run.stdout}\n{run.stderr}"
    return run


def _first_example() -> tuple[str, str, str]:
    """The README's first screen: its one Python block, the model id it loads, and the
    torchrun command it is run with."""
    head = README.split("\n## ", 1)[0]
    [script] = re.findall(r"^```python\n(.*?)^```", head, flags=re.M | re.S)
    [model_id] = re.findall(r'from_pretrained\("([^"]+)"\)', script)
    [command] = re.findall(r"`(torchrun [^`]*)`", head)
    return script, model_id, command


@pytest.mark.slow
def test_the_first_example_runs_as_written(tmp_path: Path) -> None:
    """The one line on the README's first screen, saved and run with the torchrun command it
    gives, loads its model id from the Hugging Face cache (a tiny Llama saved there under
    that id: tpplan never downloads) split over 2 gloo ranks."""
    script, _, command = _first_example()
    assert script.count("\n") <= 3, "the first example is meant to be one line"
    run = run_pretrained_line(script, command, tmp_path)
    assert run.stdout.count("DTensor (32, 64)") == 2, run.stdout


def _map_section() -> str:
    return (DOCS / "concepts" / "codebase.md").read_text()


@pytest.mark.unit
def test_the_map_names_every_stage_and_only_files_that_exist() -> None:
    """The docs' map of the code lists each subpackage of tpplan/ (and only those), and every
    file its question table points to exists: a module moved or renamed fails here."""
    section = _map_section()
    drawn = set(re.findall(r"^  (\w+)/ ", section, flags=re.M))
    packages = {p.parent.name for p in (ROOT / "tpplan").glob("*/__init__.py")}
    assert drawn == packages, f"map draws {sorted(drawn)}, tpplan/ has {sorted(packages)}"
    table = section.split("| Question | File |", 1)[1]
    files = re.findall(r"`([\w/]+\.py|[\w/]+/)`", table)
    assert len(files) > 20, "the question table names too few files to be the map"
    missing = [f for f in files if not (ROOT / "tpplan" / f).exists()]
    assert not missing, f"the docs' map names files tpplan/ does not have: {missing}"
