"""Regions: the openers and closers that exchanged split tensors (trace/record.py defines
the words), found from the trace's links.
"""

from __future__ import annotations

from ..trace import Trace

__all__ = ["find_regions"]


def find_regions(trace: Trace) -> list[list[str]]:
    """Openers and closers joined by the split tensors they exchanged (union-find)."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for name in list(trace.regions.openers) + list(trace.regions.closers):
        root(name)
    for group in trace.regions.links:
        first, *rest = sorted(group)
        for other in rest:
            parent[root(other)] = root(first)
    out: dict[str, list[str]] = {}
    for name in parent:
        out.setdefault(root(name), []).append(name)
    return list(out.values())
