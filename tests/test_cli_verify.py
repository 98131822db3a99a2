"""`tpplan verify` says what it will run and the memory it expects before it starts, tells
each stage as it starts, and suggests shrinking a large model (tpplan/cli/verify.py,
tpplan/diagnose/cost.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.models import TINY_LLAMA_CONFIG, TINY_LLAMA_FLAGS
from support.plans import LLAMA_PLAN

import tpplan.cli.verify
from tpplan._runtime.models import build_model
from tpplan.cli import main
from tpplan.diagnose.cost import verify_cost

# the tiny Llama of the CLI tests, as config fields for build_model
SIZES = {k: v for k, v in TINY_LLAMA_CONFIG.items() if k not in ("model_type", "architectures")}


def verify(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = main(
        ["verify", "llama", "--plan", str(LLAMA_PLAN), "--tp", "2", *TINY_LLAMA_FLAGS, *extra]
    )
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_says_what_it_runs_and_each_stage_before_it_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = verify(capsys, "--backward")
    assert code == 0 and "matches the unsharded one" in out
    lines = err.splitlines()
    assert lines[0].startswith("verify: llama (LlamaForCausalLM), 2 layers (num_hidden_layers), ")
    assert lines[0].endswith("tp 2 on 2 simulated ranks, forward and backward")
    assert lines[1].startswith("verify: expected peak memory about ")
    assert "x 7 copies held at once, activations " in lines[1]
    stages = [line for line in lines[2:] if line.endswith(" ...")]
    assert [s.split(" ")[1] for s in stages] == [
        "reading",
        "building",
        "running",
        "applying",
        "running",
    ]
    assert "warning" not in err


def test_verify_of_a_large_model_suggests_shrinking_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tpplan.cli.verify, "LARGE_BYTES", 0)  # this tiny model counts as large
    code, _, err = verify(capsys)
    assert code == 0
    warning = next(line for line in err.splitlines() if line.startswith("warning:"))
    assert "a large model for verify" in warning and "--set num_hidden_layers=2" in warning
    # said before the model is built with weights
    assert err.index("warning:") < err.index("verify: building llama with random weights")


def test_verify_cost_counts_parameters_copies_and_activations() -> None:
    model = build_model("llama", SIZES)  # meta: nothing allocated
    forward = verify_cost(model, backward=False)
    assert forward.parameters == sum(p.numel() for p in model.parameters())
    assert forward.param_bytes == 4 * forward.parameters  # fp32
    assert (forward.copies, forward.layers, forward.depth_key) == (3, 2, "num_hidden_layers")
    assert forward.activation_bytes is not None and forward.activation_bytes > 0
    assert verify_cost(model, backward=True).copies == 7
    ranks = verify_cost(model, backward=False, processes=2)
    assert ranks.copies == 6 and ranks.activation_bytes == 2 * forward.activation_bytes
    assert forward.peak_bytes == forward.param_bytes * 3 + forward.activation_bytes


def test_verify_of_a_model_that_cannot_be_built_on_meta_runs_without_an_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "on_cpu_only.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb, self.up, self.down = nn.Embedding(64, 8), nn.Linear(8, 32), nn.Linear(32, 8)\n"
        "        self.scale = float(torch.ones(1).item())  # reads a value: fails on meta\n"
        "    def forward(self, input_ids):\n"
        "        return self.down(self.up(self.emb(input_ids)).relu()) * self.scale\n"
        "def build():\n"
        "    return Net()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["verify", "on_cpu_only:build", "--tp", "2"])
    out, err = capsys.readouterr()
    assert code == 0 and "matches the unsharded one" in out
    assert "verify: on_cpu_only:build cannot be built on the meta device" in err
    assert "its memory is not estimated" in err and "expected peak memory" not in err
