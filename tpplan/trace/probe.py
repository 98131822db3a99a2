"""Probes of single modules, run once on fake inputs before the trace: is this module a linear
layer of its own weight (`linear_like`, GPT-2's Conv1D, a hand-written Linear), and does it
run nn.Linear's own forward (`plain_forward`)?

Start at `linear_like`. The probe watches the ops of one forward (`_OpLog`); a probe that fails
answers "no", quietly (`quiet_fake_tensor_log`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._runtime.fake import quiet_fake_tensor_log
from .._runtime.torch_compat import FakeTensorMode, TorchDispatchMode

__all__ = ["linear_like", "plain_forward", "quiet_fake_tensor_log"]

# What a linear layer written by hand may do besides its one matrix product with the weight.
_LINEAR_OPS = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand",
    "clone", "contiguous", "_to_copy", "alias", "detach", "add", "sym_size", "sym_numel",
    "sym_stride", "dim", "is_contiguous", "lift_fresh", "device",
}  # fmt: skip
_PRODUCTS = {"mm", "addmm", "bmm", "matmul", "linear"}


class _OpLog(TorchDispatchMode):
    """Which ops a probe forward ran, and how the weight met the matrix product."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.flipped = {id(weight): False}  # weight and its transposes -> transposed?
        self.held: list[Any] = []  # keeps the transposes' ids unique while the probe runs
        self.others: set[str] = set()
        self.products: list[bool] = []  # per product with the weight: weight used as (in, out)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        ids = [id(a) for a in args if isinstance(a, torch.Tensor)]
        if name in ("t", "transpose", "permute") and ids and ids[0] in self.flipped:
            self.flipped[id(out)] = not self.flipped[ids[0]]
            self.held.append(out)
        elif name in _PRODUCTS:
            # mm(x, W) computes x @ W: W is stored (in, out); linear(x, W) and mm(x, W.t()) not
            second = args[2] if name == "addmm" else args[1]
            if id(second) in self.flipped:
                flipped = self.flipped[id(second)]
                self.products.append(flipped if name == "linear" else not flipped)
            else:
                self.others.add(name)
        elif name not in _LINEAR_OPS:
            self.others.add(name)
        return out


def plain_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    """The module runs `base`'s own forward (its class, or a subclass that keeps it)."""
    cls = type(module)
    for klass in cls.__mro__:
        if "forward" in vars(klass):
            return klass is base
    return False


def linear_like(module: nn.Module, fake: FakeTensorMode) -> bool | None:
    """Whether `module` (not an nn.Linear) computes a linear layer of its own 2-D weight:
    None if not, else whether the weight is stored (in, out) as in GPT-2's Conv1D. Decided by
    running it once on a fake input and watching its ops, not by its type or name."""
    weight = module._parameters.get("weight")
    bias = module._parameters.get("bias")
    if weight is None or weight.dim() != 2 or next(module.children(), None) is not None:
        return None
    if bias is not None and bias.dim() != 1:
        return None
    rows, cols = weight.shape
    for d_in, d_out in dict.fromkeys([(rows, cols), (cols, rows)]):
        if bias is not None and bias.shape[0] != d_out:
            continue
        with fake:
            x = torch.empty(2, 3, d_in, device=weight.device)
        log = _OpLog(weight)
        try:
            with torch.no_grad(), log, quiet_fake_tensor_log():
                out = module(x)
        except Exception:
            continue
        if (
            isinstance(out, torch.Tensor)
            and tuple(out.shape) == (2, 3, d_out)
            and not log.others
            and len(log.products) == 1
            and (rows == cols or (rows == d_in) == log.products[0])
        ):
            return log.products[0]
    return None
