"""LoRA adapters split unlike their base layer (`check_adapters`).

A peft LoRA wrapper adds `lora_B(lora_A(x)) * scaling` to its base's output
(_runtime/adapters.py): with the base colwise, lora_B must be split as the base is and
lora_A whole; with the base rowwise, lora_A split as the base is and lora_B whole; with the
base whole, both whole. Anything else adds tensors split differently, which the dry run
would report only as a shape error somewhere inside the wrapper.
"""

from __future__ import annotations

from torch import nn

from .._runtime.adapters import LAYOUT_FIELDS, lora_layers
from ..errors import Problem
from ..plan.schema import Plan, Rule

__all__ = ["check_adapters"]


def check_adapters(plan: Plan, owner: dict[str, int], model: nn.Module) -> list[Problem]:
    """One problem per adapter whose rule does not match its base's (module docstring);
    `owner` is the rule index styling each module (rules.match_rules)."""
    out: list[Problem] = []
    for adapter in lora_layers(model).values():
        base = _rule(plan, owner, adapter.base)
        for role, names in (("a", adapter.a), ("b", adapter.b)):
            split = base is not None and base[1].lora_split(role)
            want = base[1].style if base is not None and split else "replicate"
            for name in names:
                problem = _mismatch(plan, owner, name, role, want, base)
                if problem is not None:
                    out.append(problem)
    return out


def _rule(plan: Plan, owner: dict[str, int], name: str) -> tuple[int, Rule] | None:
    i = owner.get(name)
    return None if i is None else (i, plan.rules[i])


def _mismatch(
    plan: Plan,
    owner: dict[str, int],
    name: str,
    role: str,
    want: str,
    base: tuple[int, Rule] | None,
) -> Problem | None:
    found = _rule(plan, owner, name)
    got = found[1].style if found else "replicate"
    which = "lora_A" if role == "a" else "lora_B"
    base_style = base[1].style if base else "replicate"
    where = f"rules[{found[0]}] (match: {found[1].match})" if found else "rules (none matches it)"
    if got != want:
        message = (
            f"this LoRA adapter's {which} is {got} beside a {base_style} base_layer; its "
            "wrapper adds their outputs, which would be split differently."
        )
    elif want != "replicate" and found and base:
        differ = [
            f for f in LAYOUT_FIELDS if getattr(found[1], f, None) != getattr(base[1], f, None)
        ]
        if not differ:
            return None
        message = (
            f"this LoRA adapter's {which} is split unlike its base_layer ({', '.join(differ)} "
            "differ); its wrapper adds their outputs."
        )
    else:
        return None
    fix = (
        f"make it {want}"
        + (" with the base's rule fields" if want != "replicate" else "")
        + " (lora_B split like a colwise base, lora_A like a rowwise one, the other whole), "
        "as `tpplan infer` writes it."
    )
    return Problem("adapter", where, name, message, fix)
