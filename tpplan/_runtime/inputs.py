"""Example inputs for a model, derived from its forward signature and config.

Used wherever tpplan runs a model it did not write: verify, stats (and tracing). Inputs are
drawn from a torch.Generator of our own, so every rank and every run gets the same ones.
Start at `example_inputs`.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn

from ..errors import TpplanError
from .fake import quiet_fake_tensor_log
from .torch_compat import ConvNd

__all__ = ["InputsError", "example_inputs", "features_input", "inputs_from_specs", "part_inputs"]


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


def _patch_width(model: nn.Module) -> int | None:
    """The width of one packed patch: what the first layer with weights takes per row (a
    Linear's in_features; a convolution's channels times its kernel, the view a packed row
    is cut into). A guess that only picks the inputs to run: a wrong one fails to run."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            return m.in_features
        if isinstance(m, ConvNd) and m.groups == 1:
            return math.prod(m.weight.shape[1:])
    return None


# first forward arguments that hand-written language models name their token ids
_TOKEN_NAMES = ("idx", "ids", "tokens", "token_ids")


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
    inner = _passed_on_to(model)
    if inner is not None:
        return example_inputs(inner, batch=batch, seq=seq, device=device, seed=seed)
    params = inspect.signature(model.forward).parameters
    config = _config(model)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    grid = next((n for n in params if n.endswith("grid_thw")), None)

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

    first = next(iter(params), None)
    if "input_ids" in params:
        out["input_ids"] = tokens(seq)
    elif first in _TOKEN_NAMES and any(isinstance(m, torch.nn.Embedding) for m in model.modules()):
        # a hand-written language model (nanoGPT's `idx`, torchtitan's `tokens`)
        out[first] = tokens(seq)
    elif "input_features" in params and config is not None:  # speech encoders (Whisper)
        mels = _get(config, "num_mel_bins", default=80)
        frames = 2 * _get(config, "max_source_positions", default=seq)
        out["input_features"] = torch.randn(batch, mels, frames, generator=g).to(device)
    elif grid is not None and (width := _patch_width(model)) is not None:
        # a tower fed packed patches (Qwen2-VL and its kin): every image's patches as rows
        # of one 2-D tensor, and each image's (frames, height, width) in patches; a 4x4 grid
        # fits a spatial merge of 1, 2 or 4
        thw = torch.tensor([[1, 4, 4]] * batch)
        out[next(iter(params))] = torch.randn(int(thw.prod(-1).sum()), width, generator=g).to(
            device
        )
        out[grid] = thw.to(device)
    elif "pixel_values" in params and config is not None:
        size = _get(config, "image_size", default=32)
        size = size if isinstance(size, int) else size[0]
        chans = _get(config, "num_channels", default=3)
        out["pixel_values"] = torch.randn(batch, chans, size, size, generator=g).to(device)
    if "decoder_input_ids" in params and getattr(config, "is_encoder_decoder", False):
        out["decoder_input_ids"] = tokens(max(2, seq // 2))
    if not out and config is None:
        # a hand-written module of one input: what its first layer with weights takes
        out = _first_layer_input(model, params, batch=batch, seq=seq, generator=g)
        out = {k: v.to(device) for k, v in out.items()}
    if not out:
        names = ", ".join(params) or "no arguments"
        raise InputsError(
            f"tpplan cannot make up inputs for {type(model).__name__} (its forward takes {names}); "
            "pass example_inputs (a tensor, a tuple of them, or a dict of keyword inputs)."
        )
    return out


def _passed_on_to(model: nn.Module) -> nn.Module | None:
    """The one child a wrapper's forward of only `*args, **kwargs` hands its inputs to (peft's
    PeftModel wraps the model so), where it has exactly one child; else None."""
    params = inspect.signature(model.forward).parameters.values()
    varargs = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    children = list(model.children())
    if not params or any(p.kind not in varargs for p in params) or len(children) != 1:
        return None
    return children[0]


# image sides tried for a first convolution, most common first; the first the forward runs
# on is taken (models that size position tables for one side accept only that one)
_SIDES = (224, 32, 16, 64, 256, 128, 384, 512)


def _first_layer_input(
    model: nn.Module,
    params: Any,
    *,
    batch: int,
    seq: int,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """For a forward of one required argument and no config: the input its first layer with
    weights takes (a Linear: features of its width; a 2-D convolution: images of its
    channels; a 1-D one: signals of its channels), each guess kept only if the forward runs
    on it, on fake tensors; {} when none does."""
    needed = [
        name
        for name, p in params.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    first = next(
        (m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))), None
    )
    if len(needed) != 1 or first is None:
        return {}
    weight = first.weight
    if isinstance(first, nn.Linear):
        shapes = [(batch, seq, first.in_features), (batch, first.in_features)]
    elif isinstance(first, nn.Conv2d):
        shapes = [(batch, first.in_channels, side, side) for side in _SIDES]
    else:
        shapes = [(batch, first.in_channels, n) for n in (seq, 64, 256)]
    for shape in shapes:
        x = torch.randn(shape, generator=generator).to(weight.device, weight.dtype)
        if _runs_on_fake(model, x):
            return {needed[0]: x}
    return {}


def _runs_on_fake(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether the forward runs on `x`, computed on fake tensors (shapes only, the model's
    own weights untouched). Its buffers are fake too: a forward that changes them in place
    (a BatchNorm's running statistics and batch count while training) changes copies."""
    from .torch_compat import FakeTensorMode

    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with quiet_fake_tensor_log(), torch.no_grad(), fake:
            buffers: dict[str, torch.Tensor] = {
                n: fake.from_tensor(b) for n, b in model.named_buffers()
            }
            torch.func.functional_call(model, buffers, (fake.from_tensor(x),), strict=False)
    except Exception:
        return False
    return True


def features_input(model: nn.Module, *, batch: int = 2, seq: int = 16) -> torch.Tensor | None:
    """For a part of a model whose forward takes one tensor of features (a projector on a
    vision tower's output): a (batch, seq, width) tensor, width what its first layer with
    weights takes per row. None when its forward needs more than one argument. A guess that
    only picks the inputs to run: a wrong one fails to run."""
    params = inspect.signature(model.forward).parameters.values()
    needed = [
        p
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    width = _patch_width(model)
    if len(needed) != 1 or width is None:
        return None
    return torch.randn(batch, seq, width, generator=torch.Generator().manual_seed(0))


def part_inputs(part: nn.Module) -> torch.Tensor | None:
    """What to trace a part of a model on when the model's forward did not call it: None
    where its forward signature says what to make up (the tracer makes it), else features for
    a forward of one tensor (None again when there is no such guess: the trace then says
    that no inputs could be made)."""
    try:
        example_inputs(part)
    except InputsError:
        return features_input(part)
    return None


def inputs_from_specs(specs: list[str]) -> Any:
    """The example inputs `tpplan infer --input` gives: None for none, a tuple by position,
    or a dict by name. Values are drawn from a fixed seed, so a plan traced on them is
    reproducible; a spec that cannot be read is a TpplanError naming it and the fix."""
    if not specs:
        return None
    g = torch.Generator().manual_seed(0)
    named: dict[str, Any] = {}
    positional = []
    for spec in specs:
        name, _, rest = spec.rpartition("=")
        shape_text, _, kind = rest.partition(":")
        dtype_text, _, high_text = kind.partition(":")
        dtype = getattr(torch, dtype_text or "float32", None)
        try:
            shape = [int(d) for d in shape_text.split("x")]
            high = int(high_text) if high_text else None
        except ValueError:
            shape, high = [], None
        if not shape or min(shape) < 1 or not isinstance(dtype, torch.dtype):
            raise TpplanError(
                f"--input {spec}: not a shape and dtype tpplan reads. Fix: write the sizes "
                "joined by x, then optionally :DTYPE (a torch dtype) and, for integers, "
                ":HIGH, e.g. --input 2x3x224x224 or --input idx=2x16:int64:50257."
            )
        if dtype.is_floating_point:
            value = torch.randn(shape, generator=g).to(dtype)
        elif high is None:
            raise TpplanError(
                f"--input {spec}: integer inputs need the bound their values stay below. "
                f"Fix: add it, e.g. --input {spec.split(':')[0]}:{dtype_text}:50257."
            )
        else:
            value = torch.randint(0, high, shape, generator=g, dtype=dtype)
        if name:
            named[name] = value
        else:
            positional.append(value)
    if named and positional:
        raise TpplanError(
            "--input: some inputs are named and some are not. Fix: give them all by position "
            "(in the forward's order) or all by name (NAME=SHAPE)."
        )
    return named or tuple(positional)
