"""The plans shipped in plans/: each one validates, is what `tpplan infer` writes today (its
own `model.command`), passes check_plan, and gives the unsharded model's numbers, forward
and backward, on a small model of its family. Shipped plans resolve by name."""

from __future__ import annotations

import copy
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from support.shipped import HEADS_64, OTHER, PLANS, ROOT, SMALL, WIDTHS, plan_spec

import tpplan
from tpplan import cli
from tpplan._runtime.facts import parameter_shapes
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan._runtime.models import build_model
from tpplan.check import complete_plan
from tpplan.diagnose.verify import verify_plan
from tpplan.plan import load_plan
from tpplan.plan.shipped import shipped_plans

# fp32, two layers at real head widths: sharding sums the same products in another order
# (seen: ~1e-6); a wrong shard or a missing reduction is off by O(0.1).
TOL = 1e-4


def test_plans_are_shipped() -> None:
    """The recursive glob finds the library (at least 15 families), every file resolves by
    its name, and every one has a small model here to be tested on."""
    assert len(PLANS) >= 15
    assert {p.stem for p in PLANS} == set(shipped_plans())
    assert {p.stem for p in PLANS} <= set(SMALL), "add a small config for the new plan to SMALL"
    assert {p.stem for p in PLANS} <= set(OTHER), "add a second width of its family to OTHER"


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_the_two_widths_of_a_family_differ(path: Path) -> None:
    """OTHER is another width than SMALL (the same layers and vocab): some parameter has
    another shape, so that both tests below prove the plan serves two widths."""
    spec, overrides = plan_spec(path)
    small, other = (build_model(spec, {**overrides, **w[path.stem]}) for w in (SMALL, OTHER))
    assert parameter_shapes(small) != parameter_shapes(other)


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_plan_is_valid_and_portable(path: Path) -> None:
    """Valid, written by `tpplan infer`, with no fingerprint: it serves every size of its
    family whose widths (head_dim, fused parts) match, as check_plan decides."""
    plan = load_plan(path)
    assert plan.tpplan == tpplan.SCHEMA_VERSION
    assert plan.model is not None and plan.model.fingerprint is None
    assert plan.model.command and plan.model.command.startswith("tpplan infer ")
    assert all(rule.why.strip() for rule in plan.rules)


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_plan_has_not_drifted(path: Path, tmp_path: Path) -> None:
    """Running the plan's own command today writes the same file, byte for byte."""
    command = load_plan(path).model.command  # type: ignore[union-attr]
    out = tmp_path / path.name
    assert cli.main([*shlex.split(command)[1:], "-o", str(out)]) == 0
    assert out.read_text() == path.read_text(), (
        f"tpplan now infers another plan for {path.name}; read the diff, then regenerate: "
        f"{command} -o plans/{path.name}"
    )


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_plan_checks_and_matches_the_unsharded_model(path: Path, width: str) -> None:
    """At two widths of the family: the sizes the plan leaves out are each model's own."""
    spec, overrides = plan_spec(path)
    torch.manual_seed(0)
    model = build_model(spec, {**overrides, **WIDTHS[width][path.stem]}, device="cpu")
    plan = load_plan(path)
    assert tpplan.check_plan(plan, model, tp_size=2) == []
    report = verify_plan(model, plan, tp_size=2, backward=True, tol=TOL)
    assert report.ok, f"{path.stem}: worst error {report.worst:.3g} at tp 2"


def test_a_shipped_plan_applies_by_name() -> None:
    """The plan kept on the model is the shipped one completed with the model's sizes (the
    checkpoint helpers read it)."""
    torch.manual_seed(0)
    model = build_model("llama", SMALL["llama"], device="cpu")
    shipped = load_plan(ROOT / "plans" / "llama.yaml")
    completed, problems = complete_plan(shipped, model, tp_size=2)
    assert problems == [] and completed != shipped
    with simulated_ranks(2) as mesh:
        tpplan.apply_plan(model, mesh, plan="llama")
        assert model._tpplan_plan == completed  # type: ignore[operator]


# TinyLlama's shape, narrowed: heads of 64 (not Llama-3-8B's 128), grouped-query attention
# with 4 query heads per key/value head; 2 layers
TINY_LLAMA = {
    "num_hidden_layers": 2, "vocab_size": 512, "hidden_size": 512, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256,
}  # fmt: skip


@pytest.mark.parametrize("tp", [2, 4])
def test_the_llama_plan_applies_to_a_llama_of_head_dim_64(tp: int) -> None:
    """The shipped plan leaves head_dim out: apply_plan reads 64 from the model and shards
    whole heads of 64 (at tp 4 each of the 2 key/value heads goes whole to 2 ranks, which
    needs the head's size), with the unsharded model's logits."""
    torch.manual_seed(0)
    model = build_model("llama", TINY_LLAMA, device="cpu")
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids).logits
    with simulated_ranks(tp) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan="llama")
        got = rank_values(sharded(input_ids=ids).logits)
    assert len(got) == tp and all((g - want).abs().max().item() < TOL for g in got)
    kept = sharded._tpplan_plan  # type: ignore[attr-defined]
    assert {r.match.rpartition(".")[2]: r.head_size() for r in kept.rules if r.head_size()} == {
        "q_proj": 64, "k_proj": 64, "v_proj": 64, "o_proj": 64,
    }  # fmt: skip


def test_a_plan_stating_another_head_dim_is_one_problem_per_rule(capsys) -> None:
    """The llama plan as written for Llama-3-8B (head_dim 128) checked on a model of heads
    of 64 at tp 4 (the issue's command): the wrong head_dim is told once on each of the four
    rules that state it, and not again as heads tp does not divide or attributes it could
    not divide."""
    stated = load_plan(ROOT / "plans" / "llama.yaml")
    model = build_model("llama", {"num_hidden_layers": 1, "vocab_size": 512, **HEADS_64})
    stated, _ = complete_plan(stated, build_model("llama", {"num_hidden_layers": 1}), tp_size=4)
    problems = tpplan.check_plan(stated, model, tp_size=4)
    assert [(p.kind, p.rule.split("match: ")[1]) for p in problems] == [
        ("head_dim", f"model.layers.*.self_attn.{n})")
        for n in ("q_proj", "k_proj", "v_proj", "o_proj")
    ]
    assert str(problems[0]) == (
        "rules[1] (match: model.layers.*.self_attn.q_proj), module model.layers.0.self_attn.q_proj: "
        "the rule states head_dim 128, but the model's head_dim is 64 (it views its 256 output "
        "features as 4 heads of 64). Fix: set head_dim: 64 in the rule, or infer the plan again "
        "for this model (`tpplan infer`)."
    )


def test_a_file_of_that_name_wins_over_the_shipped_plan(tmp_path: Path, monkeypatch) -> None:
    own = tpplan.Plan(rules=[tpplan.Rule(match="x", style="replicate", why="mine")])
    (tmp_path / "llama").write_text(own.to_yaml())
    monkeypatch.chdir(tmp_path)
    assert load_plan("llama") == own


def test_an_unknown_plan_name_lists_the_shipped_ones() -> None:
    with pytest.raises(tpplan.PlanFileError) as e:
        load_plan("lama")
    assert str(e.value) == (
        "lama: no such file, and no shipped plan of that name; did you mean 'llama'? "
        f"shipped plans: {', '.join(sorted(shipped_plans()))}."
    )


def test_infer_names_the_shipped_plan_for_the_model_class(capsys) -> None:
    assert cli.main(["infer", "llama", "--set", "num_hidden_layers=1"]) == 0
    err = capsys.readouterr().err
    assert "tpplan ships a reviewed plan for LlamaForCausalLM, 'llama'" in err
    assert 'apply_plan(model, mesh, plan="llama")' in err


def test_infer_is_silent_when_no_plan_is_shipped(capsys) -> None:
    assert cli.main(["infer", "mpt", "--set", "n_layers=1"]) == 0
    assert "ships" not in capsys.readouterr().err


@pytest.mark.slow  # builds a wheel; pip fetches hatchling into an isolated build environment
def test_the_wheel_carries_the_shipped_plans(tmp_path: Path) -> None:
    """An installed tpplan finds its plans as tpplan/plans (see tpplan/plan/shipped.py), and
    every module of every subpackage."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path)],
        check=True, timeout=600, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("tpplan-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"tpplan/plans/{p.relative_to(ROOT / 'plans')}" for p in PLANS} <= names
    assert "tpplan/plans/schema.json" in names
    # every subpackage, found by the build backend, not a hand-kept list
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tpplan").rglob("*.py")}
    assert sources <= names, f"the wheel lacks {sorted(sources - names)}"
