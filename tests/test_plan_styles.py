"""The plan's vocabularies as plain functions: styles, layouts and schema versions.

tests/test_plan_messages.py checks the same messages through a whole plan file; here each
check runs on the plain values a rule gives, as tpplan/plan/styles.py, layouts.py and
versions.py define them. No torch here.
"""

from __future__ import annotations

import re
from typing import Any, get_args

import pytest

from tpplan.plan import SCHEMA_VERSION, STYLES, Plan, Rule, parse_layout
from tpplan.plan.layouts import check_layout, check_layouts
from tpplan.plan.styles import STYLE_FIELDS, check_fields_fit_style, check_style
from tpplan.plan.versions import READABLE_VERSIONS, check_fields_fit_version, version_problem

pytestmark = pytest.mark.unit

LAYOUTS = (
    "layouts are replicate, partial, or shard(DIM) with DIM an integer such as shard(-1) or "
    "shard(1)."
)


# ---- layouts ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("replicate", ("replicate", None)),
        ("partial", ("partial", None)),
        ("shard(0)", ("shard", 0)),
        ("shard(-1)", ("shard", -1)),
        ("shard(12)", ("shard", 12)),
    ],
)
def test_a_layout_parses(text: str, parsed: tuple[str, int | None]) -> None:
    assert parse_layout(text) == parsed


@pytest.mark.parametrize(
    "text", ["", "shard", "shard()", "Shard(1)", "shard(1.5)", "shard(+1)", " replicate", "sum"]
)
def test_a_string_that_is_no_layout(text: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_layout(text)
    assert str(e.value) == f"'{text}' is not a layout; {LAYOUTS}"


@pytest.mark.parametrize("value", [None, 3, "replicate", "shard(1)"])
def test_check_layout_leaves_what_is_not_a_string_to_the_field_type(value: Any) -> None:
    assert check_layout(value) == value


@pytest.mark.parametrize(
    "value", [None, [], ["replicate", None], {"mask": "shard(1)"}, {"a": "partial", "b": None}]
)
def test_lists_and_mappings_of_layouts(value: Any) -> None:
    assert check_layouts(value) is value


@pytest.mark.parametrize("value", [["replicate", "bad"], {"mask": "bad"}])
def test_one_bad_layout_in_a_list_or_mapping(value: Any) -> None:
    with pytest.raises(ValueError, match="'bad' is not a layout"):
        check_layouts(value)


# ---- styles -------------------------------------------------------------------------------
def test_every_style_lists_its_fields_and_each_is_a_rule_field() -> None:
    assert set(STYLE_FIELDS) == set(STYLES)
    for style, fields in STYLE_FIELDS.items():
        assert fields <= set(Rule.model_fields) - {"match", "style", "why"}, style


def test_the_styles_are_the_rule_fields_literal() -> None:
    assert get_args(Rule.model_fields["style"].annotation) == STYLES


@pytest.mark.parametrize("style", STYLES)
def test_a_known_style_passes(style: str) -> None:
    assert check_style(style) == style


@pytest.mark.parametrize("value", [3, None, ["colwise"]])
def test_check_style_leaves_what_is_not_a_string_to_the_field_type(value: Any) -> None:
    assert check_style(value) == value


def test_an_unknown_style_names_the_closest_and_all() -> None:
    with pytest.raises(ValueError) as e:
        check_style("vocab_paralel")
    assert str(e.value).startswith(
        "'vocab_paralel' is not a style. Did you mean 'vocab_parallel'? Styles: colwise, "
    )


# the least each style needs, as a rule's fields
MINIMAL: dict[str, dict[str, Any]] = {
    "colwise": {},
    "rowwise": {},
    "vocab_parallel": {},
    "sequence_parallel": {},
    "prepare": {"inputs": ["shard(1)"], "desired_inputs": ["replicate"]},
    "replicate": {},
    "replicate_grad_sum": {},
    "experts": {"shard": {"gate_up_proj": 1, "down_proj": 2}},
    "split_params": {"shard": {"sinks": 0}},
    "heads": {},
}


@pytest.mark.parametrize("style", STYLES)
def test_the_least_each_style_needs_passes(style: str) -> None:
    fields = {"match": "a", "style": style, "why": "x", **MINIMAL[style]}
    check_fields_fit_style(style, fields)


@pytest.mark.parametrize("style", STYLES)
def test_each_style_takes_all_its_own_fields_and_no_other(style: str) -> None:
    others = sorted(set().union(*STYLE_FIELDS.values()) - STYLE_FIELDS[style])
    if not others:
        return
    with pytest.raises(ValueError, match=rf"style '{style}' takes no {others[0]}[,;]"):
        check_fields_fit_style(style, {**MINIMAL[style], others[0]: None})


@pytest.mark.parametrize(
    ("style", "fields", "message"),
    [
        ("sequence_parallel", {"input": "partial"}, "needs input shard(DIM)"),
        ("sequence_parallel", {"input": "shard(1)"}, None),
        ("colwise", {"output": "partial"}, "cannot take or give layout 'partial'"),
        ("rowwise", {"input": "partial", "output": "partial"}, None),
        ("vocab_parallel", {"sum_at": "lookup", "output": "shard(1)"}, "with sum_at: lookup"),
        ("vocab_parallel", {"sum_at": "lookup", "local_output": True}, None),
        ("vocab_parallel", {"written": ["e"], "output": "shard(1)"}, None),
        ("vocab_parallel", {"written": ["e"], "input": "shard(0)"}, "with written"),
        # sum_at's own check comes first when both are off
        ("vocab_parallel", {"written": ["e"], "sum_at": "lookup", "input": "shard(0)"}, "sum_at"),
        ("experts", {"shard": {"w": 0}, "mode": "expert"}, None),
        ("experts", {"shard": {"w": 1}, "fused": {"w": [2, 2]}, "after_sum": ["b"]}, None),
        ("experts", {"shard": {"w": 1}, "fused": {"v": [2, 2]}}, "fused names v"),
        ("prepare", {"outputs": ["shard(1)"], "desired_outputs": None}, "needs both outputs"),
        (
            "prepare",
            {"input_kwargs": {"m": "replicate"}, "desired_input_kwargs": {"m": None}},
            None,
        ),
    ],
)
def test_what_a_style_needs(style: str, fields: dict[str, Any], message: str | None) -> None:
    if message is None:
        check_fields_fit_style(style, fields)
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_fields_fit_style(style, fields)


# ---- versions -----------------------------------------------------------------------------
def test_the_current_version_is_the_newest_read_and_the_default() -> None:
    assert SCHEMA_VERSION == max(READABLE_VERSIONS) == Plan().tpplan
    assert get_args(Plan.model_fields["tpplan"].annotation) == READABLE_VERSIONS


@pytest.mark.parametrize("version", READABLE_VERSIONS)
def test_every_readable_version_is_read(version: int) -> None:
    assert version_problem({"tpplan": version}) is None


def test_a_plan_without_a_version_is_not_a_plan() -> None:
    assert version_problem({"rules": []}) == (
        f"not a tpplan plan: the top-level key 'tpplan: {SCHEMA_VERSION}' (the schema version) "
        "is missing."
    )


# (what a file names, as the check is given it, the version that added it)
ADDED = [
    ({"rules": [("colwise", {"parts"})]}, 2),
    ({"rules": [("rowwise", {"transposed"})]}, 2),
    ({"rules": [("experts", set())]}, 3),
    ({"rules": [("colwise", {"mode"})]}, 3),
    ({"rules": [("colwise", {"fused"})]}, 3),
    ({"rules": [("colwise", {"after_sum"})]}, 3),
    ({"rules": [("split_params", set())]}, 4),
    ({"model_fields": {"command"}}, 4),
    ({"rules": [("experts", {"added_whole"})]}, 5),
    ({"rules": [("vocab_parallel", {"sum_at"})]}, 6),
    ({"rules": [("vocab_parallel", {"written"})]}, 7),
    ({"rules": [("rowwise", {"parts"})]}, 9),
    ({"rules": [("heads", set())]}, 10),
]


@pytest.mark.parametrize(("given", "added"), ADDED, ids=lambda v: str(v))
def test_a_field_or_style_needs_the_version_that_added_it(
    given: dict[str, Any], added: int
) -> None:
    kwargs: dict[str, Any] = {"model_fields": set(), "rules": [], **given}
    check_fields_fit_version(added, **kwargs)
    check_fields_fit_version(SCHEMA_VERSION, **kwargs)
    with pytest.raises(ValueError, match=f"need schema version {added}; change the first line"):
        check_fields_fit_version(added - 1, **kwargs)
