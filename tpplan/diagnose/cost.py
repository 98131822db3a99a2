"""verify_cost: what `tpplan verify` will hold in memory, told before it builds the model with
real weights, so that a full-width model is shrunk with `--set` instead of run for minutes.

Start at `verify_cost`. The estimate, from a model on the meta device (no memory used):
- parameters: their bytes, times the copies verify holds at its peak: 3 (the unsharded
  model, its copy, and that copy's shards while the plan is applied), 7 with `--backward`
  (gradients of both, and autograd's buffers). Measured here on a 117M-parameter Llama
  (468 MB of fp32 parameters): 1.1 GB above a tiny model's run forward, 3.2 GB with
  backward. With `--processes` every rank builds the model: times the ranks;
- activations: the bytes of every module's output on verify's example inputs, measured by
  a forward on the meta device, times 2 (the unsharded and the sharded run each keep every
  module's output to compare) and times 2 again for what autograd saves alongside them
  (verify runs with gradients on, so both stay alive until the comparison ends).
Python's and torch's own memory (a few hundred MB) is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._runtime.inputs import example_inputs
from .._runtime.tree import first_tensor

__all__ = ["DEPTH_KEYS", "VerifyCost", "verify_cost"]

# config fields that count a model's blocks, in the order transformers' configs use them
DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


@dataclass(frozen=True)
class VerifyCost:
    """verify's expected peak memory, and the facts it comes from."""

    parameters: int
    """Parameters of the model (tied ones once)."""
    param_bytes: int
    copies: int
    """Copies of the parameters verify holds at once (gradients included)."""
    activation_bytes: int | None
    """None where the model does not run on the meta device (the estimate leaves them out)."""
    depth_key: str | None
    """The config field that counts the model's blocks (num_hidden_layers), if it has one."""
    layers: int | None

    @property
    def peak_bytes(self) -> int:
        return self.param_bytes * self.copies + (self.activation_bytes or 0)


def verify_cost(model: nn.Module, *, backward: bool, processes: int = 0) -> VerifyCost:
    """The cost of verifying `model` (best on the meta device: nothing is allocated), in
    this process or, with `processes`, on that many ranks that each build the model."""
    params = {id(p): p for p in model.parameters()}.values()
    config = getattr(model, "config", None)
    depth_key = next((k for k in DEPTH_KEYS if isinstance(getattr(config, k, None), int)), None)
    activations = _activation_bytes(model)
    return VerifyCost(
        parameters=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        copies=(7 if backward else 3) * max(1, processes),
        activation_bytes=None if activations is None else activations * max(1, processes),
        depth_key=depth_key,
        layers=getattr(config, depth_key) if depth_key else None,
    )


def _activation_bytes(model: nn.Module) -> int | None:
    """Bytes of every module's output on verify's inputs, x2 runs x2 for autograd."""
    sizes: list[int] = []

    def hook(module: nn.Module, args: object, out: object) -> None:
        t = first_tensor(out)
        if t is not None:
            sizes.append(t.numel() * t.element_size())

    device = next((p.device for p in model.parameters()), torch.device("meta"))
    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            model(**example_inputs(model, device=device))
    except Exception:
        return None  # routing by values, inputs it cannot guess: parameters alone
    finally:
        for h in handles:
            h.remove()
    return sum(sizes) * 2 * 2
