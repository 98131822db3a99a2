"""A model sharded on the meta device and run before its weights exist fails deep inside
torch ("Tensor on device meta is not on the expected device cpu"). `guard_meta_weights`
hooks the root of a model apply_plan left with meta tensors: a forward that gets real inputs
while any weight is still meta raises MetaWeightsError naming the fix, before torch runs. The
hook removes itself at the first forward that finds every weight made, so the hot path pays
nothing after that. Forwards on meta inputs (plan_stats' counting run) pass untouched.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn

from .._runtime.torch_compat import tree_leaves
from ..errors import MetaWeightsError

__all__ = ["guard_meta_weights"]


def _meta(model: nn.Module) -> list[str]:
    tensors = chain(model.named_parameters(), model.named_buffers())
    return [name for name, t in tensors if t.is_meta]


def guard_meta_weights(model: nn.Module) -> None:
    """Make a forward of `model` on real inputs raise MetaWeightsError while any of its
    parameters or buffers is on the meta device (see the module docstring); nothing is
    hooked when none is."""
    if not _meta(model):
        return

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        given = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
        if given is None or given.is_meta:
            return  # a run on meta tensors (counting, shapes) needs no weights
        left = _meta(module)
        if not left:
            handle.remove()  # loaded: no cost on later forwards
            return
        total = sum(1 for _ in chain(module.parameters(), module.buffers()))
        raise MetaWeightsError(
            f"the model's weights are still on the meta device ({len(left)} of {total} "
            f"tensors, e.g. {left[0]}) and its forward got inputs on {given.device}: "
            "apply_plan sharded a model built on the meta device, whose weights do not exist "
            "yet. Fix: before the first forward, load them with "
            "tpplan.load_checkpoint(model, folder) (tpplan.from_pretrained(...) builds, "
            f"shards and loads in one call), or make them with model.to_empty(device="
            f"'{given.device}') and initialize them."
        )

    handle = model.register_forward_pre_hook(check, with_kwargs=True)
