"""LoRA adapters split to match their base layers (`decide_adapters`).

The trace sees a peft LoRA wrapper as one linear layer under its base's name
(_runtime/adapters.py, trace/run.py), so the regions decide the base as they would the plain
model's layer. Each adapter then follows its base, so that the wrapper's sum
`base(x) + lora_B(lora_A(x)) * scaling` needs no collective the base does not already make:
- base colwise (its output features split): lora_B is split the same way (its output is
  added to the base's), lora_A stays whole (it reads the base's whole input; its r features
  are lora_B's whole input);
- base rowwise (its input features split): lora_A is split on its input dim as the base is
  (a partial sum of r features, summed in the base's one all-reduce), lora_B stays whole;
- anything else: the adapters stay whole, as their base.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .._runtime.adapters import lora_layers
from .decision import Decision

__all__ = ["decide_adapters"]


def decide_adapters(model: nn.Module, decisions: dict[str, Decision]) -> None:
    """Give each adapter of each LoRA wrapper of `model` its base's split (module docstring)."""
    for adapter in lora_layers(model).values():
        base = decisions.get(adapter.base)
        for name, r in zip(adapter.a, adapter.rank, strict=True):
            decisions[name] = _decide_a(base, r)
        for name, r in zip(adapter.b, adapter.rank, strict=True):
            decisions[name] = _decide_b(base, r)


def _kind(base: Decision | None) -> str | None:
    """'colwise' or 'rowwise' where the base splits, None where it stays whole."""
    if base is None or base.style not in ("colwise", "rowwise"):
        return None
    return base.style


def _whole(r: int) -> Decision:
    return Decision(
        style="replicate",
        why=f"LoRA adapter (r={r}) of a base layer kept whole: kept whole with it",
    )


def _decide_a(base: Decision | None, r: int) -> Decision:
    kind = _kind(base)
    if kind == "colwise":
        return Decision(
            style="replicate",
            why=(
                f"LoRA adapter (r={r}) of a colwise base layer: it reads the base's whole input, "
                f"and its {r} features are lora_B's whole input; kept whole"
            ),
        )
    if kind == "rowwise":
        assert base is not None
        return replace(
            base,
            why=(
                f"LoRA adapter (r={r}) of a rowwise base layer: contracts the same split input on "
                f"its input dim; its {r} partial sums are summed in the base's one all-reduce "
                "(r features wider, no collective of its own)"
            ),
        )
    return _whole(r)


def _decide_b(base: Decision | None, r: int) -> Decision:
    kind = _kind(base)
    if kind == "colwise":
        assert base is not None
        return replace(
            base,
            why=(
                f"LoRA adapter (r={r}) of a colwise base layer: its output is added to the base's, "
                "so it is split the same way and the sum stays split with no collective of its "
                "own (the input's gradient is summed once, with the base's)"
            ),
        )
    if kind == "rowwise":
        return Decision(
            style="replicate",
            why=(
                f"LoRA adapter (r={r}) of a rowwise base layer: takes lora_A's {r} features once "
                "summed (with the base's output, in one all-reduce); kept whole"
            ),
        )
    return _whole(r)
