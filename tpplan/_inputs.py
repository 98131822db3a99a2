"""Example inputs for a model, derived from its forward signature and config.

Used wherever tpplan runs a model it did not write: verify, stats (and tracing). Inputs are
drawn from a torch.Generator of our own, so every rank and every run gets the same ones.
Start at `example_inputs`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .errors import TpplanError

__all__ = ["InputsError", "example_inputs"]


class InputsError(TpplanError, ValueError):
    """tpplan cannot make up inputs for this model; the caller must pass them."""


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    text = getattr(config, "get_text_config", None)
    if callable(text):
        sub = text()
        if sub is not config:
            return _get(sub, *names, default=default)
    return default


def example_inputs(
    model: nn.Module,
    *,
    batch: int = 2,
    seq: int = 8,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Keyword inputs for `model(**inputs)`: token ids, decoder ids, audio features or pixels,
    as the forward signature asks; InputsError when the model's inputs cannot be guessed."""
    params = inspect.signature(model.forward).parameters
    config = _config(model)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}

    def tokens(n: int) -> torch.Tensor:
        vocab = _get(config, "vocab_size", default=None)
        if vocab is None:
            # no config (a hand-written model): ids every embedding table can look up
            sizes = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)]
            vocab = min(sizes, default=None)
        if vocab is None:
            raise InputsError(
                f"{type(model).__name__} takes token ids but has no config naming a vocab_size and "
                "no embedding table; pass example_inputs (a tensor, a tuple of them, or a dict of "
                "keyword inputs)."
            )
        return torch.randint(0, int(vocab), (batch, n), generator=g).to(device)

    if "input_ids" in params:
        out["input_ids"] = tokens(seq)
    elif "input_features" in params and config is not None:  # speech encoders (Whisper)
        mels = _get(config, "num_mel_bins", default=80)
        frames = 2 * _get(config, "max_source_positions", default=seq)
        out["input_features"] = torch.randn(batch, mels, frames, generator=g).to(device)
    elif "pixel_values" in params and config is not None:
        size = _get(config, "image_size", default=32)
        size = size if isinstance(size, int) else size[0]
        chans = _get(config, "num_channels", default=3)
        out["pixel_values"] = torch.randn(batch, chans, size, size, generator=g).to(device)
    if "decoder_input_ids" in params and getattr(config, "is_encoder_decoder", False):
        out["decoder_input_ids"] = tokens(max(2, seq // 2))
    if not out:
        names = ", ".join(params) or "no arguments"
        raise InputsError(
            f"tpplan cannot make up inputs for {type(model).__name__} (its forward takes {names}); "
            "pass example_inputs (a tensor, a tuple of them, or a dict of keyword inputs)."
        )
    return out
