"""diff_plans (tpplan/plan/diff.py) on its own: which changes between two plans count, rule by
rule and module by module. No torch: module names are given as a list."""

from __future__ import annotations

from typing import Any

import pytest

from tpplan.plan import Plan, Rule
from tpplan.plan.diff import Change, diff_plans

pytestmark = pytest.mark.unit

# the module names of a two-layer model: what a model's named_modules() gives ("" first)
NAMES = [
    "",
    "embed",
    "layers",
    "layers.0",
    "layers.0.fc1",
    "layers.0.fc2",
    "layers.1",
    "layers.1.fc1",
    "layers.1.fc2",
    "head",
]


def _rule(match: str, style: str = "colwise", why: str = "a reason", **fields: Any) -> Rule:
    return Rule(match=match, style=style, why=why, **fields)


def _plan(*rules: Rule, **options: bool) -> Plan:
    return Plan(rules=list(rules), options=options)


MLP = (_rule("layers.*.fc1"), _rule("layers.*.fc2", "rowwise"))


@pytest.mark.parametrize("names", [None, NAMES], ids=["by_pattern", "by_module"])
def test_a_plan_against_itself_is_no_change(names: list[str] | None) -> None:
    assert diff_plans(_plan(*MLP), _plan(*MLP), module_names=names) == []


@pytest.mark.parametrize("names", [None, NAMES], ids=["by_pattern", "by_module"])
def test_a_reworded_reason_is_no_change(names: list[str] | None) -> None:
    b = _plan(_rule("layers.*.fc1", why="other words"), MLP[1])
    assert diff_plans(_plan(*MLP), b, module_names=names) == []


def test_a_changed_style_is_named_by_pattern() -> None:
    b = _plan(MLP[0], _rule("layers.*.fc2", "replicate"))
    assert diff_plans(_plan(*MLP), b) == [Change("layers.*.fc2", "rowwise", "replicate")]


def test_rules_added_and_removed_by_pattern_sorted_by_pattern() -> None:
    a = _plan(_rule("head"), *MLP)
    b = _plan(*MLP, _rule("embed", "vocab_parallel"))
    assert [str(c) for c in diff_plans(a, b)] == ["+ embed: vocab_parallel", "- head: colwise"]


def test_fields_other_than_the_pattern_and_reason_are_part_of_the_rule() -> None:
    b = _plan(_rule("layers.*.fc1", output="replicate"), MLP[1])
    [change] = diff_plans(_plan(*MLP), b)
    assert str(change) == "~ layers.*.fc1: colwise -> colwise (output=replicate)"


def test_a_respelled_pattern_is_a_change_by_pattern_and_none_by_module() -> None:
    b = _plan(_rule("layers.[01].fc1"), MLP[1])
    assert {str(c) for c in diff_plans(_plan(*MLP), b)} == {
        "- layers.*.fc1: colwise",
        "+ layers.[01].fc1: colwise",
    }
    assert diff_plans(_plan(*MLP), b, module_names=NAMES) == []


def test_by_module_a_module_no_rule_matches_counts_as_replicated() -> None:
    b = _plan(MLP[0])
    assert diff_plans(_plan(*MLP), b, module_names=NAMES) == [
        Change("layers.*.fc2", "rowwise", "replicate")
    ]
    # and a rule saying replicate is no change from no rule
    c = _plan(MLP[0], _rule("layers.*.fc2", "replicate"))
    assert diff_plans(b, c, module_names=NAMES) == []


def test_by_module_changes_in_every_layer_collapse_to_one_pattern() -> None:
    b = _plan(_rule("layers.*.fc1", transposed=True), MLP[1])
    assert [str(c) for c in diff_plans(_plan(*MLP), b, module_names=NAMES)] == [
        "~ layers.*.fc1: colwise -> colwise (transposed=True)"
    ]


def test_by_module_a_change_in_one_layer_names_that_layer() -> None:
    b = _plan(_rule("layers.0.fc1"), _rule("layers.1.fc1", "replicate"), MLP[1])
    assert diff_plans(_plan(*MLP), b, module_names=NAMES) == [
        Change("layers.1.fc1", "colwise", "replicate")
    ]


def test_by_module_the_first_rule_matching_a_module_counts() -> None:
    b = _plan(*MLP, _rule("layers.0.fc1", "replicate"))
    assert diff_plans(_plan(*MLP), b, module_names=NAMES) == []


@pytest.mark.parametrize("names", [None, NAMES], ids=["by_pattern", "by_module"])
def test_changed_options_are_named_beside_the_rules(names: list[str] | None) -> None:
    b = _plan(MLP[0], sequence_parallel=True)
    changes = diff_plans(_plan(*MLP), b, module_names=names)
    assert Change("options.sequence_parallel", "false", "true") in changes
    assert Change("layers.*.fc2", "rowwise", None if names is None else "replicate") in changes
    assert len(changes) == 2


@pytest.mark.parametrize(
    ("change", "text"),
    [
        (Change("a.b", None, "colwise"), "+ a.b: colwise"),
        (Change("a.b", "rowwise", None), "- a.b: rowwise"),
        (Change("a.b", "colwise", "replicate"), "~ a.b: colwise -> replicate"),
    ],
    ids=["added", "removed", "changed"],
)
def test_change_text(change: Change, text: str) -> None:
    assert str(change) == text


def test_a_rules_fields_are_named_in_the_order_of_the_schema() -> None:
    b = _plan(_rule("layers.*.fc1", head_dim=8, input="shard(1)"), MLP[1])
    [change] = diff_plans(_plan(*MLP), b)
    assert change.after == "colwise (input=shard(1), head_dim=8)"
