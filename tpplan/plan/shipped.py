"""shipped: the plan files that come with tpplan, found by name.

The repository's `plans/` folder holds one plan per popular model family (`plans/llama.yaml`,
...), each written by `tpplan infer` and tested against what it infers today. An installed
tpplan carries them as `tpplan/plans`. `load_plan("llama")` reads the shipped plan when no
file of that name exists, and `tpplan infer` says when a shipped plan is written for the model
class it infers. Start at `shipped_plans`. No torch here: plan files stay quick to read.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import yaml

from .comments import load_yaml

__all__ = [
    "plans_folder",
    "shipped_for_class",
    "shipped_plan",
    "shipped_plans",
    "unknown_plan_hint",
]


def plans_folder() -> Path:
    """tpplan/plans in an installed package; the repository's plans/ in a source checkout."""
    package = Path(__file__).resolve().parents[1]  # tpplan/
    installed = package / "plans"
    return installed if installed.is_dir() else package.parent / "plans"


def shipped_plans() -> dict[str, Path]:
    """{name: file} for every shipped plan; the name is the file name without `.yaml`."""
    folder = plans_folder()
    if not folder.is_dir():
        return {}
    return {p.stem: p for p in sorted(folder.rglob("*.yaml"))}


def shipped_plan(name: str) -> Path | None:
    """The shipped plan called `name`, or None."""
    return shipped_plans().get(name)


def unknown_plan_hint(name: str) -> str:
    """What to say about a plan name that is neither a file nor a shipped plan."""
    names = sorted(shipped_plans())
    close = difflib.get_close_matches(name, names, n=1)
    guess = f"did you mean '{close[0]}'? " if close else ""
    listing = ", ".join(names) if names else "none are installed"
    return f"no such file, and no shipped plan of that name; {guess}shipped plans: {listing}."


def shipped_for_class(class_name: str) -> list[str]:
    """Names of the shipped plans written for models of class `class_name`."""
    found = []
    for name, path in shipped_plans().items():
        try:
            data = load_yaml(path.read_text())
        except (OSError, yaml.YAMLError):
            continue
        model = data.get("model") if isinstance(data, dict) else None
        if isinstance(model, dict) and model.get("class") == class_name:
            found.append(name)
    return found
