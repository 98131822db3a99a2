"""Module-name patterns, matched exactly the way `parallelize_module` matches its keys.

A pattern is dot-separated; each segment is an fnmatch pattern matched against one child
name, so `*` never crosses a dot and a pattern matches names with the same number of
segments only. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

__all__ = ["collapse", "match_names", "matches", "wildcard"]


def matches(pattern: str, name: str) -> bool:
    """True when the full module name `name` is matched by `pattern`."""
    return _fits(_segments(pattern), name)


def match_names(pattern: str, names: Iterable[str]) -> list[str]:
    """The names matched by `pattern`, in the order given. The pattern is taken apart once
    (inference matches every rule against every module name of a 126-layer model, where
    fnmatch per segment cost 0.2 s)."""
    segments = _segments(pattern)
    return [n for n in names if _fits(segments, n)]


def _segments(pattern: str) -> list[tuple[str, bool]]:
    """Each segment of `pattern`, and whether it holds a wildcard (else it is compared as a
    string, which is what fnmatch would answer, at a fraction of the cost)."""
    return [(p, any(c in p for c in "*?[")) for p in pattern.split(".")]


def _fits(segments: list[tuple[str, bool]], name: str) -> bool:
    parts = name.split(".")
    return len(parts) == len(segments) and all(
        fnmatchcase(n, p) if wild else n == p for (p, wild), n in zip(segments, parts, strict=True)
    )


def wildcard(name: str) -> str:
    """The name with every numbered segment (a layer index) replaced by `*`."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def collapse(names: Sequence[str], all_names: Sequence[str]) -> list[str]:
    """Compact patterns covering exactly `names` among `all_names`.

    Numbered segments (layer indices) become `*` when the resulting pattern matches only
    names from `names`; otherwise the names are kept as they are. Order follows the first
    occurrence in `names`, so output is stable for a stable input.
    """
    wanted = set(names)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(wildcard(n), []).append(n)
    out: list[str] = []
    for pattern, members in groups.items():
        covered = set(match_names(pattern, all_names))
        if len(members) > 1 and covered <= wanted and covered == set(members):
            out.append(pattern)
        else:
            out.extend(members)
    return out
