"""A model's fingerprint: its class and parameter shapes, to tell when a plan was written for
another model, and to say what differs when it was. Works on meta models; no weights read."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from ._patterns import wildcard

if TYPE_CHECKING:
    from torch import nn

__all__ = ["describe_mismatch", "fingerprint", "parameter_shapes"]


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def parameter_shapes(model: nn.Module) -> dict[str, str]:
    """{parameter pattern: "(shape)" or "(shape) xN"}, collapsed over numbered layers whose
    parameters share a shape."""
    groups: dict[str, dict[str, int]] = {}
    exact: dict[str, str] = {}
    for name, p in model.named_parameters():
        s = _shape(tuple(p.shape))
        exact[name] = s
        groups.setdefault(wildcard(name), {}).setdefault(s, 0)
        groups[wildcard(name)][s] += 1
    out: dict[str, str] = {}
    for name, s in exact.items():
        pattern = wildcard(name)
        shapes = groups[pattern]
        if len(shapes) == 1:
            n = shapes[s]
            out.setdefault(pattern, s if n == 1 else f"{s} x{n}")
        else:
            out[name] = s
    return out


def fingerprint(model: nn.Module) -> str:
    """sha256 over the class name and every parameter's name and shape."""
    h = hashlib.sha256(type(model).__name__.encode())
    for name, p in model.named_parameters():
        h.update(f"\n{name}:{tuple(p.shape)}".encode())
    return "sha256:" + h.hexdigest()[:16]


def describe_mismatch(
    written_for: dict[str, str] | None, model: nn.Module, *, limit: int = 6
) -> str:
    """What differs between the recorded parameter shapes and the model's, in one sentence."""
    if written_for is None:
        return "(the plan records no parameter shapes, so what differs cannot be shown)"
    now = parameter_shapes(model)
    diffs = []
    for k in written_for.keys() - now.keys():
        diffs.append(f"{k} {written_for[k]} is not in the model")
    for k in now.keys() - written_for.keys():
        diffs.append(f"{k} {now[k]} is new in the model")
    for k in written_for.keys() & now.keys():
        if written_for[k] != now[k]:
            diffs.append(f"{k} was {written_for[k]}, is {now[k]}")
    diffs.sort()
    more = f"; and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return (
        "; ".join(diffs[:limit]) + more
        if diffs
        else "(the recorded shapes agree; the class differs)"
    )
