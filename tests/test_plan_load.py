"""load_plan: plan files by path (YAML or JSON, always UTF-8) and shipped plans by name.

Each way a file can fail to read is one message naming the file and the fix. No torch here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tpplan import Plan, PlanFileError, load_plan
from tpplan.plan.shipped import plans_folder, shipped_for_class, shipped_plan, shipped_plans

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SMALL = "tpplan: 7\nrules:\n  # opens\n  - match: fc1\n    style: colwise\n"


def _message(path: str | Path) -> str:
    with pytest.raises(PlanFileError) as e:
        load_plan(path)
    return str(e.value)


def test_a_yaml_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(SMALL)
    assert load_plan(tmp_path / "p.yaml").rules[0].why == "opens"


def test_a_json_file_is_read_as_json(tmp_path: Path) -> None:
    plan = Plan.from_yaml(SMALL)
    (tmp_path / "p.json").write_text(plan.to_json())
    assert load_plan(str(tmp_path / "p.json")) == plan


def test_a_file_with_any_other_suffix_is_read_as_yaml(tmp_path: Path) -> None:
    (tmp_path / "plan.txt").write_text(SMALL)
    assert load_plan(tmp_path / "plan.txt") == Plan.from_yaml(SMALL)


def test_a_file_is_utf8_whatever_the_locale(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_bytes(SMALL.replace("opens", "öffnet ✓").encode("utf-8"))
    assert load_plan(tmp_path / "p.yaml").rules[0].why == "öffnet ✓"


def test_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    assert _message(path) == f"{path}: cannot read the file: No such file or directory."


def test_a_folder(tmp_path: Path) -> None:
    assert _message(tmp_path) == f"{tmp_path}: cannot read the file: Is a directory."


def test_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes("tpplan: 1\n# by Ren\xe9e\nrules: []\n".encode("latin-1"))
    assert _message(path) == (
        f"{path}: byte 0xe9 at line 2, column 9 is not UTF-8; plan files are UTF-8 text. "
        "Fix: save the file as UTF-8."
    )


def test_a_binary_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"\x00\x01\xff\xfe")
    assert _message(path) == (
        f"{path}: a binary file, not a YAML or JSON plan (byte 0xff at line 1, column 3 is "
        "not UTF-8). Fix: check that PLAN names a plan file."
    )


def test_bad_yaml_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("tpplan: 7\nrules:\n  - {match: a, style: colwise\n")
    assert _message(path).startswith(f"{path}: line 4, column 1: malformed YAML: ")


def test_bad_json_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"tpplan": 7,\n "rules": [}\n')
    assert _message(path) == (f"{path}: line 2, column 12: malformed JSON: Expecting value.")


def test_a_schema_problem_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("tpplan: 7\nrules:\n  - {match: a, style: colwsie, why: x}\n")
    assert _message(path).startswith(f"{path}: line 3: rules[0].style: 'colwsie' is not a style.")


# ---- shipped plans ------------------------------------------------------------------------
def test_the_plans_folder_is_the_repositorys_in_a_checkout() -> None:
    assert plans_folder() == ROOT / "plans"


def test_every_shipped_plan_is_found_by_name() -> None:
    found = shipped_plans()
    assert found and set(found) == {p.stem for p in (ROOT / "plans").rglob("*.yaml")}
    assert shipped_plan("llama") == ROOT / "plans" / "llama.yaml"
    assert shipped_plan("no_such_plan") is None


def test_a_bare_name_loads_the_shipped_plan() -> None:
    assert load_plan("llama") == load_plan(ROOT / "plans" / "llama.yaml")


def test_a_file_of_that_name_wins_over_the_shipped_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "llama").write_text(SMALL)
    monkeypatch.chdir(tmp_path)
    assert load_plan("llama") == Plan.from_yaml(SMALL)


def test_an_unknown_name_suggests_the_closest() -> None:
    message = _message("lama")
    assert message.startswith(
        "lama: no such file, and no shipped plan of that name; did you mean 'llama'? "
        "shipped plans: bert, "
    )
    assert message.endswith(".") and ", llama, " in message


def test_an_unknown_name_with_nothing_close_lists_the_plans() -> None:
    message = _message("zzzz")
    assert message.startswith("zzzz: no such file, and no shipped plan of that name; shipped ")


def test_a_name_with_a_suffix_is_a_path_not_a_shipped_name() -> None:
    assert _message("llama.yaml") == (
        "llama.yaml: cannot read the file: No such file or directory."
    )


def test_shipped_plans_are_found_by_model_class() -> None:
    assert "llama" in shipped_for_class("LlamaForCausalLM")
    assert shipped_for_class("NoSuchModelClass") == []
