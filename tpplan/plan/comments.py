"""A plan's YAML text, where each rule's `why` is the comment right above the rule.

Start at `write_yaml` and `read_yaml`. In YAML each rule's `why` is read like a code
comment; JSON keeps it as a key. pyyaml drops comments, so they are placed and found by
line: `yaml.compose` gives the start line of every item of `rules:` and `attributes:`, both
in the fixed shape written here and in hand-edited files. A `why:` key still works, and
wins. The text is byte-stable: what `write_yaml` writes, `read_yaml` reads back to data that
writes the same bytes. No torch here.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import yaml

from ..errors import PlanFileError

__all__ = ["load_yaml", "read_yaml", "write_yaml"]

# libyaml's parser where pyyaml was built with it: the same data as pyyaml's own parser (the
# constructor and resolver are pyyaml's either way) in a fraction of the time
_FAST_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_COMMENTED = ("rules", "attributes", "regions")  # the top-level lists whose items carry a `why`
_COMMENT_WIDTH = 100  # columns of a comment line, its indent and "# " included
_OWN_LINE = re.compile(r"^[ \t]*(-[ \t]+)*$")


# ---- writing ------------------------------------------------------------------------------
def write_yaml(data: dict[str, Any]) -> str:
    """YAML text of a plan's plain data (in its fixed key order), each `why` that a comment
    gives back exactly written as the comment above its item (and taken out of `data`); the
    others stay keys."""
    whys: dict[str, list[str | None]] = {}
    for key in _COMMENTED:
        whys[key] = [
            item.pop("why") if _fits_comment(item["why"]) else None for item in data.get(key, [])
        ]
    text = yaml.dump(
        data,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        width=10_000,
        allow_unicode=True,
    )
    return _with_why_comments(text, whys)


class _Dumper(yaml.SafeDumper):
    """Block style with lists indented under their key; lists of layouts stay on one line."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flat = all(not isinstance(x, (dict, list)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    # pyyaml writes the Unicode line breaks NEL, LS and PS raw inside single quotes, which
    # does not read back as written ('\x85' comes back as ' '); double quotes escape them.
    style = '"' if any(c in data for c in "\x85\u2028\u2029") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(str, _represent_str)


def _fits_comment(why: str) -> bool:
    """Whether comment lines give `why` back exactly: they are re-joined with single spaces,
    so line breaks, tabs, runs of spaces and outer spaces would be lost (such a `why` is
    written as a key instead)."""
    return why.isprintable() and why == why.strip() and "  " not in why


def _comment_lines(why: str, indent: str) -> list[str]:
    """`why` wrapped at single spaces into `# ` lines of at most _COMMENT_WIDTH columns (a
    longer word gets a line of its own, never broken)."""
    return textwrap.wrap(
        why,
        _COMMENT_WIDTH,
        initial_indent=f"{indent}# ",
        subsequent_indent=f"{indent}# ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def _with_why_comments(text: str, whys: dict[str, list[str | None]]) -> str:
    """Dumped YAML with each given `why` as comment lines above its item."""
    lines = text.splitlines(keepends=True)
    above: dict[int, str] = {}
    for key, starts in _item_lines(text).items():
        for why, start in zip(whys.get(key, []), starts, strict=True):
            if why is None:
                continue
            if start is None:  # _Dumper writes every item on a line of its own
                raise RuntimeError(f"tpplan bug: a {key} item shares its line in:\n{text}")
            line = lines[start]
            indent = line[: len(line) - len(line.lstrip(" "))]
            above[start] = "".join(f"{c}\n" for c in _comment_lines(why, indent))
    return "".join(above.get(i, "") + line for i, line in enumerate(lines))


# ---- reading ------------------------------------------------------------------------------
def read_yaml(text: str, *, source: str) -> Any:
    """The parsed YAML, with the comment block above each rule (or attribute rule) that has
    no `why:` key as its `why`; malformed YAML is a PlanFileError naming line and column."""
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise PlanFileError(source, [f"{where}malformed YAML: {problem}."]) from None
    return _whys_from_comments(data, text)


def _whys_from_comments(data: Any, text: str) -> Any:
    """`data` with the comment block above each item that has no `why:` key as its `why`; an
    item with neither is left for the "missing why" message."""
    if not isinstance(data, dict):
        return data
    wanting = [
        key
        for key in _COMMENTED
        if isinstance(data.get(key), list)
        and any(isinstance(item, dict) and "why" not in item for item in data[key])
    ]
    if not wanting:
        return data
    lines = text.splitlines()
    for key, starts in _item_lines(text).items():
        items = data.get(key)
        if key not in wanting or not isinstance(items, list) or len(items) != len(starts):
            continue
        for item, start in zip(items, starts, strict=True):
            if isinstance(item, dict) and "why" not in item and start is not None:
                why = _comment_above(lines, start)
                if why is not None:
                    item["why"] = why
    return data


def _comment_above(lines: list[str], line: int) -> str | None:
    """The contiguous `#` lines right above `line`, joined with single spaces."""
    parts: list[str] = []
    i = line - 1
    while i >= 0 and lines[i].lstrip().startswith("#"):
        parts.append(lines[i].strip()[1:].strip())
        i -= 1
    return " ".join(p for p in reversed(parts) if p) or None


def load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)`, parsed by libyaml where there is one. Text it refuses is
    parsed again by pyyaml's own parser, so that the error, its words and where it points,
    is pyyaml's on every install."""
    try:
        return yaml.load(text, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        return yaml.safe_load(text)


# ---- both ---------------------------------------------------------------------------------
def _item_lines(text: str) -> dict[str, list[int | None]]:
    """0-based start line of each item of the top-level `rules` and `attributes` lists; None
    for an item sharing its line with something before it (`rules: [{...}, {...}]`), whose
    comments above belong to that something."""
    try:
        root = yaml.compose(text, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        return {}
    if not isinstance(root, yaml.MappingNode):
        return {}
    lines = text.splitlines()
    out: dict[str, list[int | None]] = {}
    for key, value in root.value:
        if key.value in _COMMENTED and isinstance(value, yaml.SequenceNode):
            out[key.value] = [
                m.line if _OWN_LINE.match(lines[m.line][: m.column]) else None
                for m in (item.start_mark for item in value.value)
            ]
    return out
