"""Dotted module names: where a name sits in the model (inside a root, a module's own
parameters, the modules sharing a parameter) and how a `why` writes names (relative to
their common prefix, joined into a list, repeated blocks written once as a pattern).
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from .._runtime.facts import tied_groups
from ..plan.patterns import wildcard

__all__ = [
    "PLAIN_OPS",
    "inside",
    "join",
    "join_names",
    "own_params",
    "own_split_state",
    "relative",
    "shared_params",
    "tied_outside",
]

# Ops too plain to count as evidence in `why`.
PLAIN_OPS = {
    "linear", "alias", "clone", "_to_copy", "detach", "expand", "contiguous", "lift_fresh",
    "_unsafe_view", "view", "reshape", "unsqueeze", "squeeze", "_reshape_alias",
}  # fmt: skip


def inside(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def tied_outside(shared: dict[str, list[str]], root: str) -> bool:
    """Whether a module under `root` holds a parameter also held by one outside it."""
    return any(
        inside(m, root) and not inside(o, root) for m, others in shared.items() for o in others
    )


def relative(names: list[str]) -> dict[str, str]:
    """Names without their common leading segments, so that `why` reads the same in every layer."""
    parts = [n.split(".") for n in names]
    k = 0
    while all(len(p) > k + 1 for p in parts) and len({p[k] for p in parts}) == 1:
        k += 1
    return {n: ".".join(p[k:]) for n, p in zip(names, parts, strict=True)}


def join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def join_names(names: list[str]) -> str:
    """Module names for a `why`, the same module of three or more blocks written once as a
    pattern (`*.layer.0.SelfAttention.o`): a region that spans blocks (T5's position bias,
    computed in block 0 and read by all) then reads, and collapses, the same in every block."""
    groups: dict[str, list[str]] = {}
    for n in sorted(names):
        groups.setdefault(wildcard(n), []).append(n)
    out: list[str] = []
    for group in groups.values():
        if len(group) < 3:
            out.extend(group)
            continue
        # only the segments that differ become `*` (`layer.0` stays when every member has it)
        segments = zip(*(n.split(".") for n in group), strict=True)
        out.append(".".join(s[0] if len(set(s)) == 1 else "*" for s in segments))
    return join(sorted(out))


def shared_params(model: nn.Module) -> dict[str, list[str]]:
    """Module -> other modules holding one of its parameters (tied weights)."""
    out: dict[str, list[str]] = {}
    for group in tied_groups(model):
        mods = {m for m, _ in group}
        for m in mods:
            others = sorted(mods - {m})
            if others:
                out.setdefault(m, []).extend(others)
    return out


def own_params(module: nn.Module, name: str) -> list[str]:
    prefix = f"{name}." if name else ""
    return [prefix + n for n, _ in module.named_parameters(recurse=False)]


def own_split_state(module: nn.Module, name: str, split: Collection[str]) -> list[str]:
    """The module's own parameters, and its own buffers among `split` (a BatchNorm's running
    statistics, split with the channels)."""
    prefix = f"{name}." if name else ""
    buffers = [prefix + n for n, _ in module.named_buffers(recurse=False)]
    return own_params(module, name) + [b for b in buffers if b in split]
