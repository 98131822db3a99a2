"""Modules the trace runs whole, on real tensors, where their forward does not run on fake ones.

Start at `run_whole`. A kernel's fake or meta implementation can fail where the real kernel
runs (SDPA with grouped kv heads in some latent-attention configs: "The size of tensor a (4)
must match the size of tensor b (8)"). A model on the meta device has no weights to trace
on instead, so rather than refusing the whole model, the module whose forward raised runs
on real tensors: a copy of it alone, made on the CPU with random weights (its size
bounded), fed zeros and random numbers of the fake inputs' shapes and dtypes, its outputs
made fake again. The tracer sees it as one opaque step: every split that enters it ends
there with the reason, and its own layers stay whole with it (`LayerFacts.whole`).

`failing_module` names the module a failed forward raised in (the innermost one running).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._runtime.torch_compat import FakeTensorMode, disable_current_modes, tree_leaves, tree_map
from .trackers import Trackers

__all__ = ["WHOLE_BYTES", "alike", "failing_module", "run_whole", "watch_failures"]

# the largest module copied onto the CPU to run whole (a block of a 70B model is ~1.7 GiB)
WHOLE_BYTES = 4 << 30


def watch_failures(model: nn.Module) -> list[str]:
    """Hooks on every module of `model` that leave on the returned list the modules whose
    forward began and has not returned: after a failed forward, the ones it raised in,
    innermost last."""
    running: list[str] = []
    for name, m in model.named_modules():

        def enter(mod: nn.Module, args: Any, name: str = name) -> None:
            running.append(name)

        def leave(mod: nn.Module, args: Any, out: Any) -> None:
            running.pop()

        m.register_forward_pre_hook(enter)
        m.register_forward_hook(leave)
    return running


def alike(model: nn.Module, name: str, why: str) -> dict[str, str]:
    """{module: why} for `name` and the module at the same place in every other block of
    the stacks (ModuleLists) around it, where it is of the same class: what fails in one
    block fails in all, and each would cost a trace of its own."""
    modules = dict(model.named_modules())
    out = {name: why}
    for prefix, m in modules.items():
        head = f"{prefix}." if prefix else ""
        if not isinstance(m, nn.ModuleList) or not name.startswith(head):
            continue
        index, _, rest = name[len(head) :].partition(".")
        if not index.isdigit():
            continue
        for i in range(len(m)):
            other = f"{head}{i}.{rest}" if rest else f"{head}{i}"
            if type(modules.get(other)) is type(modules[name]):
                out[other] = why
    return out


def failing_module(running: list[str]) -> str | None:
    """The innermost module a failed forward raised in; None at the model's own forward."""
    return running[-1] if running and running[-1] else None


def run_whole(
    copy_: nn.Module,
    model: nn.Module,
    names: dict[str, str],
    fake: FakeTensorMode,
    st: Trackers,
) -> None:
    """In the traced copy, make each module of `names` ({module: why its forward does not
    run on fake tensors}) run whole on real tensors (see the module docstring)."""
    for name, why in names.items():
        try:
            traced = copy_.get_submodule(name)
        except AttributeError:
            continue  # in a block a shortened stack left out
        real = _real_copy(model.get_submodule(name))
        reason = (
            f"{name.rpartition('.')[2]} runs whole: its forward does not run on fake tensors "
            f"({why}), so the trace ran it on real ones and could not follow a split through it"
        )
        st.trace.layers.whole[name] = reason
        for sub, _ in traced.named_modules():
            st.trace.layers.ran.add(f"{name}.{sub}" if sub else name)
        traced.forward = _opaque(real, fake, st, reason)


def _real_copy(module: nn.Module) -> nn.Module:
    """`module` itself when its weights are in memory; else a copy on the CPU with random
    weights, refused above `WHOLE_BYTES`."""
    tensors = [*module.parameters(), *module.buffers()]
    if not any(t.device.type == "meta" for t in tensors):
        return module
    size = sum(t.numel() * t.element_size() for t in tensors)
    if size > WHOLE_BYTES:
        raise MemoryError(f"{size / 2**30:.1f} GiB is too large to run whole on the CPU")
    made = copy.deepcopy(module).to_empty(device="cpu")
    with torch.no_grad():
        for t in [*made.parameters(), *made.buffers()]:
            if t.is_floating_point():
                t.normal_(0.0, 0.02)
            else:
                t.zero_()
    return made


def _opaque(real: nn.Module, fake: FakeTensorMode, st: Trackers, reason: str) -> Callable[..., Any]:
    device = next((t.device for t in [*real.parameters(), *real.buffers()]), torch.device("cpu"))

    def forward(*args: Any, **kwargs: Any) -> Any:
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        splits = [s for s in (st.splits.split_of(t) for t in leaves) if s is not None]
        if splits:
            st.trace.spans.break_(frozenset().union(*(s.sources for s in splits)), reason)
        where = next((t.device for t in leaves), torch.device("meta"))
        with disable_current_modes(), torch.no_grad():
            out = real(*tree_map(lambda t: _made(t, device), args),
                       **tree_map(lambda t: _made(t, device), kwargs))  # fmt: skip
            return tree_map(lambda t: _faked(t, fake, where), out)

    return forward


def _made(t: Any, device: torch.device) -> Any:
    """A real tensor of a fake one's shape and dtype: random numbers, or zeros (indices)."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point():
        return torch.randn(tuple(t.shape), dtype=t.dtype, device=device)
    return torch.zeros(tuple(t.shape), dtype=t.dtype, device=device)


def _faked(t: Any, fake: FakeTensorMode, device: torch.device) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return fake.from_tensor(t.to(device) if device.type == "meta" else t)
