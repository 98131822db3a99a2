"""The command line: output and exit codes, each bad input with its one-line message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.models import TINY_LLAMA_CONFIG, TINY_LLAMA_FLAGS
from support.plans import LLAMA_PLAN
from support.unrunnable import CASES

from tpplan import Plan
from tpplan.cli import main
from tpplan.plan import plan_json_schema

ROOT = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_schema_prints_the_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "schema")
    assert code == 0 and json.loads(out) == plan_json_schema()


def test_check_a_sound_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "check", str(LLAMA_PLAN), "llama", "--tp", "4", *TINY_LLAMA_FLAGS)
    assert code == 0 and "sound at tp 4 (9 rules)" in out


def test_check_fails_with_every_problem(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "check", str(LLAMA_PLAN), "llama", "--tp", "8", *TINY_LLAMA_FLAGS)
    assert code == 1
    assert "problem: rules[2] (match: model.layers.*.self_attn.k_proj)" in out
    assert "4 heads (of head_dim 8) do not split evenly over tp size 8" in out
    # and v_proj; q_proj's 8 heads divide by 8. Sharing the 4 key/value heads would serve
    assert "problem: rules[3] (match: model.layers.*.self_attn.v_proj)" in out
    assert out.count("add replicate_heads: true to the rule") == 2
    assert out.strip().endswith("2 problem(s) at tp 8.")


@pytest.mark.parametrize("case", list(CASES))
def test_check_fails_a_plan_that_cannot_run(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"{case}.yaml"
    path.write_text(CASES[case].edit)
    code, out, _ = run(capsys, "check", str(path), "llama", "--tp", "2", *TINY_LLAMA_FLAGS)
    want = CASES[case]
    assert code == 1 and out.strip().endswith("1 problem(s) at tp 2.")
    assert f"problem: {want.rule}" in out
    assert (want.static or want.ran) in out and want.fix in out


def test_check_says_when_a_plan_splits_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("tpplan: 7\nrules: []\n")
    code, out, _ = run(capsys, "check", str(path), "llama", "--tp", "2", *TINY_LLAMA_FLAGS)
    assert code == 0
    assert out == (
        f"{path}: sound at tp 2, but it splits nothing (0 rules, none splitting a module): "
        "every rank would hold and run the whole model.\n"
    )


def test_check_refuses_a_plan_written_for_another_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """apply_plan refuses a plan whose fingerprint is another model's, so check does too: a
    plan that passes check in CI must apply."""
    text = LLAMA_PLAN.read_text().replace(
        "  class: LlamaForCausalLM\n", "  class: LlamaForCausalLM\n  fingerprint: sha256:0000\n"
    )
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    code, out, _ = run(capsys, "check", str(plan), "llama", "--tp", "2", *TINY_LLAMA_FLAGS)
    assert code == 1 and "problem: model: the plan was written for another model" in out


def test_malformed_plan_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tpplan: 1\nrules: [\n")
    code, out, err = run(capsys, "check", str(bad), "llama", "--tp", "2")
    assert code == 2 and out == ""
    assert err.startswith(f"tpplan: error: {bad}: line 3, column 1: malformed YAML")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("model", "extra", "message"),
    [
        ("lama", [], "'lama' is not a model tpplan can build. Did you mean 'llama'?"),
        (
            "llama",
            ["--set", "num_layers=2"],
            "--set num_layers: LlamaConfig has no field 'num_layers'.",
        ),
        ("llama", ["--set", "oops"], "--set takes key=value, got 'oops'"),
        ("nosuchpkg.mod:build", [], "cannot import 'nosuchpkg.mod'"),
        (
            "someone/some-model",
            [],
            "'someone/some-model' is not in the local Hugging Face cache (",
        ),
    ],
)
def test_bad_model_specs(
    capsys: pytest.CaptureFixture[str], model: str, extra: list[str], message: str
) -> None:
    code, _, err = run(capsys, "check", str(LLAMA_PLAN), model, "--tp", "2", *extra)
    assert code == 2 and message in err and "Traceback" not in err


def test_check_at_a_tp_size_shared_heads_neither_split_over_nor_share(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """tp 3 and 4 kv heads: the shipped plan's attribute fix divides by the ranks sharing
    each head, which do not exist here; the heads' own problem says so (it once ended in
    ZeroDivisionError)."""
    code, out, err = run(capsys, "check", "llama", "llama", "--tp", "3", *TINY_LLAMA_FLAGS)
    assert code == 1 and err == ""
    assert (
        "problem: rules[2] (match: model.layers.*.self_attn.k_proj), module "
        "model.layers.*.self_attn.k_proj: 4 heads (of head_dim 8) do not split evenly over tp "
        "size 3; every rank must hold whole heads. Fix: use a tp size among 1, 2, 4 or a "
        "multiple of 4 dividing the query heads, or keep this module replicated; or write a "
        "plan for this tp (`tpplan infer MODEL --tp 3`), which splits the heads unevenly, "
        "whole heads per rank, where the model allows it." in out
    )
    assert out.endswith("llama: 6 problem(s) at tp 3.\n")


def test_check_dry_runs_a_fused_layer_gathered_after_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A fused colwise output gathered after its layer: torch's own gather of its pieces
    reads values on fake tensors, tpplan's does not, so check runs it to the end and says
    the plan is sound, with no note of a forward it could not run."""
    from support.fake_limits import FUSED_PLAN

    plan = tmp_path / "fused.yaml"
    plan.write_text(FUSED_PLAN.to_yaml())
    code, out, _ = run(capsys, "check", str(plan), "support.fake_limits:fused", "--tp", "2")
    assert (code, out) == (0, f"{plan}: sound at tp 2 (1 rule).\n")


def test_a_callable_model_spec(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "check", str(LLAMA_PLAN), "support.models:tiny_llama", "--tp", "2")
    assert code == 0 and "sound" in out


def test_a_callable_model_spec_from_the_current_folder(tmp_path: Path) -> None:
    """`tpplan infer mypackage.model:build` from a project's root imports its package without
    installing it, as `python -m` would (a console script does not look in the folder)."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("")
    (tmp_path / "mine" / "net.py").write_text(
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb, self.up, self.down = nn.Embedding(64, 8), nn.Linear(8, 32), nn.Linear(32, 8)\n"
        "    def forward(self, input_ids):\n"
        "        return self.down(self.up(self.emb(input_ids)).relu())\n"
        "def build():\n"
        "    return Net()\n"
    )
    tpplan_bin = Path(sys.executable).parent / "tpplan"
    run_ = subprocess.run(
        [str(tpplan_bin), "infer", "mine.net:build", "--tp", "2"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert run_.returncode == 0, run_.stderr
    assert "style: colwise" in run_.stdout and "style: rowwise" in run_.stdout


@pytest.mark.parametrize("command", ["infer", "check", "diff", "verify", "stats", "schema"])
def test_help_ends_with_an_example(command: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tpplan.cli", command, "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.rstrip().splitlines()[-2].strip() == "example:"


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tpplan: 99\n")
    run_ = subprocess.run(
        [sys.executable, "-m", "tpplan.cli", "--debug", "check", str(bad), "llama", "--tp", "2"],
        capture_output=True,
        text=True,
    )
    assert run_.returncode != 0 and "Traceback" in run_.stderr


def test_diff_of_a_plan_with_itself_is_empty(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "diff", str(LLAMA_PLAN), str(LLAMA_PLAN))
    assert code == 0 and "shard the same way" in out


def test_diff_names_each_changed_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    changed = tmp_path / "changed.yaml"
    changed.write_text(
        LLAMA_PLAN.read_text().replace(
            "  - match: lm_head\n    style: colwise\n    output: replicate\n",
            "  - match: lm_head\n    style: replicate\n",
        )
    )
    code, out, _ = run(capsys, "diff", str(LLAMA_PLAN), str(changed))
    assert code == 1
    assert out.splitlines() == ["~ lm_head: colwise (output=replicate) -> replicate"]


def test_diff_of_a_family_plan_against_its_model_reads_the_sizes_it_leaves_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped llama plan leaves head_dim to the model, the plan inferred for a Llama of
    heads of 64 states it: the same sharding. A head_dim stated wrong is a change."""
    small = ["--tp", "2", "--set", "num_hidden_layers=1", "--set", "hidden_size=256"]
    small += ["--set", "num_attention_heads=4", "--set", "num_key_value_heads=2"]
    small += ["--set", "head_dim=64", "--set", "intermediate_size=128", "--set", "vocab_size=512"]
    shipped = ROOT / "plans" / "llama.yaml"
    code, out, _ = run(capsys, "diff", str(shipped), "llama", *small)
    assert code == 0 and "shard the same way" in out, out
    wrong = tmp_path / "wrong.yaml"
    text = shipped.read_text()
    wrong.write_text(
        text.replace(
            "o_proj\n    style: rowwise\n", "o_proj\n    style: rowwise\n    head_dim: 128\n"
        )
    )
    code, out, _ = run(capsys, "diff", str(wrong), "llama", *small)
    assert code == 1
    assert out.splitlines() == [
        "~ model.layers.0.self_attn.o_proj: rowwise (head_dim=128) -> rowwise"
    ]


def test_diff_against_a_model_compares_module_by_module(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two patterns that reach the same modules are no change; a dropped rule is."""
    text = LLAMA_PLAN.read_text()
    respelled = tmp_path / "respelled.yaml"
    respelled.write_text(
        text.replace("match: model.layers.*.mlp.up_proj", "match: model.layers.*.mlp.up_*")
    )
    from support.models import tiny_llama

    from tpplan.plan import load_plan
    from tpplan.plan.diff import diff_plans

    names = [n for n, _ in tiny_llama(device="meta").named_modules()]
    assert diff_plans(load_plan(LLAMA_PLAN), load_plan(respelled), module_names=names) == []
    dropped = load_plan(LLAMA_PLAN).model_copy(update={"rules": load_plan(LLAMA_PLAN).rules[:-1]})
    [change] = diff_plans(load_plan(LLAMA_PLAN), dropped, module_names=names)
    assert str(change) == "~ lm_head: colwise (output=replicate) -> replicate"


def test_verify_passes_for_a_sound_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "verify",
        "llama",
        "--plan",
        str(LLAMA_PLAN),
        "--tp",
        "2",
        "--backward",
        *TINY_LLAMA_FLAGS,
    )
    assert code == 0
    assert "tp 2: the sharded model matches the unsharded one" in out
    assert any(
        line.startswith("model.layers.*.self_attn.q_proj.weight") and "grad" in line
        for line in out.splitlines()
    )


def test_verify_fails_for_a_wrong_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rowwise layer fed a replicated input chunks it as if it were sharded: wrong numbers,
    which verify must catch (check_plan accepts it: `input: replicate` is declared)."""
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(
        LLAMA_PLAN.read_text()
        .replace(
            "  - match: lm_head\n    style: colwise\n",
            "  - match: lm_head\n    style: rowwise\n    input: replicate\n    output: partial\n    local_output: true\n",
        )
        .replace("    output: replicate\n    why: output head", "    why: output head")
    )
    code, out, _ = run(
        capsys, "verify", "llama", "--plan", str(wrong), "--tp", "2", *TINY_LLAMA_FLAGS
    )
    assert code == 1 and "DIFFERS" in out and "<-- over tolerance" in out


def test_stats_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "stats",
        "llama",
        "--plan",
        str(LLAMA_PLAN),
        "--tp",
        "2",
        "--backward",
        "--json",
        *TINY_LLAMA_FLAGS,
    )
    stats = json.loads(out)
    assert code == 0
    assert 0.45 < stats["param_fraction"] < 0.55  # everything but norms is halved
    layers = 2
    assert stats["collectives"]["forward"] == {
        "all_reduce": {"count": 2 * layers + 1, "bytes": (2 * layers + 1) * 1 * 128 * 64 * 4},
        "all_gather_into_tensor": {"count": 1, "bytes": 1 * 128 * 64 * 4},
    }
    assert stats["collectives"]["backward"]["all_reduce"]["count"] > 0


def test_stats_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "stats", "llama", "--plan", str(LLAMA_PLAN), "--tp", "4", *TINY_LLAMA_FLAGS
    )
    assert code == 0 and "at tp 4" in out and "forward   all_reduce" in out
    # every split layer of a Llama runs on its local shards (none left on DTensors)
    assert (
        "split layers on local shards: model.embed_tokens, model.layers.*.self_attn.q_proj" in out
    )
    assert "on DTensors" not in out


def test_stats_name_the_regions_that_run_on_local_shards(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """BLOOM's attention is a DTensor region in its plan; its proof lets it run on local
    shards, its layers with it, and stats says so (a region kept on DTensors is named with
    its reason: tests/test_local_regions.py)."""
    code, out, _ = run(capsys, "stats", "bloom", "--tp", "2", "--set", "n_layer=1")
    assert code == 0
    assert "regions on local shards: transformer.h.0.self_attention\n" in out
    local = next(ln for ln in out.splitlines() if ln.startswith("split layers on local shards:"))
    assert "transformer.h.0.self_attention.dense" in local
    assert "on DTensors:" not in out


def test_infer_prints_a_plan_that_reads_back(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's first command: a plan for a model built in, no network."""
    from tpplan import Plan

    code, out, _ = run(capsys, "infer", "llama", "--tp", "2", *TINY_LLAMA_FLAGS)
    plan = Plan.from_yaml(out)
    styles = {r.match: r.style for r in plan.rules}
    assert code == 0 and plan.model is not None and plan.model.class_ == "LlamaForCausalLM"
    assert styles["model.layers.*.self_attn.q_proj"] == "colwise"
    assert styles["model.layers.*.mlp.down_proj"] == "rowwise"
    assert all(r.why for r in plan.rules)


def test_infer_records_its_command_and_can_leave_out_the_fingerprint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The plan names the command that wrote it (flags in a fixed order, without -o), so it
    can be rerun to see whether tpplan still infers it; --no-fingerprint makes it portable."""
    code, out, _ = run(
        capsys, "infer", "llama", "--no-fingerprint", "--set", "num_hidden_layers=1", "--tp", "2"
    )
    assert code == 0
    model = Plan.from_yaml(out).model
    assert model is not None and model.fingerprint is None and model.parameters is None
    assert model.command == "tpplan infer llama --tp 2 --set num_hidden_layers=1 --no-fingerprint"


def test_set_keeps_a_field_the_config_class_does_not_declare(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Qwen3-MoE's config declares no head_dim, but its attention reads one when present
    (real checkpoints set 128), so --set passes it on as a config.json would."""
    code, out, _ = run(
        capsys, "infer", "qwen3_moe", "--set", "num_hidden_layers=1", "--set", "head_dim=128"
    )
    assert code == 0
    q = next(r for r in Plan.from_yaml(out).rules if r.match.endswith("q_proj"))
    assert q.head_dim == 128


def test_infer_gpt2_on_meta_shards_its_conv1d_layers(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's walkthrough: GPT-2 at its default size, built on the meta device."""
    from tpplan import Plan

    code, out, _ = run(capsys, "infer", "gpt2", "--tp", "4")
    plan = Plan.from_yaml(out)
    rules = {r.match: r for r in plan.rules}
    assert code == 0
    c_attn = rules["transformer.h.*.attn.c_attn"]
    assert (c_attn.style, c_attn.parts, c_attn.transposed) == ("colwise", [768] * 3, True)
    assert rules["transformer.h.*.mlp.c_proj"].style == "rowwise"
    assert "# its 2304 output features are 3 fused pieces" in out  # why, as a comment


def test_infer_loss_parallel_leaves_the_logits_split(capsys: pytest.CaptureFixture[str]) -> None:
    from tpplan import Plan

    code, out, _ = run(capsys, "infer", "llama", "--loss-parallel", *TINY_LLAMA_FLAGS)
    plan = Plan.from_yaml(out)
    head = next(r for r in plan.rules if r.match == "lm_head")
    assert code == 0 and plan.options.loss_parallel
    assert (head.style, head.output, head.local_output) == ("colwise", None, False)


def test_infer_sequence_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    from tpplan import Plan

    code, out, _ = run(capsys, "infer", "llama", "--sequence-parallel", *TINY_LLAMA_FLAGS)
    plan = Plan.from_yaml(out)
    styles = {r.match: r.style for r in plan.rules}
    assert code == 0 and plan.options.sequence_parallel
    assert styles["model.layers.*.input_layernorm"] == "sequence_parallel"
    assert styles["model.layers.*.self_attn"] == "prepare"


MOE = ["--set", "num_hidden_layers=2", "--set", "hidden_size=64", "--set", "num_experts=8"]
MOE += ["--set", "moe_intermediate_size=32", "--set", "num_experts_per_tok=2"]
MOE += ["--set", "vocab_size=256", "--set", "intermediate_size=128"]


@pytest.mark.parametrize("mode", ["tensor", "expert"])
def test_infer_verify_and_stats_of_experts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    """An experts plan through the whole command line: verify compares the experts module's
    output (inside it each rank computes its own share) and stats runs the grouped matmul on
    the meta device."""
    from tpplan import Plan

    code, out, _ = run(capsys, "infer", "qwen3_moe", "--experts", mode, "--tp", "2", *MOE)
    plan = Plan.from_yaml(out)
    experts = next(r for r in plan.rules if r.match == "model.layers.*.mlp.experts")
    assert code == 0 and (experts.style, experts.mode) == ("experts", mode)
    path = tmp_path / "moe.yaml"
    path.write_text("\n".join(ln for ln in out.splitlines() if "fingerprint:" not in ln) + "\n")
    code, out, _ = run(
        capsys, "verify", "qwen3_moe", "--plan", str(path), "--tp", "2", "--backward", *MOE
    )
    assert code == 0 and "matches the unsharded one" in out
    assert "experts.act_fn" not in out
    code, out, _ = run(capsys, "stats", "qwen3_moe", "--plan", str(path), "--tp", "2", *MOE)
    assert code == 0 and "forward   all_reduce" in out


def test_infer_sequence_parallel_refuses_a_model_it_does_not_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """support/tables.py's model adds the MLP's sequence-split output to a whole tensor in its own
    forward, where no region can hold it: said, not emitted."""
    code, out, err = run(capsys, "infer", "support.tables:TableModel", "--sequence-parallel")
    assert code == 2 and out == ""
    assert "sequence parallel does not fit TableModel" in err
    assert "Infer without sequence parallel" in err and "Traceback" not in err


def test_infer_sequence_parallel_holds_the_stream_where_whole_positions_meet_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """GPT-2 adds whole position embeddings to the token embeddings in its own forward.
    With its lookup split over the vocab (unevenly: 50257 rows) and reduce-scattered over the
    sequence, that add meets the sequence-split stream with whole rows: GPT2Model holds the
    stream as a stream region, and every block's norm runs on each rank's share of the
    sequence. (A stream that starts whole: tests/test_stream.py.)"""
    from tpplan import Plan

    code, out, _ = run(capsys, "infer", "gpt2", "--sequence-parallel", "--set", "n_layer=2")
    plan = Plan.from_yaml(out)
    assert code == 0 and [(r.match, r.stream) for r in plan.regions] == [("transformer", True)]
    rules = {r.match: r for r in plan.rules}
    assert rules["transformer.wte"].uneven and rules["transformer.wte"].output == "shard(1)"
    assert rules["transformer.h.*.ln_1"].style == "sequence_parallel"


def test_infer_writes_json_to_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tpplan import load_plan

    target = tmp_path / "plan.json"
    code, out, err = run(
        capsys, "infer", "llama", "--format", "json", "-o", str(target), *TINY_LLAMA_FLAGS
    )
    assert code == 0 and out == "" and f"wrote {target}" in err
    assert load_plan(target).rules


def test_infer_then_check_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plan.yaml"
    assert run(capsys, "infer", "llama", "--tp", "4", "-o", str(target), *TINY_LLAMA_FLAGS)[0] == 0
    code, out, _ = run(capsys, "check", str(target), "llama", "--tp", "4", *TINY_LLAMA_FLAGS)
    assert code == 0 and "sound at tp 4" in out


def _table(out: str) -> dict[tuple[str, str], float]:
    """verify's table: (module, what) -> max abs error."""
    rows = {}
    for line in out.splitlines()[1:-1]:
        name, what, err = line.split()[:3]
        rows[(name, what)] = float(err)
    return rows


@pytest.mark.slow  # two spawned ranks each import torch and transformers: ~30 s on 2 cores
def test_verify_on_real_gloo_processes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "verify",
        "llama",
        "--plan",
        str(LLAMA_PLAN),
        "--tp",
        "2",
        "--backward",
        *TINY_LLAMA_FLAGS,
    ]
    code, simulated, _ = run(capsys, *argv)
    assert code == 0
    code, out, _ = run(capsys, *argv, "--processes")
    assert code == 0
    assert out.splitlines()[-1].startswith("tp 2: the sharded model matches the unsharded one")
    # the same rows as the simulated ranks give; the weights are other random ones
    assert _table(out).keys() == _table(simulated).keys()
    assert ("model.layers.*.self_attn.q_proj.weight", "grad") in _table(out)
    assert max(_table(out).values()) <= 1e-4


def test_verify_on_processes_refuses_an_unsound_plan_before_starting_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """tp 8 does not divide the 4 key/value heads: the same exit 1 and message as without
    --processes (checked before any rank starts, not a "rank 0 of 8 failed")."""
    argv = ["verify", "llama", "--plan", str(LLAMA_PLAN), "--tp", "8", *TINY_LLAMA_FLAGS]
    want_code, want_out, want_err = run(capsys, *argv)
    code, out, err = run(capsys, *argv, "--processes")
    # the same verdict; the lines before it say where verify would run, which differs
    assert (code, out) == (want_code, want_out)
    assert err.splitlines()[-1] == want_err.splitlines()[-1]
    assert code == 1 and "the plan cannot be applied at tp size 8" in err


# ---- MODEL as a model id in the local Hugging Face cache -------------------------------
@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache of our own, offline; connecting anywhere fails the test."""
    import socket

    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("tpplan tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return cache


def _cache_model(cache: Path, model_id: str, config: dict[str, object]) -> None:
    """The hub cache layout: refs/main names a commit, whose snapshot holds the files."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text(json.dumps(config))


def test_infer_a_model_id_from_the_local_hub_cache(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tpplan import Plan

    _cache_model(hub_cache, "some-org/tiny-llama", TINY_LLAMA_CONFIG)
    code, out, err = run(capsys, "infer", "some-org/tiny-llama", "--tp", "2")
    assert code == 0, err
    plan = Plan.from_yaml(out)
    assert plan.model is not None and plan.model.class_ == "LlamaForCausalLM"
    # the sizes are the cached config's, not llama's defaults
    assert "model.embed_tokens.weight: (128, 64)" in out and "head_dim: 8" in out


def test_a_model_id_not_in_the_cache_says_how_to_get_it(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "infer", "some-org/missing", "--tp", "2")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(
        f"tpplan: error: 'some-org/missing' is not in the local Hugging Face cache ({hub_cache})"
    )
    assert "hf download some-org/missing config.json" in err and "pass a local folder" in err


def test_a_bare_model_id_not_in_the_cache_says_how_to_get_it(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "infer", "bert-base-uncased", "--tp", "2")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(
        f"tpplan: error: 'bert-base-uncased' is not in the local Hugging Face cache ({hub_cache})"
    )
    assert "hf download bert-base-uncased config.json" in err


def test_a_bare_model_id_in_the_cache_is_built(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _cache_model(hub_cache, "tiny-llama", TINY_LLAMA_CONFIG)
    code, out, err = run(capsys, "infer", "tiny-llama", "--tp", "2")
    assert code == 0, err
    assert "model.embed_tokens.weight: (128, 64)" in out


# ---- every user error is one line and exit 2 ------------------------------------------


def _one_line_error(code: int, out: str, err: str, message: str) -> None:
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["infer", "llama", "--tp", "0"],
        ["infer", "llama", "--tp", "-2"],
        ["check", str(LLAMA_PLAN), "llama", "--tp", "0"],
        ["diff", str(LLAMA_PLAN), "llama", "--tp", "-2"],
        ["verify", "llama", "--tp", "0"],
        ["stats", "llama", "--tp", "-2"],
        ["stats", "llama", "--tp", "two"],
    ],
)
def test_a_tp_size_below_1_is_refused_before_any_model_is_built(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run(capsys, *argv, *TINY_LLAMA_FLAGS)
    got = argv[argv.index("--tp") + 1]
    _one_line_error(
        code,
        out,
        err,
        f"tpplan {argv[0]}: error: argument --tp: takes a whole number of at least 1 (the "
        f"number of tensor-parallel ranks), got '{got}' (see tpplan {argv[0]} --help)",
    )


def test_a_missing_argument_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "check", str(LLAMA_PLAN), "llama")
    _one_line_error(
        code, out, err, "tpplan check: error: the following arguments are required: --tp"
    )


@pytest.mark.parametrize(
    ("model", "sets", "message"),
    [
        (
            "llama",
            ["num_hidden_layers=abc"],
            "--set num_hidden_layers='abc': LlamaConfig refuses it (Field 'num_hidden_layers' "
            "expected int, got str (value: 'abc')). Fix: give num_hidden_layers a value of its "
            "type and range, e.g. --set num_hidden_layers=32.",
        ),
        (
            "folder",
            ["num_hidden_layers=2.5"],
            "--set num_hidden_layers=2.5: LlamaConfig refuses it (Field 'num_hidden_layers' "
            "expected int, got float (value: 2.5)). Fix: give num_hidden_layers a value of its "
            "type and range, e.g. --set num_hidden_layers=2.",
        ),
        (
            "llama",
            ["hidden_size=64", "num_attention_heads=7"],
            "--set hidden_size=64 num_attention_heads=7: LlamaConfig refuses them (The hidden "
            "size (64) is not a multiple of the number of attention heads (7)). Fix: choose "
            "values that fit together",
        ),
    ],
    ids=["type-a-word", "folder-a-float", "sizes-that-do-not-fit"],
)
def test_a_set_value_the_config_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, sets: list[str], message: str
) -> None:
    if model == "folder":
        (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
        model = str(tmp_path)
    argv = [arg for pair in sets for arg in ("--set", pair)]
    code, out, err = run(capsys, "infer", model, *argv)
    _one_line_error(code, out, err, f"tpplan: error: {message}")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            b"\x89PNG\r\n\x1a\n\x00\x00",
            "bad.yaml: a binary file, not a YAML or JSON plan (byte 0x89 at line 1, column 1 "
            "is not UTF-8). Fix: check that PLAN names a plan file.",
        ),
        (
            "tpplan: 1\n# reviewed by Ren\xe9e\nrules: []\n".encode("latin-1"),
            "bad.yaml: byte 0xe9 at line 2, column 18 is not UTF-8; plan files are UTF-8 "
            "text. Fix: save the file as UTF-8.",
        ),
    ],
    ids=["binary", "latin-1-comment"],
)
def test_a_plan_file_that_is_not_utf8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes, message: str
) -> None:
    (tmp_path / "bad.yaml").write_bytes(data)
    code, out, err = run(capsys, "check", str(tmp_path / "bad.yaml"), "llama", "--tp", "2")
    _one_line_error(code, out, err, f"tpplan: error: {tmp_path}/{message}")


def test_output_to_a_folder_is_refused_before_inferring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "infer", "llama", "-o", str(tmp_path), *TINY_LLAMA_FLAGS)
    _one_line_error(
        code,
        out,
        err,
        f"tpplan: error: -o {tmp_path} is a folder; -o takes the file to write the plan to, "
        f"e.g. -o {tmp_path / 'plan.yaml'}.",
    )
    assert list(tmp_path.iterdir()) == []


def test_output_into_a_missing_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "plans" / "llama.yaml"
    code, out, err = run(capsys, "infer", "llama", "-o", str(target), *TINY_LLAMA_FLAGS)
    _one_line_error(
        code, out, err, f"tpplan: error: -o {target}: the folder {target.parent} does not exist"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"model_type": "llama",\n',
            "config.json is not valid JSON (line 2, column 1: Expecting property name enclosed "
            "in double quotes). Fix: repair it",
        ),
        (
            '{"hidden_size": 64}',
            "config.json is not a transformers config (Unrecognized model in ",
        ),
    ],
    ids=["not-json", "no-model-type"],
)
def test_a_model_folder_whose_config_is_broken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    (tmp_path / "config.json").write_text(text)
    code, out, err = run(capsys, "infer", str(tmp_path))
    _one_line_error(code, out, err, f"tpplan: error: {tmp_path}/{message}")


@pytest.mark.parametrize("spec", ["./no-such-folder", "/no/such/model", "mine/config.json"])
def test_a_path_that_does_not_exist_gets_no_cache_hint(
    capsys: pytest.CaptureFixture[str], spec: str
) -> None:
    code, out, err = run(capsys, "infer", spec)
    _one_line_error(code, out, err, f"tpplan: error: '{spec}' is no file or folder. MODEL is ")
    assert "hf download" not in err


def test_experts_expert_on_a_model_without_experts_says_it_had_no_effect(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(
        capsys, "infer", "llama", "--experts", "expert", "--tp", "2", *TINY_LLAMA_FLAGS
    )
    assert code == 0 and Plan.from_yaml(out).rules
    assert (
        "note: --experts expert had no effect: LlamaForCausalLM has no mixture-of-experts "
        "layers.\n" in err
    )


def test_experts_expert_on_a_model_with_experts_says_nothing_of_the_kind(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(capsys, "infer", "qwen3_moe", "--experts", "expert", "--tp", "2", *MOE)
    assert code == 0 and "no effect" not in err


def test_infer_traces_on_the_inputs_given(capsys: pytest.CaptureFixture[str]) -> None:
    """A forward of two inputs tpplan cannot make up: `--input` gives them, by position, and
    the plan records the command that gives it again."""
    from tpplan import Plan

    code, out, _ = run(
        capsys, "infer", "support.check:TwoInputs", "--input", "2x4x8", "--input", "1"
    )
    plan = Plan.from_yaml(out)
    assert code == 0 and [(r.match, r.style) for r in plan.rules] == [
        ("mlp.up.linear", "colwise"),
        ("mlp.down.linear", "rowwise"),
    ]
    assert plan.model is not None and plan.model.command is not None
    assert plan.model.command.endswith("--input 2x4x8 --input 1")


@pytest.mark.parametrize(
    ("specs", "said"),
    [
        (
            ["2xq"],
            "--input 2xq: not a shape and dtype tpplan reads. Fix: write the sizes joined by x",
        ),
        (["ids=2x8:int64"], "--input ids=2x8:int64: integer inputs need the bound their values"),
        (["x=2x8", "1"], "--input: some inputs are named and some are not. Fix: give them all"),
    ],
)
def test_infer_names_an_input_it_cannot_read(
    capsys: pytest.CaptureFixture[str], specs: list[str], said: str
) -> None:
    args = [w for spec in specs for w in ("--input", spec)]
    code, out, err = run(capsys, "infer", "support.check:TwoInputs", *args)
    assert code == 2 and out == "" and said in err and "Traceback" not in err
