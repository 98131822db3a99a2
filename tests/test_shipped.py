"""The plans shipped in plans/: each one validates, is what `tpplan infer` writes today (its
own `model.command`), passes check_plan, and gives the unsharded model's numbers, forward
and backward, on a small model of its family. Shipped plans resolve by name."""

from __future__ import annotations

import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import tpplan
from tpplan import cli
from tpplan._runtime.local import simulated_ranks
from tpplan._runtime.models import build_model, parse_overrides
from tpplan.diagnose.verify import verify_plan
from tpplan.plan import load_plan
from tpplan.plan.shipped import shipped_plans

ROOT = Path(__file__).resolve().parents[1]
PLANS = sorted((ROOT / "plans").rglob("*.yaml"))

# A small model of each plan's family: the config of the command that wrote the plan, with
# these fields on top. The widths a plan names (head_dim, fused parts) stay as they are;
# layers, heads, experts and the vocab shrink.
_LAYERS = {"num_hidden_layers": 2, "vocab_size": 512}
_HEADS_128 = {
    "hidden_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
}
SMALL: dict[str, dict[str, object]] = {
    "llama": {**_LAYERS, **_HEADS_128, "intermediate_size": 256},
    "mistral": {**_LAYERS, **_HEADS_128, "intermediate_size": 256},
    "qwen2": {**_LAYERS, "hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256},
    "qwen3": {**_LAYERS, **_HEADS_128, "intermediate_size": 256},
    # the experts' fused gate|up pieces are the plan's [14336, 14336]: one layer, two experts
    "mixtral": {**_HEADS_128, "num_hidden_layers": 1, "vocab_size": 512, "num_local_experts": 2, "num_experts_per_tok": 1},
    "qwen3_moe": {**_LAYERS, **_HEADS_128, "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 256},
    "gemma2": {**_LAYERS, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256},
    "gemma3": {**_LAYERS, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256},
    # the fused pieces are the plan's, q|k|v [3072] * 3 (its attention is a DTensor region)
    # and gate|up [8192] * 2: one layer
    "phi3": {"num_hidden_layers": 1, "vocab_size": 512, "hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32, "pad_token_id": 0, "eos_token_id": 0},
    "gpt2": {"n_layer": 2, "vocab_size": 512},
    "gpt_neox": {**_LAYERS, "intermediate_size": 256},
    "falcon": {**_LAYERS, "intermediate_size": 256},
    "opt": {**_LAYERS, "ffn_dim": 256},
    "bloom": {"n_layer": 2, "vocab_size": 512},
    "bert": {**_LAYERS, "intermediate_size": 256},
    "t5": {"num_layers": 2, "num_decoder_layers": 2, "vocab_size": 512, "d_ff": 256},
    "deepseek_v3": {
        **_LAYERS, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 256, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    },
}  # fmt: skip

# fp32, two layers at real head widths: sharding sums the same products in another order
# (seen: ~1e-6); a wrong shard or a missing reduction is off by O(0.1).
TOL = 1e-4


def _spec(path: Path) -> tuple[str, dict[str, object]]:
    """MODEL and --set fields of the command a shipped plan records."""
    plan = load_plan(path)
    assert plan.model is not None and plan.model.command, f"{path.name} records no command"
    args = cli._parser().parse_args(shlex.split(plan.model.command)[1:])
    return args.model, parse_overrides(args.overrides)


def test_plans_are_shipped() -> None:
    """The recursive glob finds the library (at least 15 families), every file resolves by
    its name, and every one has a small model here to be tested on."""
    assert len(PLANS) >= 15
    assert {p.stem for p in PLANS} == set(shipped_plans())
    assert {p.stem for p in PLANS} <= set(SMALL), "add a small config for the new plan to SMALL"


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


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_plan_checks_and_matches_the_unsharded_model(path: Path) -> None:
    spec, overrides = _spec(path)
    torch.manual_seed(0)
    model = build_model(spec, {**overrides, **SMALL[path.stem]}, device="cpu")
    plan = load_plan(path)
    assert tpplan.check_plan(plan, model, tp_size=2) == []
    report = verify_plan(model, plan, tp_size=2, backward=True, tol=TOL)
    assert report.ok, f"{path.stem}: worst error {report.worst:.3g} at tp 2"


def test_a_shipped_plan_applies_by_name() -> None:
    torch.manual_seed(0)
    model = build_model("llama", SMALL["llama"], device="cpu")
    with simulated_ranks(2) as mesh:
        tpplan.apply_plan(model, mesh, plan="llama")
        assert model._tpplan_plan == load_plan(ROOT / "plans" / "llama.yaml")  # type: ignore[operator]


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
