"""Patterns match as parallelize_module matches: per dot-separated segment."""

from __future__ import annotations

import pytest

from tpplan.plan.patterns import collapse, match_names, matches

pytestmark = pytest.mark.unit

NAMES = [
    "model.layers.0.mlp.up_proj",
    "model.layers.1.mlp.up_proj",
    "model.layers.10.mlp.up_proj",
    "model.layers.0.mlp",
    "lm_head",
]


@pytest.mark.parametrize(
    ("pattern", "name", "hit"),
    [
        ("model.layers.*.mlp.up_proj", "model.layers.3.mlp.up_proj", True),
        ("model.*.up_proj", "model.layers.3.mlp.up_proj", False),  # * never crosses a dot
        ("model.layers.*", "model.layers.3.mlp", False),  # same number of segments only
        ("model.layers.[01].mlp", "model.layers.1.mlp", True),
        ("lm_head", "lm_head", True),
        ("LM_head", "lm_head", False),  # case matters
    ],
)
def test_matches_segment_by_segment(pattern: str, name: str, hit: bool) -> None:
    assert matches(pattern, name) is hit


def test_match_names_keeps_order() -> None:
    assert match_names("model.layers.*.mlp.up_proj", NAMES) == NAMES[:3]


def test_collapse_groups_layers() -> None:
    assert collapse(NAMES[:3], NAMES) == ["model.layers.*.mlp.up_proj"]


def test_collapse_keeps_names_when_the_pattern_would_catch_others() -> None:
    assert collapse(NAMES[:2], NAMES) == NAMES[:2]
