"""Non-persistent buffers, which no checkpoint holds, recomputed after a load.

Start at `recompute_buffers`. A model built on the meta device and materialized with
`to_empty` holds garbage in buffers such as rotary embeddings' `inv_freq`; load_checkpoint
asks the model to recompute them, and refuses (naming them) when it cannot.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._runtime.local import outside_simulation
from .keys import names
from .safetensors_io import CheckpointError

__all__ = ["recompute_buffers"]


def recompute_buffers(model: nn.Module) -> None:
    """Recompute every non-persistent buffer, which no checkpoint holds.

    The choice: ask the model. A Hugging Face model's `_init_weights(module)` is how
    transformers itself fills these buffers after building on the meta device (rotary
    embeddings recompute `inv_freq` from the config), so it is called on each module that
    owns such a buffer, by the nearest enclosing model that has it. Each buffer is first
    replaced by NaNs, so one the model did not recompute is caught rather than left
    holding whatever `to_empty` found in memory. Those modules are small and replicated
    (parallelize_module shards parameters, never buffers), so this runs as plain tensors on
    every rank. A model with no such method gets an error naming the buffers.
    """
    modules = dict(model.named_modules())
    owners = []
    for name, module in modules.items():
        owned = sorted(b for b in module._non_persistent_buffers_set if b in module._buffers)
        owned = [b for b in owned if module._buffers[b] is not None]
        if owned:
            owners.append((name, module, owned, _init_owner(modules, name)))
    orphans = [f"{n}.{b}" if n else b for n, _, owned, o in owners if o is None for b in owned]
    if orphans:
        raise CheckpointError(
            f"non-persistent buffers {names(orphans)} are in no checkpoint and the model has "
            "no _init_weights to recompute them; nothing was loaded. Fix: pass "
            "rebuild_buffers=False and set them after load_checkpoint (or build that module "
            "off the meta device)."
        )
    not_rebuilt: list[str] = []
    with outside_simulation():
        for name, module, owned, owner in owners:
            old = {b: module.get_buffer(b) for b in owned}
            for b, t in old.items():
                fill = float("nan") if t.is_floating_point() else 0
                module._buffers[b] = torch.full(
                    tuple(t.shape), fill, dtype=t.dtype, device=t.device
                )
            owner._init_weights(module)
            missed = [
                b
                for b in owned
                if (t := module.get_buffer(b)).is_floating_point() and t.isnan().any()
            ]
            if missed:
                module._buffers.update(old)  # leave them as they were
                not_rebuilt += [f"{name}.{b}" if name else b for b in missed]
    if not_rebuilt:
        raise CheckpointError(
            f"non-persistent buffers {names(not_rebuilt)} are in no checkpoint and the model's "
            "_init_weights did not recompute them; nothing was loaded. Fix: pass "
            "rebuild_buffers=False and set them after load_checkpoint."
        )


def _init_owner(modules: dict[str, nn.Module], name: str) -> Any:
    """The innermost enclosing module (itself included) with Hugging Face's `_init_weights`."""
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        candidate = modules.get(".".join(parts[:i]))
        if candidate is not None and callable(getattr(candidate, "_init_weights", None)):
            return candidate
    return None
