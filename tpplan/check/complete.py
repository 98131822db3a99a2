"""The sizes a plan may leave to the model: a rule's head_dim, its fused `parts` and its
experts' `fused` pieces, read from the traced model (widths.py's readers, as infer reads
them) where the rule leaves them out. A shipped plan leaves them out, so that one plan
serves every size of its family (Llama's head_dim 128 and TinyLlama's 64). Start at
`complete_sizes`; check/api.py calls it before every other check, and apply_plan shards
with the plan it returns. `leave_out_sizes` is its inverse, for `tpplan infer --family`.

A size a rule states is kept; one the model contradicts is one problem (its own, from
widths.py), and the checks after it use the model's size, so that the one mistake is not
told again as heads that do not divide or attributes that cannot be divided.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from ..errors import Problem
from ..plan.patterns import match_names, matches
from ..plan.rule import Rule
from ..plan.schema import Plan
from .shared import rule_label, traced_name
from .widths import head_dim_problem, model_head_dim, model_pieces, parts_problem

if TYPE_CHECKING:
    from ..trace import Trace

__all__ = ["complete_sizes", "leave_out_sizes"]

# (field, expert parameter or None): one size a rule may leave to the model
_Size = tuple[str, str | None]


def complete_sizes(
    plan: Plan, by_rule: dict[int, list[str]], trace: Trace | None, why_not: str = ""
) -> tuple[Plan, list[Problem]]:
    """`plan` with each size its rules leave out read from `trace` (the model's forward),
    and the problems: a size that the modules one rule matches show differently, a stated
    size the model contradicts (the plan returned then holds the model's, for the checks
    that follow), and a head_dim that replicate_heads needs but the model does not show.
    `trace` is None for a model that could not be traced (`why_not` says why): its rules
    stay as they are."""
    rules, out = list(plan.rules), []
    for i, rule in enumerate(plan.rules):
        found: dict[str, Any] = {}
        for size in _sizes(plan, rule, by_rule[i]):
            seen = _seen(rule, size, by_rule[i], trace) if trace is not None else {}
            value, problems = _settle(i, rule, size, seen)
            out += problems
            if value is not None:
                found[size[0] if size[1] is None else f"fused.{size[1]}"] = value
        if rule.needs_head_dim() and "head_dim" not in found:
            out.append(_unread_head_dim(i, rule, trace is None, why_not))
        if found:
            rules[i] = _with(rule, found)
    return plan.model_copy(update={"rules": rules}), out


def leave_out_sizes(plan: Plan, model: nn.Module, *, example_inputs: Any = None) -> Plan:
    """`plan` without the sizes complete_sizes reads back from `model` as they are (traced
    on `example_inputs`, or made-up ones): what the plan of a family leaves to each model
    of it (`tpplan infer --family`). Sizes the model's forward does not show stay."""
    from ..trace import trace_model

    names = [n for n, _ in model.named_modules() if n]
    by_rule = {i: match_names(r.match, names) for i, r in enumerate(plan.rules)}
    return _leave_out(plan, by_rule, trace_model(model, example_inputs=example_inputs))


def _leave_out(plan: Plan, by_rule: dict[int, list[str]], trace: Trace) -> Plan:
    rules = []
    for i, rule in enumerate(plan.rules):
        drop: dict[str, Any] = {}
        # only what complete_sizes fills back in, so that it gives the plan again
        for field, param in _sizes(plan, rule, by_rule[i], stated=False):
            seen = {_value(v) for v in _seen(rule, (field, param), by_rule[i], trace).values()}
            if seen != {_plain(_stated(rule, field, param))}:
                continue
            if param is None:
                drop[field] = None
            else:
                drop.setdefault("fused", dict(_stated(rule, "fused", None) or {})).pop(param)
        if "fused" in drop and not drop["fused"]:
            drop["fused"] = None
        rules.append(_with(rule, drop) if drop else rule)
    return plan.model_copy(update={"rules": rules})


def _sizes(plan: Plan, rule: Rule, names: list[str], *, stated: bool = True) -> list[_Size]:
    """The sizes of `rule` read from the model: those infer would write (a head_dim for a
    layer of a local region, parts for a colwise one outside a DTensor region, the pieces of
    each expert parameter it splits by tensor), and with `stated`, any head_dim or parts the
    rule states (checked against the model's)."""
    return rule.model_sizes(in_region=_in_dtensor_region(plan, names), stated=stated)


def _stated(rule: Rule, field: str, param: str | None) -> Any:
    """The size the rule states (None where it leaves it out)."""
    if param is not None:
        return (getattr(rule, "fused", None) or {}).get(param)
    return getattr(rule, field, None)


def _in_dtensor_region(plan: Plan, names: list[str]) -> bool:
    """Whether a rule's layers (`names`) lie inside a module of the plan's `regions` (its
    code runs on DTensors: infer writes them no head_dim, nothing there needs one)."""
    parents = {n.rsplit(".", k)[0] for n in names for k in range(1, n.count(".") + 1)}
    return any(matches(r.match, p) for r in plan.regions for p in parents)


def _seen(rule: Rule, size: _Size, names: list[str], trace: Trace) -> dict[str, Any]:
    """{module: the size as the model shows it} for the matched modules that show one (a
    head_dim with the words of how it shows it, `_value` drops them)."""
    field, param = size
    out: dict[str, Any] = {}
    for name in names:
        t = traced_name(trace, name)
        if field == "head_dim":
            value: Any = model_head_dim(trace, t, closer=rule.closes_split())
        else:
            value = model_pieces(trace, t, param)
        if value is not None:
            out[name] = value
    return out


def _plain(value: Any) -> Any:
    """A stated size as _seen's values compare: pieces as a tuple."""
    return tuple(value) if isinstance(value, list) else value


def _settle(i: int, rule: Rule, size: _Size, seen: dict[str, Any]) -> tuple[Any, list[Problem]]:
    """(the value the checks go on with, or None to keep the rule's; the problems) of one
    size of rule `i`, given what the matched modules show."""
    field, param = size
    stated = _stated(rule, field, param)
    values = {_value(v) for v in seen.values()}
    if len(values) > 1:
        if stated is not None:
            return None, []  # widths.py names each module that differs from the rule
        return None, _differ(i, rule, field, param, seen)
    if not values or _plain(stated) == (value := values.pop()):
        return None, []
    if stated is None:
        return value, []
    if field != "head_dim" and sum(stated) != sum(value):
        return None, []  # pieces that do not add up: the rule's own check tells it
    # one per module, as widths.py tells them: check_plan collapses them over the layers
    if field == "head_dim":
        return value, [head_dim_problem(i, rule, n, v) for n, v in seen.items()]
    return value, [parts_problem(i, rule, n, param, stated, value) for n in seen]


def _value(v: Any) -> Any:
    """A size as _seen holds it, less how the model shows it (a head_dim's words)."""
    return v[0] if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], str) else v


def _with(rule: Rule, found: dict[str, Any]) -> Any:
    """`rule` with the sizes found (a `fused.PARAM` key is one expert parameter's pieces),
    validated again as a rule of its style."""
    # (its style too where the rule was built by its class, which sets the style itself)
    data = {"style": rule.style, **rule.model_dump(by_alias=True, exclude_unset=True)}
    for key, value in found.items():
        if key.startswith("fused."):
            data.setdefault("fused", {})[key.removeprefix("fused.")] = list(value)
        elif value is None:
            data.pop(key, None)
        else:
            data[key] = list(value) if isinstance(value, tuple) else value
    return Rule.parse(data)


def _differ(
    i: int, rule: Rule, field: str, param: str | None, seen: dict[str, Any]
) -> list[Problem]:
    """The Problem, on each module, of a size the rule leaves out that its modules show
    differently."""
    what = "head_dim" if field == "head_dim" else f"{field} {param}" if param else field
    shown: dict[str, str] = {}
    for name, v in seen.items():
        shown.setdefault(str(list(_value(v)) if field != "head_dim" else _value(v)), name)
    listed = "; ".join(f"{v} ({name})" for v, name in shown.items())
    return [
        Problem(
            "head_dim" if field == "head_dim" else "parts",
            rule_label(i, rule),
            name,
            f"the rule leaves {what} out, and the modules it matches show different ones: "
            f"{listed}.",
            f"split the rule into one rule per {what}, each stating its {what}.",
        )
        for name in seen
    ]


def _unread_head_dim(i: int, rule: Rule, untraced: bool, why_not: str) -> Problem:
    """The Problem of replicate_heads without a head_dim the model shows."""
    where = (
        f"the model could not be traced ({why_not.rstrip('.')})"
        if untraced
        else "the model's forward shows no heads for its layers"
    )
    return Problem(
        "head_dim",
        rule_label(i, rule),
        None,
        f"the rule shares key/value heads among ranks (replicate_heads) and leaves head_dim "
        f"out, but {where}, so the size of a head is unknown.",
        "set head_dim in the rule to the size of one key/value head (e.g. head_dim: 128).",
    )
