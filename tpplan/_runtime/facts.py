"""Facts about a model that inferring and checking a plan both need, read from the module
tree alone (meta models too; no weights read): its fingerprint (class and parameter shapes,
to tell when a plan was written for another model, and what differs), the parameters it
holds more than once (tied weights), and how a rule splits a parameter."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from torch import nn

from ..plan.patterns import wildcard
from .torch_compat import ConvNd

if TYPE_CHECKING:
    from ..plan.rule import Rule, WeightKind

__all__ = [
    "channel_conv",
    "describe_mismatch",
    "fingerprint",
    "parameter_shapes",
    "tied_groups",
    "weight_kind",
    "weight_split",
]


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


def channel_conv(module: nn.Module) -> bool:
    """A convolution that is a Linear over its channels (dim 1): nn.Conv1d/2d/3d (or a
    subclass keeping torch's forward) with one group, any kernel, stride, padding or
    dilation. Every output channel sums over every input channel (each at its own kernel
    offsets), so its output channels are features like a Linear's, split colwise (each rank
    computes its own channels) or rowwise (each rank sums over its own input channels, one
    all-reduce adds them) alike. A grouped or depthwise convolution mixes channels only
    inside a group: it is no Linear over them."""
    base = next((c for c in (nn.Conv1d, nn.Conv2d, nn.Conv3d) if isinstance(module, c)), None)
    if base is None or any(
        getattr(type(module), f) is not getattr(base, f) for f in ("forward", "_conv_forward")
    ):
        return False
    conv: ConvNd = module  # type: ignore[assignment]
    return conv.groups == 1


def tied_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """(module, parameter name) of every holder of each parameter held more than once."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for full, p in model.named_parameters(remove_duplicate=False):
        mod, _, name = full.rpartition(".")
        holders.setdefault(id(p), []).append((mod, name))
    return [g for g in holders.values() if len(g) > 1]


def weight_kind(module: nn.Module) -> WeightKind:
    """What holds a module's weight, as a style's facts take it (`Rule.weight_dim`)."""
    if isinstance(module, nn.Embedding):
        return "embedding"
    return "conv" if isinstance(module, ConvNd) else "linear"


def weight_split(rule: Rule | None, module: nn.Module, param: str) -> str:
    """How a rule splits one parameter of its module, in words ("whole" when it does not)."""
    kind = weight_kind(module)
    if rule is None or rule.weight_dim(kind) is None:
        return "whole"
    if param != "weight":
        if param in (getattr(rule, "written", None) or ()):
            return f"dim {getattr(module, param).dim() - 1}"
        dim = rule.bias_dim(kind)
        return "whole" if dim is None else f"dim {dim}"
    parts = " as fused parts" if getattr(rule, "parts", None) else ""
    return f"dim {rule.weight_dim(kind)}" + ("" if kind == "embedding" else parts)
