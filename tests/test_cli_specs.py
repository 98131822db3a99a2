"""The forms of PLAN and MODEL the README's command-line section lists, through the command
line: a shipped plan by name (`tpplan check llama MODEL`, `--plan llama`) and a model given as
a local folder or its config.json. tests/test_cli.py covers model types, ids in the hub cache
and `package.module:callable`."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tpplan import Plan
from tpplan.cli import main

# A two-layer Llama at the shipped llama plan's widths (head_dim 128): the plan is portable
# across sizes of the family only where the widths it names match.
SHIPPED_LLAMA_SIZES = [
    "--set", "num_hidden_layers=2", "--set", "vocab_size=512", "--set", "hidden_size=512",
    "--set", "num_attention_heads=4", "--set", "num_key_value_heads=2", "--set", "head_dim=128",
    "--set", "intermediate_size=256",
]  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _no_shadowing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file called `llama` in the current folder would win over the shipped plan; run from
    an empty folder so the name can only mean the shipped one."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")


def test_check_a_shipped_plan_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "check", "llama", "llama", "--tp", "2", *SHIPPED_LLAMA_SIZES)
    assert code == 0 and out.startswith("llama: sound at tp 2")


def test_check_a_shipped_plan_by_name_finds_its_problems(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The same plan at tp 8 on a model of 4 query heads: the name resolves and the check
    still runs, naming the layers and the tp sizes that would work. (At tp 4 the plan is
    sound: its 2 key/value heads are each shared by 2 ranks.)"""
    code, out, _ = run(capsys, "check", "llama", "llama", "--tp", "4", *SHIPPED_LLAMA_SIZES)
    assert code == 0 and out.startswith("llama: sound at tp 4")
    code, out, _ = run(capsys, "check", "llama", "llama", "--tp", "8", *SHIPPED_LLAMA_SIZES)
    assert code == 1
    assert "(match: model.layers.*.self_attn.q_proj)" in out
    assert "4 heads (of head_dim 128) do not split evenly over tp size 8" in out
    assert out.strip().endswith("problem(s) at tp 8.")


def test_verify_takes_a_shipped_plan_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "verify", "llama", "--plan", "llama", "--tp", "2", *SHIPPED_LLAMA_SIZES
    )
    assert code == 0
    assert out.splitlines()[-1].startswith("tp 2: the sharded model matches the unsharded one")


def test_an_unknown_plan_name_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "check", "lama", "llama", "--tp", "2")
    assert code == 2 and out == ""
    assert "no shipped plan of that name; did you mean 'llama'?" in err
    assert err.count("\n") == 1


# ---- MODEL as a local folder or config.json ----------------------------------------------
@pytest.fixture
def tiny_llama_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder as `save_pretrained` writes it (config only); reaching the network fails."""
    from transformers import LlamaConfig

    folder = tmp_path / "tiny-llama"
    LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, vocab_size=128,
    ).save_pretrained(folder)  # fmt: skip

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("tpplan tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return folder


@pytest.mark.parametrize("which", ["folder", "config.json"])
def test_infer_a_local_model_folder_or_its_config(
    tiny_llama_folder: Path, capsys: pytest.CaptureFixture[str], which: str
) -> None:
    spec = tiny_llama_folder if which == "folder" else tiny_llama_folder / "config.json"
    code, out, err = run(capsys, "infer", str(spec), "--tp", "2")
    assert code == 0, err
    plan = Plan.from_yaml(out)
    assert plan.model is not None and plan.model.class_ == "LlamaForCausalLM"
    styles = {r.match: r.style for r in plan.rules}
    assert styles["model.layers.*.self_attn.q_proj"] == "colwise"
    # the sizes are the saved config's, not llama's defaults
    assert "model.embed_tokens.weight: (128, 64)" in out and "head_dim: 8" in out


def test_a_folder_without_a_config_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "weights-only"
    empty.mkdir()
    code, out, err = run(capsys, "infer", str(empty), "--tp", "2")
    assert code == 2 and out == ""
    assert f"the folder '{empty}' has no config.json" in err and "Traceback" not in err
