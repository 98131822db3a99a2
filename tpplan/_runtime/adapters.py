"""LoRA adapters (peft's `lora.Linear`): which wrappers tpplan treats as one linear layer.

peft wraps a target Linear as `base_layer` beside, per adapter, `lora_A` (in -> r) and
`lora_B` (r -> out), and its forward computes `base_layer(x) + lora_B(lora_A(dropout(x))) *
scaling` for each active adapter. That forward is a fixed computation, as nn.Linear's is, so
it is recognised by type (the one place tpplan names peft, imported only if the model's code
imported it): the wrapper is linear in x with the base's features in and out, and the
tracer treats it as one step of the data flow under the base's name (trace/run.py); infer
splits each adapter to match its base (infer/adapters.py); apply runs base and adapters with
the base's single collective (compile/adapters.py). Start at `lora_layers`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["LAYOUT_FIELDS", "Adapter", "lora_layers", "lora_linear_class"]


@dataclass(frozen=True)
class Adapter:
    """One peft LoRA wrapper, by full module names."""

    name: str
    """The wrapper (peft's lora.Linear)."""
    base: str
    """Its base layer (an nn.Linear): what the trace and the plan call the layer."""
    a: tuple[str, ...]
    """lora_A of each adapter (in -> r)."""
    b: tuple[str, ...]
    """lora_B of each adapter (r -> out), in the order of `a`."""
    rank: tuple[int, ...]
    """r of each adapter."""


# the fields of a rule that lay out a split layer; a split adapter's must be its base's
LAYOUT_FIELDS = ("head_dim", "replicate_heads", "parts", "transposed", "input", "output")


def lora_linear_class() -> Any:
    """peft's lora.Linear, if the model's code imported peft (a peft model has)."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    return getattr(layer, "Linear", None)


def lora_layers(model: nn.Module) -> dict[str, Adapter]:
    """{wrapper name: Adapter} for each peft LoRA wrapper of `model` whose computation is
    peft's plain LoRA over an nn.Linear (`unsupported` says why one is not)."""
    cls = lora_linear_class()
    if cls is None:
        return {}
    out: dict[str, Adapter] = {}
    m: Any
    for name, m in model.named_modules():
        if isinstance(m, cls) and unsupported(m) is None:
            keys = sorted(m.lora_A.keys())
            out[name] = Adapter(
                name=name,
                base=f"{name}.base_layer" if name else "base_layer",
                a=tuple(f"{name}.lora_A.{k}" for k in keys),
                b=tuple(f"{name}.lora_B.{k}" for k in keys),
                rank=tuple(m.lora_A[k].out_features for k in keys),
            )
    return out


def unsupported(m: Any) -> str | None:
    """Why peft LoRA wrapper `m` is not plain LoRA over a Linear (None: it is)."""
    cls = lora_linear_class()
    if cls is None or type(m).forward is not cls.forward:
        return "its forward is not peft's lora.Linear forward"
    if type(m.base_layer).forward is not nn.Linear.forward:
        return "its base layer is not an nn.Linear"
    if m.merged or m.disable_adapters or m.fan_in_fan_out:
        return "its adapters are merged, disabled, or laid out fan-in-fan-out"
    if m.lora_variant or any(m.lora_bias.values()):
        return "an adapter is a LoRA variant (DoRA, ...) or has a bias"
    for key in m.lora_A:
        a, b = m.lora_A[key], m.lora_B[key]
        if type(a).forward is not nn.Linear.forward or type(b).forward is not nn.Linear.forward:
            return f"adapter {key}'s lora_A or lora_B is not an nn.Linear"
        dropout = m.lora_dropout[key]
        if not isinstance(dropout, (nn.Identity, nn.Dropout)):
            return f"adapter {key}'s dropout is a {type(dropout).__name__}"
    return None
