"""Layout strings: how a plan file names a tensor's placement over the tp ranks.

`replicate` (whole on every rank), `partial` (each rank holds a share of a sum) or
`shard(DIM)` (split along tensor dim DIM; negative counts from the end). Start at
`parse_layout`; tpplan/compile/ turns these into torch's placements. No torch here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["LAYOUT_HELP", "Layout", "check_layout", "check_layouts", "parse_layout"]

Layout = str
"""replicate | partial | shard(DIM)."""

_LAYOUT_RE = re.compile(r"^(replicate|partial|shard\((-?\d+)\))$")
LAYOUT_HELP = "replicate, partial, or shard(DIM) with DIM an integer such as shard(-1) or shard(1)"


def parse_layout(text: str) -> tuple[str, int | None]:
    """('shard', dim) / ('replicate', None) / ('partial', None) for a valid layout string."""
    m = _LAYOUT_RE.match(text)
    if not m:
        raise ValueError(f"'{text}' is not a layout; layouts are {LAYOUT_HELP}.")
    if m.group(2) is not None:
        return "shard", int(m.group(2))
    return m.group(1), None


def check_layout(value: Any) -> Any:
    """`value` as it is, when it is a valid layout string (anything else is left to the
    field's type); raises ValueError for a string that is not a layout."""
    if isinstance(value, str):
        parse_layout(value)
    return value


def check_layouts(value: Iterable[Any] | Mapping[str, Any] | None) -> Any:
    """`value` as it is, when every item of the list (or value of the mapping) is a valid
    layout or null."""
    items = value.values() if isinstance(value, Mapping) else value
    for item in items or ():
        check_layout(item)
    return value
