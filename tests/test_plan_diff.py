"""diff_plans: what changes between two plans, by pattern or module by module. No torch."""

from __future__ import annotations

from typing import Any

import pytest

from tpplan.plan import SCHEMA_VERSION, Plan
from tpplan.plan.diff import Change, diff_plans

pytestmark = pytest.mark.unit

# the module names of a two-layer model, as named_modules() gives them ("" is the root)
NAMES = [
    "",
    "layers",
    "layers.0",
    "layers.0.up",
    "layers.0.down",
    "layers.1",
    "layers.1.up",
    "layers.1.down",
    "head",
]


def _plan(*rules: dict[str, Any], **options: bool) -> Plan:
    return Plan.model_validate(
        {"tpplan": SCHEMA_VERSION, "options": options, "rules": [{"why": "w", **r} for r in rules]}
    )


UP = {"match": "layers.*.up", "style": "colwise"}
DOWN = {"match": "layers.*.down", "style": "rowwise"}


@pytest.mark.parametrize(
    ("change", "text"),
    [
        (Change("a", None, "colwise"), "+ a: colwise"),
        (Change("a", "colwise", None), "- a: colwise"),
        (Change("a", "colwise", "rowwise"), "~ a: colwise -> rowwise"),
    ],
)
def test_a_change_reads_as_one_line(change: Change, text: str) -> None:
    assert str(change) == text


def test_a_plan_against_itself_is_no_change() -> None:
    assert diff_plans(_plan(UP, DOWN), _plan(UP, DOWN)) == []
    assert diff_plans(_plan(UP, DOWN), _plan(UP, DOWN), module_names=NAMES) == []


def test_a_reworded_why_is_no_change() -> None:
    assert diff_plans(_plan(UP), _plan({**UP, "why": "another reason"})) == []


def test_by_pattern_rules_added_removed_and_changed() -> None:
    a = _plan(UP, DOWN)
    b = _plan({**UP, "output": "replicate"}, {"match": "head", "style": "colwise"})
    assert [str(c) for c in diff_plans(a, b)] == [
        "+ head: colwise",
        "- layers.*.down: rowwise",
        "~ layers.*.up: colwise -> colwise (output=replicate)",
    ]


def test_a_rules_fields_are_named_in_the_order_of_the_schema() -> None:
    a = _plan(UP)
    b = _plan({**UP, "head_dim": 8, "input": "shard(1)"})
    [change] = diff_plans(a, b)
    assert change.after == "colwise (input=shard(1), head_dim=8)"


def test_options_are_compared_too() -> None:
    changes = diff_plans(_plan(UP), _plan(UP, loss_parallel=True))
    assert changes == [Change("options.loss_parallel", "false", "true")]


def test_by_module_a_respelled_pattern_is_no_change() -> None:
    respelled = {**UP, "match": "layers.*.u*"}
    assert diff_plans(_plan(UP), _plan(respelled), module_names=NAMES) == []
    assert diff_plans(_plan(UP), _plan(respelled)) != []  # by pattern it is a change


def test_by_module_a_dropped_rule_leaves_its_modules_replicated() -> None:
    changes = diff_plans(_plan(UP, DOWN), _plan(UP), module_names=NAMES)
    assert [str(c) for c in changes] == ["~ layers.*.down: rowwise -> replicate"]


def test_by_module_a_change_to_one_layer_names_that_module() -> None:
    one = {"match": "layers.1.up", "style": "colwise", "output": "replicate"}
    changes = diff_plans(_plan(UP), _plan(one, UP), module_names=NAMES)
    assert [str(c) for c in changes] == ["~ layers.1.up: colwise -> colwise (output=replicate)"]


def test_by_module_the_first_matching_rule_counts() -> None:
    first = _plan({"match": "head", "style": "colwise"}, {"match": "head", "style": "rowwise"})
    assert diff_plans(first, _plan({"match": "head", "style": "colwise"}), module_names=NAMES) == []
