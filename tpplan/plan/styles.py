"""The styles a rule can name, the optional fields each takes, and what each needs.

Start at `check_fields_fit_style`: the whole check of one rule's fields against its style,
run by `Rule` once every field is valid on its own. Each check is a plain function over the
fields a rule gives (a field given as null counts as given), and each message says what was
given, what is allowed and the fix. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from ..errors import did_you_mean
from .layouts import parse_layout

__all__ = ["STYLES", "STYLE_FIELDS", "Style", "check_fields_fit_style", "check_style"]

Style = Literal[
    "colwise",
    "rowwise",
    "vocab_parallel",
    "sequence_parallel",
    "prepare",
    "replicate",
    "replicate_grad_sum",
    "experts",
    "split_params",
    "heads",
]
STYLES: tuple[str, ...] = Style.__args__  # type: ignore[attr-defined]

# Which optional fields each style accepts; anything else on a rule of that style is an error.
STYLE_FIELDS: dict[str, frozenset[str]] = {
    "colwise": frozenset(
        {"input", "output", "local_output", "head_dim", "parts", "transposed", "replicate_heads"}
    ),
    "rowwise": frozenset({"input", "output", "local_output", "head_dim", "parts", "transposed"}),
    "vocab_parallel": frozenset({"input", "output", "local_output", "sum_at", "written"}),
    "sequence_parallel": frozenset({"input", "local_output"}),
    "prepare": frozenset(
        {
            "inputs",
            "desired_inputs",
            "input_kwargs",
            "desired_input_kwargs",
            "outputs",
            "desired_outputs",
            "local_input",
            "local_output",
        }
    ),
    "replicate": frozenset(),
    "replicate_grad_sum": frozenset(),
    "experts": frozenset({"mode", "shard", "fused", "after_sum", "added_whole"}),
    "split_params": frozenset({"shard"}),
    "heads": frozenset({"head_dim"}),
}
_EVERY_RULE = ("match", "style", "why")  # the fields every rule has, whatever its style

Fields = Mapping[str, Any]
"""The fields a rule gives, by name (those it leaves out are absent)."""


def check_style(value: Any) -> Any:
    """`value` as it is, unless it is a string that names no style; then the closest style
    and the list of them (a non-string is left to the field's type)."""
    if isinstance(value, str) and value not in STYLES:
        raise ValueError(
            f"'{value}' is not a style.{did_you_mean(value, STYLES)} Styles: {', '.join(STYLES)}."
        )
    return value


def check_fields_fit_style(style: str, fields: Fields) -> None:
    """Raise ValueError when a rule of `style` gives a field that style does not take, or
    leaves out (or combines) what it needs."""
    allowed = STYLE_FIELDS[style]
    extra = sorted(set(fields) - set(_EVERY_RULE) - allowed)
    if extra:
        ok = ", ".join(sorted(allowed)) or "none"
        raise ValueError(
            f"style '{style}' takes no {', '.join(extra)}; its optional fields are: {ok}."
        )
    check = _STYLE_CHECKS.get(style)
    if check is not None:
        check(fields)


def _check_colwise(fields: Fields) -> None:
    if "partial" in (fields.get("input"), fields.get("output")):
        raise ValueError(
            "style 'colwise' cannot take or give layout 'partial'; use replicate or shard(DIM)."
        )
    # its head_dim may be left out: the check reads it from the model (check/complete.py)
    if fields.get("replicate_heads") and (
        any(fields.get(f) for f in ("parts", "transposed", "output"))
        or fields.get("local_output") is False
    ):
        raise ValueError(
            "colwise with replicate_heads (whole key/value heads shared among ranks) takes no "
            "parts, transposed, output or local_output: false."
        )


def _check_rowwise(fields: Fields) -> None:
    parts = fields.get("parts")
    if parts and len(set(parts)) != 1:
        raise ValueError(
            f"style 'rowwise' takes parts of one size only (each rank contracts its slice of "
            f"every piece, a layout only equal pieces have); {list(parts)} are not. Give the "
            "pieces as equal ones (64 and 256 are 5 pieces of 64), or drop parts."
        )


def _check_sequence_parallel(fields: Fields) -> None:
    layout = fields.get("input")
    if layout is not None and parse_layout(layout)[0] != "shard":
        raise ValueError(
            f"sequence_parallel needs input shard(DIM) naming the sequence dim, not '{layout}'."
        )


def _check_vocab_parallel(fields: Fields) -> None:
    whole_in = (fields.get("input") or "replicate") == "replicate"
    if fields.get("sum_at") is not None and (
        not whole_in
        or (fields.get("output") or "replicate") != "replicate"
        or fields.get("local_output") is False
    ):
        raise ValueError(
            "vocab_parallel with sum_at: lookup takes the token ids as they are and sums "
            "the rows inside the module's forward, so its input and output are whole, plain "
            "tensors; drop input, output and local_output, or drop sum_at."
        )
    if fields.get("written") is not None and (
        fields.get("sum_at") is not None or not whole_in or fields.get("output") == "partial"
    ):
        raise ValueError(
            "vocab_parallel with written takes the token ids as they are and sums the "
            "rows as its forward returns (output replicate or shard(DIM)); drop sum_at, "
            "input and output partial, or drop written."
        )


def _check_prepare(fields: Fields) -> None:
    pairs = [
        ("inputs", "desired_inputs"),
        ("input_kwargs", "desired_input_kwargs"),
        ("outputs", "desired_outputs"),
    ]
    given = 0
    for have, want in pairs:
        a, b = fields.get(have), fields.get(want)
        if a is None and b is None:
            continue
        if a is None or b is None:
            raise ValueError(
                f"prepare needs both {have} and {want} (as they arrive, as wanted); only "
                f"{have if a is not None else want} is given."
            )
        given += 1
        if len(a) != len(b) or (isinstance(a, dict) and a.keys() != b.keys()):
            raise ValueError(f"prepare: {have} and {want} must name the same inputs.")
    if not given:
        raise ValueError(
            "prepare needs at least one pair of layouts: inputs/desired_inputs, "
            "input_kwargs/desired_input_kwargs or outputs/desired_outputs."
        )


def _check_experts(fields: Fields) -> None:
    shard = fields.get("shard")
    if not shard:
        raise ValueError(
            "experts needs shard: {parameter: dim} naming the expert weights it splits "
            "(e.g. {gate_up_proj: 1, down_proj: 2} for mode tensor, dim 0 for mode expert)."
        )
    stray = sorted(set(fields.get("fused") or ()) - set(shard))
    if stray:
        raise ValueError(
            f"experts: fused names {', '.join(stray)}, which is not in shard; fused pieces "
            "are cut along a split dim."
        )
    stray = sorted(set(fields.get("after_sum") or ()) & set(shard))
    if stray:
        raise ValueError(
            f"experts: after_sum names {', '.join(stray)}, which is also in shard; a "
            "parameter added after the sum is whole on every rank."
        )
    if fields.get("mode") == "expert" and (
        fields.get("fused")
        or fields.get("after_sum")
        or fields.get("added_whole")
        or set(shard.values()) != {0}
    ):
        raise ValueError(
            "experts with mode expert splits every expert weight on dim 0 (the experts) and "
            "takes no fused, after_sum or added_whole; use shard: {name: 0} for each."
        )


def _check_split_params(fields: Fields) -> None:
    if not fields.get("shard"):
        raise ValueError(
            "split_params needs shard: {parameter: dim} naming the module's own parameters "
            "it splits (e.g. {sinks: 0})."
        )


# What each style needs beyond taking only its own fields (styles not named need nothing).
_STYLE_CHECKS: dict[str, Callable[[Fields], None]] = {
    "colwise": _check_colwise,
    "rowwise": _check_rowwise,
    "sequence_parallel": _check_sequence_parallel,
    "vocab_parallel": _check_vocab_parallel,
    "prepare": _check_prepare,
    "experts": _check_experts,
    "split_params": _check_split_params,
}
