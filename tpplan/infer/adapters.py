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
Sequence parallel is not fitted to adapters: `refuse_sequence_parallel` says so up front.
"""

from __future__ import annotations

from torch import nn

from .._runtime.adapters import lora_layers
from ..errors import TpplanError
from ..plan.styles import ReplicateRule
from .context import Context, Decided, Found
from .decision import decided, reasoned

__all__ = ["AdapterError", "decide_adapters", "refuse_sequence_parallel"]

# why each adapter is split or whole, by its base's style and which adapter it is
_WHY = {
    ("colwise", "a"): (
        "LoRA adapter (r={r}) of a colwise base layer: it reads the base's whole input, and "
        "its {r} features are lora_B's whole input; kept whole"
    ),
    ("colwise", "b"): (
        "LoRA adapter (r={r}) of a colwise base layer: its output is added to the base's, so "
        "it is split the same way and the sum stays split with no collective of its own (the "
        "input's gradient is summed once, with the base's)"
    ),
    ("rowwise", "a"): (
        "LoRA adapter (r={r}) of a rowwise base layer: contracts the same split input on its "
        "input dim; its {r} partial sums are summed in the base's one all-reduce (r features "
        "wider, no collective of its own)"
    ),
    ("rowwise", "b"): (
        "LoRA adapter (r={r}) of a rowwise base layer: takes lora_A's {r} features once summed "
        "(with the base's output, in one all-reduce); kept whole"
    ),
}
_WHOLE = "LoRA adapter (r={r}) of a base layer kept whole: kept whole with it"


def decide_adapters(ctx: Context, so_far: Decided) -> Found:
    """Give each adapter of each LoRA wrapper of the model its base's split (module
    docstring)."""
    found = Found()
    for adapter in lora_layers(ctx.model).values():
        base = so_far.decisions.get(adapter.base)
        kind = base.style if base is not None else "replicate"
        for role, names in (("a", adapter.a), ("b", adapter.b)):
            for name, r in zip(names, adapter.rank, strict=True):
                why = _WHY.get((kind, role), _WHOLE).format(r=r)
                if base is not None and base.lora_split(role):
                    found.rules[name] = reasoned(base, why)  # split as its base is
                else:
                    found.rules[name] = decided(ReplicateRule, why)
    return found


class AdapterError(TpplanError, ValueError):
    """A plan asked of a model with LoRA adapters that tpplan cannot give it."""


def refuse_sequence_parallel(model: nn.Module) -> None:
    """Sequence parallel is not fitted to LoRA wrappers (their adapters would need the
    stream's layouts too): refused, naming a wrapper, rather than a plan that fails."""
    adapters = lora_layers(model)
    if adapters:
        first = next(iter(adapters))
        raise AdapterError(
            f"sequence_parallel is not supported with LoRA adapters yet: {len(adapters)} peft "
            f"LoRA layers (such as {first}). Fix: infer without sequence_parallel, or merge the "
            "adapters into the model first (merge_and_unload)."
        )
