"""The real engine: torchrun (and tpplan.launch) start gloo processes that apply a plan,
train a step on a 2-D mesh, run compiled, and check parity with the unsharded model."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.ranks import ENV, torchrun

HERE = Path(__file__).parent


def _ranks(stdout: str, pattern: str) -> list[int]:
    # ranks print concurrently, so their lines may share a line of stdout
    return sorted(int(r) for r in re.findall(rf"rank (\d+){pattern}", stdout))


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_gloo_parity(tp: int) -> None:
    run = torchrun(HERE / "gloo_parity.py", "--standalone", f"--nproc-per-node={tp}")
    assert run.returncode == 0, run.stdout + run.stderr
    assert _ranks(run.stdout, f"/{tp} worst") == list(range(tp)), run.stdout


@pytest.mark.slow
def test_a_plan_is_dry_run_inside_a_real_gloo_group() -> None:
    """check_plan's dry run on gloo ranks: it refuses an unrunnable plan without a collective
    (at tp 2 and at tp 4 beside a world of 2), and the good plan applies after it."""
    run = torchrun(
        HERE / "gloo_parity.py", "--standalone", "--nproc-per-node=2", script_args=("refuse",)
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert _ranks(run.stdout, " refused") == [0, 1], run.stdout
    assert _ranks(run.stdout, "/2 worst") == [0, 1], run.stdout


@pytest.mark.slow
def test_gloo_parity_of_a_table_that_writes_a_split_parameter() -> None:
    run = torchrun(
        HERE / "gloo_parity.py", "--standalone", "--nproc-per-node=4", script_args=("written",)
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert _ranks(run.stdout, "/4 worst") == [0, 1, 2, 3], run.stdout


@pytest.mark.slow
def test_gloo_parity_of_a_region_of_unequal_fused_pieces() -> None:
    """Two real ranks run a DTensor region opened by a fused q|k|v held in its unequal
    pieces (test_region_pieces.py), forward and backward, with DTensor's real collectives."""
    run = torchrun(
        HERE / "gloo_parity.py", "--standalone", "--nproc-per-node=2", script_args=("pieces",)
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert _ranks(run.stdout, "/2 worst") == [0, 1], run.stdout


@pytest.mark.slow
def test_gloo_parity_of_an_uneven_vocab() -> None:
    """Three real ranks hold 86, 86 and 85 of GPT-2's 257 rows, tied to its head: the lookup
    and the head's padded gather on a real process group, forward and backward."""
    run = torchrun(
        HERE / "gloo_parity.py", "--standalone", "--nproc-per-node=3", script_args=("uneven",)
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert _ranks(run.stdout, "/3 worst") == [0, 1, 2], run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "gpt2", "phi3", "fused_gqa"])
def test_tp_and_fsdp_on_a_2x2_mesh_train_like_the_unsharded_model(model: str) -> None:
    """gpt2 and phi3 have fused layers (a 1-D bias and a weight split along dim 0 as
    strided pieces), which FSDP2 must shard along another dim or not at all; fused_gqa's
    q|k|v of unequal pieces computes with a copy of its own rows, which the second step's
    forward must take from the weights the first step changed."""
    run = torchrun(
        HERE / "fsdp_tp_step.py",
        "--standalone",
        "--nproc-per-node=4",
        script_args=() if model == "llama" else (model,),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert _ranks(run.stdout, " worst") == [0, 1, 2, 3], run.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_nodes_on_loopback() -> None:
    """Two torchrun agents (2 nodes x 2 processes) meet by c10d rendezvous on 127.0.0.1."""
    args = [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        "--rdzv-id=tpplan-two-nodes",
        "--local-addr=127.0.0.1",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, str(HERE / "fsdp_tp_step.py")]
    agents = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        for _ in range(2)
    ]
    outputs = [a.communicate(timeout=400)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    assert _ranks("".join(outputs), " worst") == [0, 1, 2, 3], outputs


@pytest.mark.slow
def test_compiled_model_matches() -> None:
    run = torchrun(HERE / "compile_ranks.py", "--standalone", "--nproc-per-node=2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert _ranks(run.stdout, " compiled local shards") == [0, 1], run.stdout
    assert _ranks(run.stdout, " compiled DTensor path") == [0, 1], run.stdout
    assert _ranks(run.stdout, " compiled region") == [0, 1], run.stdout


@pytest.mark.slow
def test_launch_returns_each_ranks_result() -> None:
    from launch_targets import rank_and_size

    from tpplan import launch

    assert launch(rank_and_size, nprocs=2, args=(100,)) == [102, 112]


@pytest.mark.slow
def test_launch_names_the_rank_that_failed() -> None:
    from launch_targets import fail_on_rank

    from tpplan import LaunchError, launch

    with pytest.raises(
        LaunchError, match=r"rank 1 of 2 failed: ValueError: rank 1 was told to fail"
    ):
        launch(fail_on_rank, nprocs=2, args=(1,))


@pytest.mark.slow
def test_a_lora_model_trains_saves_and_merges_on_gloo(tmp_path: Path) -> None:
    """peft's LoRA Llama at tp 2 on real ranks: a training step, the adapter saved unsplit
    and loaded back unsharded, and the merged model, each as the unsharded PEFT model's."""
    run = torchrun(
        HERE / "peft_ranks.py",
        "--standalone",
        "--nproc-per-node=2",
        script_args=(str(tmp_path / "adapter"),),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert _ranks(run.stdout, "/2 worst") == [0, 1], run.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "heads", "kv", "arch"),
    [
        (2, 5, 5, "qwen2"),
        (3, 8, 4, "qwen2"),
        (4, 7, 1, "qwen2"),
        (4, 6, 6, "qwen2"),
        (8, 28, 4, "qwen2"),
        (4, 25, 25, "gpt2"),
        (4, 14, 2, "phi3"),
        (2, 5, 1, "falcon"),
        (8, 71, 1, "falcon"),
    ],
    ids=[
        "tp2-5-heads",
        "tp3-8q-4kv",
        "tp4-7q-1kv",
        "tp4-6-heads",
        "tp8-28q-4kv",
        "tp4-gpt2-25",
        "tp4-phi3-14q-2kv",
        "tp2-falcon-5q-mqa",
        "tp8-falcon-71q-mqa",
    ],
)
def test_gloo_parity_of_heads_split_unevenly(tp: int, heads: int, kv: int, arch: str) -> None:
    """Real ranks infer and apply a plan splitting heads tp does not divide unevenly
        (test_uneven_heads.py), each rank its own head counts as plain numbers: forward,
        backward and a greedy generate match the unsharded model, and the whole checkpoint it
        saves loads again. Simulated ranks cannot run every such case (their per-rank sizes must
        agree on the model's control flow). GPT-2's q|k|v is fused in equal pieces, Phi-3's in
    unequal ones (grouped heads), Falcon's as its query heads and one key and one value head
    viewed `(B, T, self.num_heads + 2, D)` (Falcon-7B's 71 heads at tp 8)."""
    run = torchrun(
        HERE / "gloo_parity.py",
        "--standalone",
        f"--nproc-per-node={tp}",
        script_args=("heads", str(heads), str(kv), *([arch] if arch != "qwen2" else [])),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert _ranks(run.stdout, f"/{tp} worst") == list(range(tp)), run.stdout
