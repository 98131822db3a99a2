"""The plan schema: round trips, the checked-in JSON Schema, and every bad-input message."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpplan import Plan, PlanFileError, load_plan
from tpplan.plan import SCHEMA_VERSION, plan_json_schema
from tpplan.plan.shipped import shipped_plans

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
LLAMA_PLAN = ROOT / "tests" / "plans" / "llama.yaml"

FULL = """\
tpplan: 1
model:
  class: Toy
  fingerprint: sha256:0123456789abcdef
  parameters:
    layers.*.fc.weight: (8, 4) x2
options:
  loss_parallel: true
  sequence_parallel: true
rules:
  - match: layers.*.fc
    style: colwise
    why: 'opens: the region'
    input: shard(1)
    output: shard(-1)
    local_output: false
    head_dim: 4
  - match: layers.*.attn
    style: prepare
    why: wants whole sequences
    inputs: [shard(1), null]
    desired_inputs: [replicate, null]
    input_kwargs:
      mask: replicate
    desired_input_kwargs:
      mask: replicate
  - match: norm
    style: sequence_parallel
    why: runs on a sequence shard
  - match: layers.*.q_norm
    style: replicate_grad_sum
    why: per-head weights used on sharded heads
attributes:
  - match: layers.*.attn
    divide: [n_head]
    why: forward views with self.n_head
"""


def _error(text: str) -> str:
    with pytest.raises(PlanFileError) as e:
        Plan.from_yaml(text, source="p.yaml")
    return str(e.value)


def _rule(extra: str) -> str:
    return f"tpplan: 1\nrules:\n  - match: a\n{extra}"


@pytest.mark.parametrize("text", [FULL, LLAMA_PLAN.read_text()], ids=["full", "llama"])
def test_yaml_is_byte_stable(text: str) -> None:
    once = Plan.from_yaml(text).to_yaml()
    assert Plan.from_yaml(once).to_yaml() == once
    assert Plan.from_yaml(once) == Plan.from_yaml(text)


def test_yaml_keeps_field_order_and_one_line_layouts() -> None:
    out = Plan.from_yaml(FULL).to_yaml()
    assert out.index("tpplan:") < out.index("model:") < out.index("options:") < out.index("rules:")
    assert "inputs: [shard(1), null]" in out
    # `why` is the comment above the rule, not a key between style and the layouts
    assert "  # opens: the region\n  - match: layers.*.fc\n    style: colwise\n    input:" in out


def test_json_round_trip_equals_yaml() -> None:
    plan = Plan.from_yaml(FULL)
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["rules"][0]["match"] == "layers.*.fc"


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_save_and_load(tmp_path: Path, suffix: str) -> None:
    plan = Plan.from_yaml(FULL)
    path = tmp_path / f"plan{suffix}"
    plan.save(path)
    assert load_plan(path) == plan
    assert path.read_text().lstrip().startswith("{" if suffix == ".json" else "tpplan:")


def test_malformed_yaml_names_line_and_column() -> None:
    msg = _error("tpplan: 1\nrules:\n  - match: [a\n")
    assert "p.yaml" in msg and "malformed YAML" in msg and "line 4, column 1" in msg


def test_malformed_json_names_line_and_column() -> None:
    with pytest.raises(PlanFileError, match=r"line 2, column \d+: malformed JSON"):
        Plan.from_json('{"tpplan": 1,\n "rules": [}', source="p.json")


def test_unknown_style_suggests_the_closest() -> None:
    msg = _error(_rule("    style: colwsie\n    why: x\n"))
    assert "'colwsie' is not a style. Did you mean 'colwise'?" in msg
    assert "line 4" in msg and "rowwise" in msg  # where, and the full list


def test_unknown_field_is_named() -> None:
    msg = _error(_rule("    style: colwise\n    why: x\n    outptu: replicate\n"))
    assert "unknown field 'outptu' in rules[0]" in msg and "line 6" in msg


def test_unknown_top_level_field_is_named() -> None:
    assert "unknown field 'rulez' in plan" in _error("tpplan: 1\nrulez: []\n")


def test_wrong_schema_version_says_what_to_do() -> None:
    msg = _error("tpplan: 99\nrules: []\n")
    assert "schema version 99" in msg and "reads versions 1, 2, 3" in msg
    assert "pip install -U tpplan" in msg


def test_missing_version_says_it_is_not_a_plan() -> None:
    assert "not a tpplan plan" in _error("rules: []\n")


def test_a_rule_without_why_is_refused() -> None:
    msg = _error(_rule("    style: colwise\n"))
    assert "rules[0] is missing the required field 'why'" in msg


def test_bad_layout_lists_the_allowed_ones() -> None:
    msg = _error(_rule("    style: colwise\n    why: x\n    output: shard(last)\n"))
    assert "'shard(last)' is not a layout" in msg and "replicate, partial, or shard(DIM)" in msg


def test_a_field_the_style_does_not_take() -> None:
    msg = _error(_rule("    style: replicate\n    why: x\n    head_dim: 8\n"))
    assert "style 'replicate' takes no head_dim" in msg


def test_prepare_needs_pairs_of_layouts() -> None:
    msg = _error(_rule("    style: prepare\n    why: x\n    inputs: [shard(1)]\n"))
    assert "needs both inputs and desired_inputs" in msg


def test_every_problem_is_reported_at_once() -> None:
    text = (
        "tpplan: 1\nrules:\n"
        "  - {match: a, style: colwsie, why: x}\n"
        "  - {match: b, style: colwise}\n"
        "  - {match: c, style: colwise, why: x, bogus: 1}\n"
    )
    msg = _error(text)
    assert "has 3 problems" in msg
    assert "line 3" in msg and "line 4" in msg and "line 5" in msg


def test_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(PlanFileError, match=r"missing\.yaml: cannot read the file"):
        load_plan(tmp_path / "missing.yaml")


def test_checked_in_schema_is_current() -> None:
    checked_in = json.loads((ROOT / "plans" / "schema.json").read_text())
    assert checked_in == plan_json_schema(), "regenerate it: tpplan schema > plans/schema.json"


def test_schema_changes_bump_the_version() -> None:
    """plans/schema_versions.json records the schema hash of every version ever released:
    a changed schema under an old version number fails here. A version may record later
    hashes, each with a note saying why the files it reads are the same (the schema only
    written another way); the last is the current one."""
    history = json.loads((ROOT / "plans" / "schema_versions.json").read_text())
    digest = hashlib.sha256(json.dumps(plan_json_schema(), sort_keys=True).encode()).hexdigest()
    recorded = history["hashes"].get(str(SCHEMA_VERSION))
    assert recorded is not None, (
        f"record version {SCHEMA_VERSION}'s hash {digest} in plans/schema_versions.json"
    )
    hashes = recorded if isinstance(recorded, list) else [recorded]
    assert hashes[-1] == digest, (
        f"the plan schema changed but SCHEMA_VERSION is still {SCHEMA_VERSION}: bump it in "
        "tpplan/plan/versions.py and record the new hash"
    )
    for version, entry in history["hashes"].items():
        if isinstance(entry, list):
            assert len(history["notes"].get(version, [])) == len(entry) - 1, version


def test_every_shipped_plan_is_valid_under_the_json_schema() -> None:
    """plans/schema.json as an editor reads it (each rule one style's entry, picked by its
    style) takes every shipped plan, and refuses a rule of one style with another's field."""
    schema = json.loads((ROOT / "plans" / "schema.json").read_text())
    # one validator for every plan: jsonschema.validate checks the schema and builds a new
    # validator on every call, which took 2.3 s of this test's 2.7
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema)
    names = shipped_plans()
    assert names
    for name in names:
        validator.validate(load_plan(name).to_data())
    bad = {
        "tpplan": 12,
        "rules": [{"match": "a", "style": "replicate", "why": "x", "parts": [2, 2]}],
    }
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(bad)


def test_schema_descriptions_come_from_field_docs() -> None:
    defs = plan_json_schema()["$defs"]
    assert "fnmatch" in defs["ColwiseRule"]["properties"]["match"]["description"]
    # each style's own words for a field they share
    assert "default replicate" in defs["ColwiseRule"]["properties"]["input"]["description"]
    assert "default shard(-1)" in defs["RowwiseRule"]["properties"]["input"]["description"]


def test_reading_a_plan_does_not_import_torch() -> None:
    code = (
        "import sys, tpplan; "
        f"tpplan.load_plan({str(LLAMA_PLAN)!r}); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_version_1_files_are_still_read() -> None:
    plan = Plan.from_yaml(
        "tpplan: 1\nrules:\n  - {match: fc1, style: colwise, why: opens the MLP}\n"
    )
    assert plan.tpplan == 1 and plan.rules[0].style == "colwise"


def test_version_2_fields_in_a_version_1_file_say_to_bump_it() -> None:
    msg = _error(
        "tpplan: 1\nrules:\n  - {match: qkv, style: colwise, parts: [8, 4, 4], why: fused}\n"
    )
    assert "rules[0].parts need schema version 2" in msg and "'tpplan: 2'" in msg


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("{match: qkv, style: colwise, parts: [8], why: x}", "at least 2 items"),
        ("{match: qkv, style: colwise, parts: [8, 0], why: x}", "greater than 0"),
        ("{match: o, style: rowwise, parts: [8, 16], why: x}", "rowwise' takes parts of one size"),
        ("{match: o, style: sequence_parallel, parts: [8, 8], why: x}", "takes no parts"),
    ],
)
def test_bad_parts_are_refused(rule: str, message: str) -> None:
    assert message in _error(f"tpplan: 2\nrules:\n  - {rule}\n")


# ---- `why` as a YAML comment ------------------------------------------------------------
def _plan(*whys: str) -> Plan:
    rules = [{"match": f"layers.*.fc{i}", "style": "colwise", "why": w} for i, w in enumerate(whys)]
    return Plan.model_validate({"tpplan": SCHEMA_VERSION, "rules": rules})


def test_why_is_a_comment_above_its_rule_wrapped_at_100_columns() -> None:
    long = " ".join(f"word{i}" for i in range(60))  # ~400 characters
    out = _plan("short reason", long).to_yaml()
    assert "why:" not in out
    assert "  # short reason\n  - match: layers.*.fc0\n" in out
    comment = [line for line in out.splitlines() if line.startswith("  # word")]
    assert len(comment) > 3 and all(len(line) <= 100 for line in comment)
    assert out.index(comment[-1]) < out.index("  - match: layers.*.fc1\n")
    assert Plan.from_yaml(out).rules[1].why == long


def test_attribute_rules_get_their_why_as_a_comment_too() -> None:
    plan = Plan.from_yaml(FULL)
    out = plan.to_yaml()
    assert "  # forward views with self.n_head\n  - match: layers.*.attn\n    divide:" in out
    assert Plan.from_yaml(out).attributes == plan.attributes


def test_json_keeps_why_as_a_key() -> None:
    assert json.loads(Plan.from_yaml(FULL).to_json())["rules"][0]["why"] == "opens: the region"


@pytest.mark.parametrize(
    "why", ["two\nlines", "a  double space", " leading space", "tab\there", "#hash", "x"]
)
def test_every_why_round_trips_byte_stable(why: str) -> None:
    """A why a comment cannot give back exactly (line breaks, tabs, runs of spaces) stays a
    key; the rest are comments; either way the file reads back to the same plan."""
    plan = _plan(why)
    out = plan.to_yaml()
    assert Plan.from_yaml(out) == plan and Plan.from_yaml(out).to_yaml() == out
    assert ("why:" in out) != (f"  # {why}\n" in out)


def test_comment_block_above_a_rule_is_its_why() -> None:
    text = (
        "tpplan: 2\nrules:\n"
        "  # opens the region,\n  #\n  #   closed by fc2\n"
        "  - match: fc1\n    style: colwise\n"
        "  - {match: fc2, style: rowwise, why: closes it}\n"
    )
    assert [r.why for r in Plan.from_yaml(text).rules] == [
        "opens the region, closed by fc2",
        "closes it",
    ]


def test_a_why_key_wins_over_the_comment() -> None:
    text = (
        "tpplan: 2\nrules:\n  # the comment\n  - match: fc1\n    style: colwise\n    why: the key\n"
    )
    assert Plan.from_yaml(text).rules[0].why == "the key"


def test_a_header_comment_does_not_break_loading() -> None:
    text = "# Plan for my model, edited by hand.\n# Reviewed in PR 12.\n" + LLAMA_PLAN.read_text()
    text = text.replace("rules:\n", "# the rules, in model order\nrules:\n")
    assert Plan.from_yaml(text) == load_plan(LLAMA_PLAN)


def test_a_comment_above_rules_is_not_the_first_rules_why() -> None:
    msg = _error("tpplan: 2\n# header\nrules:\n  - match: fc1\n    style: colwise\n")
    assert "line 4: rules[0] is missing the required field 'why'" in msg


def test_a_comment_above_a_flow_list_is_not_its_first_items_why() -> None:
    msg = _error("tpplan: 2\n# header\nrules: [{match: fc1, style: colwise}]\n")
    assert "rules[0] is missing the required field 'why'" in msg


def test_a_rule_with_neither_comment_nor_key_names_its_line() -> None:
    text = (
        "tpplan: 2\nrules:\n  # opens\n  - match: fc1\n    style: colwise\n\n"
        "  - match: fc2\n    style: rowwise\n"
    )
    msg = _error(text)  # the blank line ends fc1's comment: it is not fc2's why
    assert "line 7: rules[1] is missing the required field 'why'" in msg
    assert "rules[0]" not in msg


# 100 examples, hypothesis's default: each is three passes of pure-Python YAML, and 300 took
# 3 s, the unit tier's slowest test; test_every_why_round_trips_byte_stable pins the hard whys
@settings(max_examples=100, deadline=None)
@given(whys=st.lists(st.text(min_size=1, max_size=300), min_size=1, max_size=3))
def test_any_why_round_trips_byte_stable(whys: list[str]) -> None:
    plan = _plan(*whys)
    out = plan.to_yaml()
    back = Plan.from_yaml(out)  # read once: a second read was a fifth of the time
    assert back == plan
    assert back.to_yaml() == out


def test_split_params_needs_the_parameters_it_splits() -> None:
    text = "tpplan: 4\nrules:\n  - {match: attn, style: split_params, why: x}\n"
    with pytest.raises(PlanFileError, match=r"split_params needs shard: \{parameter: dim\}"):
        Plan.from_yaml(text)


def test_split_params_needs_schema_version_4() -> None:
    text = "tpplan: 3\nrules:\n  - {match: attn, style: split_params, shard: {s: 0}, why: x}\n"
    with pytest.raises(PlanFileError, match="need schema version 4"):
        Plan.from_yaml(text)
