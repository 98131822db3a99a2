"""Each rule's `why` as the YAML comment above it: written, read back, byte for byte.

Every shipped plan reads into a Plan and writes back as the same bytes; hand-edited comment
layouts read as the reviewer meant them. No torch here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tpplan import Plan
from tpplan.plan import SCHEMA_VERSION

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "plans").rglob("*.yaml"))


def test_there_are_shipped_plans() -> None:
    assert len(SHIPPED) >= 10, "the recursive glob over plans/ found too few plans"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_shipped_plan_writes_back_byte_identical(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert Plan.from_yaml(text, source=str(path)).to_yaml() == text


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_rule_of_a_shipped_plan_has_its_why_as_a_comment(path: Path) -> None:
    """The shipped whys are all comments (none needs the `why:` key), so a reviewer reads
    each above its rule."""
    text = path.read_text(encoding="utf-8")
    plan = Plan.from_yaml(text)
    assert "why:" not in text
    for rule in [*plan.rules, *plan.attributes]:
        first = rule.why.split(" ")[0]
        assert f"# {first}" in text


def _plan(*whys: str) -> Plan:
    rules = [{"match": f"fc{i}", "style": "colwise", "why": w} for i, w in enumerate(whys)]
    return Plan.model_validate({"tpplan": SCHEMA_VERSION, "rules": rules})


def _comments(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.lstrip().startswith("#")]


def test_a_comment_line_is_at_most_100_columns() -> None:
    out = _plan(" ".join(["abcdefghi"] * 40)).to_yaml()  # 399 characters
    lines = _comments(out)
    # 9 words of 9 letters a line: a 10th would make it 103 columns with the indent and "# "
    assert [len(line) for line in lines] == [93, 93, 93, 93, 43]


def test_a_word_longer_than_a_line_gets_a_line_of_its_own() -> None:
    long = "x" * 150
    out = _plan(f"short {long} tail").to_yaml()
    assert _comments(out) == ["  # short", f"  # {long}", "  # tail"]
    assert Plan.from_yaml(out).rules[0].why == f"short {long} tail"


def test_comments_take_the_indent_of_their_rule() -> None:
    out = Plan.model_validate(
        {
            "tpplan": SCHEMA_VERSION,
            "rules": [{"match": "a", "style": "colwise", "why": "opens"}],
            "attributes": [{"match": "a", "divide": ["n"], "why": "a view reads n"}],
        }
    ).to_yaml()
    assert "rules:\n  # opens\n  - match: a\n" in out
    assert "attributes:\n  # a view reads n\n  - match: a\n" in out


@pytest.mark.parametrize(
    "why",
    [
        "line\nbreak",
        "tab\tinside",
        "two  spaces",
        " leading",
        "trailing ",
        "nel\x85char",
        "ls\u2028char",
        "# a hash first",
        "colon: inside",
        "unicode é ✓",
    ],
)
def test_a_why_reads_back_exactly_as_comment_or_key(why: str) -> None:
    plan = _plan(why)
    out = plan.to_yaml()
    assert Plan.from_yaml(out) == plan
    assert Plan.from_yaml(out).to_yaml() == out


@pytest.mark.parametrize(
    ("why", "as_comment"),
    [
        ("plain words", True),
        ("unicode é ✓", True),
        ("line\nbreak", False),
        ("two  spaces", False),
        (" leading", False),
        ("tab\tinside", False),
    ],
)
def test_a_why_a_comment_cannot_keep_is_written_as_a_key(why: str, as_comment: bool) -> None:
    out = _plan(why).to_yaml()
    assert ("why:" not in out) is as_comment


def test_a_unicode_line_break_in_a_why_is_written_double_quoted() -> None:
    """pyyaml reads NEL, LS and PS inside single quotes back as spaces."""
    assert 'why: "nel\\Nchar"' in _plan("nel\x85char").to_yaml()


@pytest.mark.parametrize(
    ("text", "whys"),
    [
        pytest.param(
            "tpplan: 7\nrules:\n# flush left\n- match: a\n  style: colwise\n",
            ["flush left"],
            id="items not indented",
        ),
        pytest.param(
            "tpplan: 7\nrules:\n  #no space after the hash\n  - match: a\n    style: colwise\n",
            ["no space after the hash"],
            id="no space after #",
        ),
        pytest.param(
            "tpplan: 7\nrules:\n    # deeper than the item\n  - match: a\n    style: colwise\n",
            ["deeper than the item"],
            id="comment indented deeper",
        ),
        pytest.param(
            "tpplan: 7\nrules:\n  # one\n  - {match: a, style: colwise}\n"
            "  # two\n  - {match: b, style: rowwise}\n",
            ["one", "two"],
            id="flow items on lines of their own",
        ),
        pytest.param(
            "tpplan: 7\nrules:\n  # the comment\n  - match: a\n    style: colwise\n    why: the key\n",
            ["the key"],
            id="a why key wins",
        ),
    ],
)
def test_hand_edited_comments_read_as_whys(text: str, whys: list[str]) -> None:
    assert [r.why for r in Plan.from_yaml(text).rules] == whys


def test_a_comment_at_the_end_of_a_line_is_not_a_why() -> None:
    """Only whole-line comments above an item count; a trailing one belongs to its line."""
    text = "tpplan: 7\nrules:\n  - match: a  # not the why\n    style: colwise\n"
    with pytest.raises(ValueError, match=r"rules\[0\] is missing the required field 'why'"):
        Plan.from_yaml(text)


def test_json_plans_keep_why_as_a_key() -> None:
    plan = _plan("opens the region")
    assert '"why": "opens the region"' in plan.to_json()
    assert Plan.from_json(plan.to_json()) == plan


def test_a_plan_without_rules_writes_no_comments() -> None:
    out = Plan().to_yaml()
    assert _comments(out) == []
    assert out == (
        f"tpplan: {SCHEMA_VERSION}\noptions:\n  loss_parallel: false\n"
        "  sequence_parallel: false\nrules: []\n"
    )
