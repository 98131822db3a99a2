"""Layer forwards of their own that compute exactly a Linear, proved by the ops they run.

Start at `computes_linear`. A subclass of nn.Linear may write its forward out by hand
(Falcon's `input @ self.weight.T`, then `+ self.bias`): the same computation as
`F.linear(input, weight, bias)`, in other ops. The local-shard path (local_run.py) may then
run its own F.linear on the rank's rows, as for nn.Linear. The proof runs the forward once on
meta tensors standing for the input and the parameters, and follows them through every
torch function it calls: the weight may only be transposed and multiplied into the input,
the bias only added to that product, and the forward must return that sum. Anything else
that touches them (a norm of the weight, a scale, a second use) is no proof, and the layer
keeps the paths that need none.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .._runtime.torch_compat import tree_leaves

__all__ = ["computes_linear"]

# properties reach __torch_function__ as their getters
_TRANSPOSES: set[Any] = {
    torch.Tensor.t,
    torch.t,
    torch.Tensor.T.__get__,  # type: ignore[attr-defined]
    torch.Tensor.mT.__get__,  # type: ignore[attr-defined]
}
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
_ADDS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_TRANSPOSE_DIMS = {torch.transpose, torch.Tensor.transpose}

_proved: dict[tuple[type, bool, int], bool] = {}


class _Follow(TorchFunctionMode):
    """Tags the tensors computed from the input ("x"), the weight ("w"), its transpose
    ("wt"), their product ("xw") and the product plus the bias ("xwb"); any other use of
    them is a failure."""

    def __init__(self, tags: dict[int, str]) -> None:
        super().__init__()
        self.tags = tags
        self.failed = False
        self.kept: list[Any] = []  # outputs held so that their ids stay unique

    def _tag(self, t: Any) -> str | None:
        return self.tags.get(id(t)) if isinstance(t, torch.Tensor) else None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tags = [self._tag(a) for a in tree_leaves((args, kwargs))]
        if not any(tags):
            return out
        tag = self._result(func, args, kwargs, tags)
        if tag is None or not isinstance(out, torch.Tensor):
            # metadata reads (`.shape`, `.dtype`) hand back no tensor: no computation
            self.failed |= isinstance(out, torch.Tensor) or (tag is None and _computes(func))
            return out
        self.kept.append(out)
        self.tags[id(out)] = tag
        return out

    def _result(self, func: Any, args: Any, kwargs: Any, tags: list[str | None]) -> str | None:
        first = self._tag(args[0]) if args else None
        given = [t for t in tags if t]
        if func in _TRANSPOSES and given == ["w"]:
            return "wt"
        if func in _TRANSPOSE_DIMS and given == ["w"] and {*args[1:3]} in ({0, 1}, {0, -1}):
            return "wt"
        if func in _MATMULS and first == "x" and given == ["x", "wt"]:
            return "xw"
        if func is F.linear and given[:2] == ["x", "w"] and len(given) in (2, 3):
            return "xw" if len(given) == 2 else ("xwb" if given[2] == "b" else None)
        if func in _ADDS and sorted(given) == ["b", "xw"] and kwargs.get("alpha", 1) == 1:
            return "xwb"
        return None


def _computes(func: Any) -> bool:
    """Whether `func` may compute with a tensor (not a metadata read)."""
    name = getattr(func, "__name__", "")
    return name not in {"__get__", "size", "dim", "__len__"} or func in _TRANSPOSES


def computes_linear(module: nn.Module) -> bool:
    """Whether `module`'s own forward, an nn.Linear subclass's, computes exactly
    `F.linear(input, weight, bias)` on a (2, in_features) input (see the module docstring).
    Proved once per class and bias (present or not)."""
    if not isinstance(module, nn.Linear):
        return False
    has_bias = module.bias is not None
    key = (type(module), has_bias, module.in_features)
    if key not in _proved:
        _proved[key] = _prove(module, has_bias)
    return _proved[key]


def _prove(module: nn.Linear, has_bias: bool) -> bool:
    x = torch.empty(2, module.in_features, device="meta")
    w = torch.empty(module.out_features, module.in_features, device="meta")
    params: dict[str, Any] = {"weight": w, "bias": None}
    tags = {id(x): "x", id(w): "w"}
    if has_bias:
        b = torch.empty(module.out_features, device="meta")
        params["bias"] = b
        tags[id(b)] = "b"
    # a shallow copy holding the meta stand-ins, its forward called directly: the module's
    # own attributes, parameters and hooks are not touched, whatever the forward writes
    probe = copy.copy(module)
    probe._parameters = {**module._parameters, **params}
    probe._buffers = dict(module._buffers)
    probe._modules = dict(module._modules)
    follow = _Follow(tags)
    try:
        with follow:
            out = type(module).forward(probe, x)
    except Exception:
        return False
    want = "xwb" if has_bias else "xw"
    return not follow.failed and isinstance(out, torch.Tensor) and follow.tags.get(id(out)) == want
