"""The plan schema: round trips, the checked-in JSON Schema, and every bad-input message."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tpplan import Plan, PlanFileError, load_plan
from tpplan.plan import SCHEMA_VERSION, plan_json_schema

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
    rule = out[out.index("- match: layers.*.fc") :]
    assert rule.index("style:") < rule.index("why:") < rule.index("input:")


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
    msg = _error("tpplan: 7\nrules: []\n")
    assert "schema version 7" in msg and f"reads versions 1, {SCHEMA_VERSION}" in msg
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
    a changed schema under an old version number fails here."""
    history = json.loads((ROOT / "plans" / "schema_versions.json").read_text())
    digest = hashlib.sha256(json.dumps(plan_json_schema(), sort_keys=True).encode()).hexdigest()
    recorded = history.get(str(SCHEMA_VERSION))
    assert recorded is not None, (
        f"record version {SCHEMA_VERSION}'s hash {digest} in plans/schema_versions.json"
    )
    assert recorded == digest, (
        f"the plan schema changed but SCHEMA_VERSION is still {SCHEMA_VERSION}: bump it in "
        "tpplan/plan.py and record the new hash"
    )


def test_schema_descriptions_come_from_field_docs() -> None:
    rule = plan_json_schema()["$defs"]["Rule"]["properties"]
    assert "fnmatch" in rule["match"]["description"]


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
        ("{match: o, style: rowwise, parts: [8, 8], why: x}", "style 'rowwise' takes no parts"),
    ],
)
def test_bad_parts_are_refused(rule: str, message: str) -> None:
    assert message in _error(f"tpplan: 2\nrules:\n  - {rule}\n")
