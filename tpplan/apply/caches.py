"""A static KV cache of a sharded model is sized by the keys it is handed, not the config.

transformers allocates a static cache ahead of the prefill when `generate` is given a
`prefill_chunk_size` (generation/utils.py `_prepare_static_cache`), with the head counts
of `_get_static_cache_init_shape`: the config's, divided by transformers' own tp size
(`model._tp_size`, which only its own tensor parallelism sets). A model sharded by tpplan
hands the cache each rank's own heads, fewer than the config's, and the first write fails
(`index_copy_(): Source/destination tensor must have same slice shapes`). Answering None,
as transformers does for models it cannot size ahead, leaves the cache to its lazy
allocation on the first write, from the key itself, which is right on every rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["size_caches_by_keys"]


def size_caches_by_keys(model: nn.Module) -> None:
    """Give every module of `model` that sizes static caches from its config (a transformers
    generation model) the answer below; idempotent."""
    for module in model.modules():
        if callable(getattr(type(module), "_get_static_cache_init_shape", None)):
            module._get_static_cache_init_shape = _sized_on_first_write.__get__(module)


def _sized_on_first_write(self: Any) -> None:
    """No shape ahead: the static cache's layers allocate on their first write."""
    return None
