"""The plan's vocabularies as plain functions: styles, layouts and schema versions.

tests/test_plan_messages.py checks the same messages through a whole plan file; here each
check runs on the plain values a rule gives, as tpplan/plan/styles/, layouts.py and
versions.py define them. No torch here.
"""

from __future__ import annotations

import re
from typing import Any, get_args

import pytest

from tpplan.plan import SCHEMA_VERSION, STYLES, Plan, Rule, parse_layout
from tpplan.plan.layouts import check_layout, check_layouts
from tpplan.plan.rule import STYLE_CLASSES
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
def test_every_style_is_a_class_of_its_own_named_by_its_style_field() -> None:
    assert tuple(STYLE_CLASSES) == STYLES
    for style, cls in STYLE_CLASSES.items():
        assert issubclass(cls, Rule) and cls.model_fields["style"].default == style
        assert get_args(cls.model_fields["style"].annotation) == (style,)


@pytest.mark.parametrize("style", STYLES)
def test_rule_builds_the_class_of_its_style(style: str) -> None:
    rule = Rule(match="a", style=style, why="x", **MINIMAL[style])
    assert type(rule) is STYLE_CLASSES[style]
    assert type(Rule.parse(rule.model_dump(exclude_none=True))) is STYLE_CLASSES[style]


def test_an_unknown_style_names_the_closest_and_all() -> None:
    with pytest.raises(ValueError) as e:
        Rule(match="a", style="vocab_paralel", why="x")
    assert "'vocab_paralel' is not a style. Did you mean 'vocab_parallel'? Styles: colwise, " in (
        str(e.value)
    )


def test_an_unknown_style_is_its_one_problem_whatever_fields_the_rule_gives() -> None:
    with pytest.raises(ValueError) as e:
        Rule(match="a", style="colwsie", why="x", head_dim=4)
    assert "is not a style" in str(e.value) and "head_dim" not in str(e.value)


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


def _rule(style: str, **fields: Any) -> Rule:
    return Rule.parse({"match": "a", "style": style, "why": "x", **fields})


@pytest.mark.parametrize("style", STYLES)
def test_the_least_each_style_needs_passes(style: str) -> None:
    assert _rule(style, **MINIMAL[style]).style == style


@pytest.mark.parametrize("style", STYLES)
def test_each_style_takes_its_own_fields_and_no_other(style: str) -> None:
    own = STYLE_CLASSES[style].own_fields()
    others = sorted(set().union(*(c.own_fields() for c in STYLE_CLASSES.values())) - own)
    if not others:
        return
    with pytest.raises(ValueError, match=rf"style '{style}' takes no {others[0]}; its optional"):
        _rule(style, **{**MINIMAL[style], others[0]: None})


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
            {"input_kwargs": {"m": "shard(1)"}, "desired_input_kwargs": {"m": "replicate"}},
            None,
        ),
    ],
)
def test_what_a_style_needs(style: str, fields: dict[str, Any], message: str | None) -> None:
    if message is None:
        _rule(style, **fields)
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            _rule(style, **fields)


@pytest.mark.parametrize(
    ("style", "fields", "kind", "dim"),
    [
        ("colwise", {}, "linear", 0),
        ("colwise", {"transposed": True}, "linear", 1),
        ("colwise", {}, "conv", 0),
        ("colwise", {}, "embedding", 1),
        ("rowwise", {}, "linear", 1),
        ("rowwise", {"transposed": True}, "linear", 0),
        ("rowwise", {}, "conv", 1),
        ("rowwise", {}, "embedding", 0),
        ("vocab_parallel", {}, "embedding", 0),
        ("vocab_parallel", {}, "linear", None),
        ("sequence_parallel", {}, "linear", None),
    ],
)
def test_which_dim_of_a_weight_a_style_splits(
    style: str, fields: dict[str, Any], kind: Any, dim: int | None
) -> None:
    rule = _rule(style, **fields)
    assert rule.weight_dim(kind) == dim


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


# (a rule's style and fields, or what else a file names, and the version that added it)
ADDED = [
    ({"rules": [("colwise", {"parts": [2, 2]})]}, 2),
    ({"rules": [("rowwise", {"transposed": True})]}, 2),
    ({"rules": [("experts", {"shard": {"w": 1}})]}, 3),
    ({"rules": [("experts", {"shard": {"w": 1}, "fused": {"w": [2, 2]}})]}, 3),
    ({"rules": [("split_params", {"shard": {"s": 0}})]}, 4),
    ({"model_fields": {"command"}}, 4),
    ({"rules": [("experts", {"shard": {"w": 1}, "added_whole": ["e"]})]}, 5),
    ({"rules": [("vocab_parallel", {"sum_at": "lookup"})]}, 6),
    ({"rules": [("vocab_parallel", {"written": ["e"]})]}, 7),
    ({"regions": True}, 8),
    ({"rules": [("rowwise", {"parts": [2, 2]})]}, 9),
    ({"rules": [("heads", {})]}, 10),
    ({"rules": [("colwise", {"replicate_heads": True, "head_dim": 4})]}, 11),
    ({"attributes": [("by", "of")]}, 11),
    ({"rules": [("colwise", {"replicate_heads": True})]}, 12),
]


@pytest.mark.parametrize(("given", "added"), ADDED, ids=lambda v: str(v))
def test_a_field_or_style_needs_the_version_that_added_it(
    given: dict[str, Any], added: int
) -> None:
    rules = [_rule(style, **fields) for style, fields in given.get("rules", [])]

    def check(version: int) -> None:
        kwargs = {k: v for k, v in given.items() if k != "rules"}
        kwargs.setdefault("model_fields", set())
        check_fields_fit_version(version, rules=[r.newer_than(version) for r in rules], **kwargs)

    check(added)
    check(SCHEMA_VERSION)
    with pytest.raises(ValueError, match=f"need schema version {added}; change the first line"):
        check(added - 1)
