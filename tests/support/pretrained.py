"""Running a `tpplan.from_pretrained` line as a reader would, with a model id in a Hugging Face
cache made here (tpplan never downloads): README's first example and the docs' quickstart."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["run_pretrained_line"]

CHECK = (
    "\nq = model.model.layers[0].self_attn.q_proj.weight"
    "\nprint(type(q).__name__, tuple(q.to_local().shape))\n"
)


def run_pretrained_line(
    script: str, command: str, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """`script` (it loads one model id with `from_pretrained("ID")`) saved under the name
    `command` runs, then run with that torchrun command by this Python's torch, against a
    tiny Llama saved in the cache under that id; it must exit 0. The script is extended to
    print the type and local shape of layer 0's q_proj weight: (32, 64) at tp 2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    [model_id] = re.findall(r'from_pretrained\("([^"]+)"\)', script)
    repo = tmp_path / "hub" / ("models--" + model_id.replace("/", "--"))
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    name = command.split()[-1]
    (tmp_path / name).write_text(script + CHECK)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    run = subprocess.run(
        torchrun + command.split()[1:], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, f"{command}\n{run.stdout}\n{run.stderr}"
    return run
