"""The layer forwards whose computation the local-shard path knows (local_run.py), and the
subclasses that extend one of them.

Known: nn.Linear's, nn.Embedding's and transformers' Conv1D's (a Linear storing its weight
(in, out)). An *extending* forward is a subclass's own forward that calls the known one
through `super().forward(...)` and reads the layer's parameters for nothing but their
metadata (`self.weight.dtype`, `.device`, `.shape`): the scaled word embeddings of Gemma 2,
3 and 4, BART, Pegasus-X and SeamlessM4T (`super().forward(ids) * self.embed_scale`), or a
Linear whose output is scaled or clamped. Whatever such a forward does around the call, it
does to the known forward's output, so the local path replaces only the call: the module's
class gets one in between (`local_class`) whose forward is the local one, which the
subclass's `super()` then reaches. Start at `forward_of`.
"""

from __future__ import annotations

import dis
import itertools
import sys
from types import CodeType, FunctionType
from typing import Any

from torch import nn

from .linear_probe import computes_linear

__all__ = ["forward_of", "known_base", "local_class"]

# what an extending forward may read of a parameter: metadata, never the values
_METADATA = {"dtype", "device", "shape", "ndim", "is_cuda", "requires_grad"}
_PARAMS = {"weight", "bias"}
_LOADS = {"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"}


def _conv1d() -> type | None:
    """transformers' Conv1D, if transformers is imported: a model of it has imported it."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return getattr(utils, "Conv1D", None)


def _known() -> dict[Any, str]:
    known: dict[Any, str] = {nn.Linear.forward: "linear", nn.Embedding.forward: "embedding"}
    conv1d: Any = _conv1d()
    if conv1d is not None:
        known[conv1d.forward] = "conv1d"
    return known


def _extends(forward: Any) -> bool:
    """Whether `forward` calls `super().forward` and reads the parameters only for their
    metadata (see the module docstring)."""
    if not isinstance(forward, FunctionType) or any(
        isinstance(c, CodeType) for c in forward.__code__.co_consts
    ):
        return False  # a nested function could read the parameters unseen here
    ops = list(dis.get_instructions(forward))
    calls_super = any(op.opname == "LOAD_GLOBAL" and op.argval == "super" for op in ops) and any(
        op.opname in _LOADS and op.argval == "forward" for op in ops
    )
    if not calls_super:
        return False
    return not any(
        op.opname in _LOADS
        and op.argval in _PARAMS
        and (nxt.opname not in _LOADS or nxt.argval not in _METADATA)
        for op, nxt in itertools.pairwise(ops)
    )


def known_base(cls: type) -> tuple[type, str] | None:
    """(the class whose forward is a known one, its kind) for `cls`: itself, or the nearest
    base below classes whose own forwards all extend it; None otherwise."""
    known = _known()
    for klass in cls.__mro__:
        forward = klass.__dict__.get("forward")
        if forward is None:
            continue
        if forward in known:
            return klass, known[forward]
        if not _extends(forward):
            return None
    return None


def forward_of(module: nn.Module) -> str | None:
    """'linear', 'conv1d' or 'embedding' when the module's forward is one of those this path
    knows the computation of, or extends one (see the module docstring), or is proved to
    compute a Linear by its ops (linear_probe.py), else None."""
    found = known_base(type(module))
    if found is None and computes_linear(module):
        return "linear"  # a forward of its own, proved to compute a Linear (linear_probe.py)
    return None if found is None else found[1]


_local_classes: dict[tuple[type, Any], type] = {}


def local_class(cls: type, forward: Any) -> type:
    """A class like `cls` whose known base's forward is `forward`: `cls`'s own forward (an
    extending one) runs as it is, and its `super().forward` reaches `forward`. One per
    (class, forward)."""
    key = (cls, forward)
    if key not in _local_classes:
        found = known_base(cls)
        assert found is not None and found[0] is not cls, cls
        base = found[0]
        local_base = type(f"Local{base.__name__}", (base,), {"forward": forward})
        attrs = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _local_classes[key] = type(cls.__name__, (cls, local_base), attrs)
    return _local_classes[key]
