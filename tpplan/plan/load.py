"""load_plan: a plan from a file (YAML, or JSON for `.json`), or a shipped plan by its name.

Start at `load_plan`. Plan files are UTF-8 whatever the locale says; a file that cannot be
read, is not UTF-8 or is binary is one message naming the file and the fix. Parsing and
validation are `Plan.from_yaml` / `Plan.from_json` (tpplan/plan/schema.py). No torch here.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import PlanFileError
from .schema import Plan
from .shipped import shipped_plan, unknown_plan_hint

__all__ = ["load_plan"]


def load_plan(path: str | Path) -> Plan:
    """Read a plan file (YAML, or JSON for `.json`), or a plan shipped with tpplan by its
    name (`load_plan("llama")`) when no file of that name exists."""
    path = Path(path)
    bare = len(path.parts) == 1 and not path.suffix
    if bare and not path.exists():
        shipped = shipped_plan(str(path))
        if shipped is None:
            raise PlanFileError(str(path), [unknown_plan_hint(str(path))])
        path = shipped
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PlanFileError(str(path), [f"cannot read the file: {e.strerror}."]) from None
    text = _utf8(data, str(path))
    if path.suffix == ".json":
        return Plan.from_json(text, source=str(path))
    return Plan.from_yaml(text, source=str(path))


def _utf8(data: bytes, source: str) -> str:
    """A plan file's text; YAML and JSON plan files are UTF-8, whatever the locale says."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - data.rfind(b"\n", 0, e.start)
        where = f"byte 0x{data[e.start]:02x} at line {line}, column {column}"
        issue = (
            f"a binary file, not a YAML or JSON plan ({where} is not UTF-8). Fix: check that "
            "PLAN names a plan file."
            if b"\0" in data
            else f"{where} is not UTF-8; plan files are UTF-8 text. Fix: save the file as UTF-8."
        )
        raise PlanFileError(source, [issue]) from None
