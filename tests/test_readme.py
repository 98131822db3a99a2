"""The README's claims against what backs them (issue #8): its numbers against the saved
benchmark results, its tables against the files they describe. A README edit or a file change
that makes them disagree fails here instead of going unnoticed."""

from __future__ import annotations

import json
from pathlib import Path

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
