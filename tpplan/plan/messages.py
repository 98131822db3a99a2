"""pydantic's ValidationError as sentences: one per problem, each with its YAML line.

Start at `explain`. pydantic reports every problem of a plan at once, each at a location
(`('rules', 0, 'style')`); each becomes one line that names the place as a reader writes it
(`rules[0].style`) and, when the YAML text is at hand, the line it is on. The checks' own
messages (tpplan/plan/styles/, versions.py, layouts.py) already say what was given, what
is allowed and the fix; they pass through as they are. No torch here.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError

__all__ = ["explain"]


def explain(err: ValidationError, text: str | None) -> list[str]:
    """One sentence per problem in `err`, prefixed with its line in `text` (the YAML it was
    read from) when that is known."""
    issues = []
    for e in err.errors():
        loc = _untagged(tuple(e["loc"]))
        kind = e["type"]
        if kind == "extra_forbidden":
            field = loc[-1]
            parent = _loc(loc[:-1])
            msg = f"unknown field '{field}' in {parent}; remove it or check its spelling."
        elif kind == "missing":
            field = loc[-1]
            parent = _loc(loc[:-1])
            hint = (
                " Every rule says why it exists, in words a reviewer can check."
                if field == "why"
                else ""
            )
            msg = f"{parent} is missing the required field '{field}'.{hint}"
        elif kind == "value_error":
            msg = f"{_loc(loc)}: {e['ctx']['error']}"
        else:
            msg = f"{_loc(loc)}: {e['msg']} (got {e.get('input')!r})."
        line = _line_of(text, loc)
        issues.append(f"line {line}: {msg}" if line else msg)
    return issues


def _untagged(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """`loc` without the style pydantic puts after a rule's index (`('rules', 0, 'colwise',
    'head_dim')`: the union's tag, not a key of the file)."""
    if len(loc) > 2 and loc[0] == "rules" and isinstance(loc[1], int):
        return loc[:2] + loc[3:]
    return loc


def _loc(loc: tuple[Any, ...]) -> str:
    """A pydantic location as a reader writes it: `rules[0].style`; `plan` for the root."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "plan"


def _line_of(text: str | None, loc: tuple[Any, ...]) -> int | None:
    """1-based YAML line of the node at `loc` (of its key, in a mapping), when the text is at
    hand; the deepest node found when the rest of `loc` is not in the text."""
    if text is None:
        return None
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = node.start_mark.line if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if k.value == part), None)
            key = next((k for k, _ in node.value if k.value == part), None)
            if nxt is None:
                break
            line = key.start_mark.line if key is not None else nxt.start_mark.line
            node = nxt
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
        ):
            node = node.value[part]
            line = node.start_mark.line
        else:
            break
    return None if line is None else line + 1
