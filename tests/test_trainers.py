"""transformers' Trainer and TRL's SFTTrainer on a tpplan model (apply/trainers.py): on real
gloo ranks (trainer_ranks.py), and the library code the integration leans on, read here so
that a release that changes it fails a test rather than a training run."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.ranks import torchrun

HERE = Path(__file__).parent


def _checks(stdout: str) -> dict[str, list[int]]:
    """check name -> the ranks that printed it (ranks print concurrently)."""
    found: dict[str, list[int]] = {}
    for rank, what in re.findall(r"rank (\d+) (.+?) worst ", stdout):
        found.setdefault(what, []).append(int(rank))
    return {k: sorted(v) for k, v in found.items()}


TRAINED = [
    f"{kind} {what}"
    for kind in ("trainer", "sft")
    for what in ("losses", "eval", "predict", "resumed", "saved model")
]


@pytest.mark.slow
def test_trainers_at_tp_2_train_like_the_unsharded_model(tmp_path: Path) -> None:
    """Trainer and SFTTrainer at tp 2: 6 steps (gradient accumulation 2, clipping on) within
    1e-4 of the unsharded model's under DDP on the same global batch, evaluate, predict (each
    row once, in order, the unsharded logits), a resume from step 3 equal to the uninterrupted
    run, save_model's files loaded by plain transformers; then each wrong setup raises its message (trainer_ranks.py)."""
    run = torchrun(
        HERE / "trainer_ranks.py",
        "--standalone",
        "--nproc-per-node=2",
        script_args=("tp", str(tmp_path)),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    checks = _checks(run.stdout)
    messages = ["message ddp", "message holder", "message fewer ranks", "message sampler"]
    want = TRAINED + messages
    assert {k: checks.get(k) for k in want} == {k: [0, 1] for k in want}, run.stdout


@pytest.mark.slow
def test_trainers_on_a_dp_tp_mesh_train_like_the_unsharded_model(tmp_path: Path) -> None:
    """The same on a (dp 2, tp 2) mesh with FSDP2 over dp, the checkpoint also resumed at tp 4,
    and a mesh whose tp axis is not the last refused with its message."""
    run = torchrun(
        HERE / "trainer_ranks.py",
        "--standalone",
        "--nproc-per-node=4",
        script_args=("dptp", str(tmp_path)),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    want = [*TRAINED, "trainer resumed at tp 4", "message mesh"]
    checks = _checks(run.stdout)
    assert {k: checks.get(k) for k in want} == {k: [0, 1, 2, 3] for k in want}, run.stdout


def test_the_trainer_code_the_integration_wraps_is_still_there() -> None:
    """apply/trainers.py takes the Trainer's path for a model sharded at load time
    (`is_distributed_loading_by_transformers`), set after `__init__`, wraps the optimizer's
    save and load, hands accelerate the mesh its data loaders read, and gathers predictions
    once per tp group. Each of these is library code without a public promise; this reads it."""
    from accelerate import Accelerator
    from transformers import Trainer

    # the flag keeps every rank in _save (for the gathering save_pretrained) and keeps
    # accelerate from wrapping the model in DDP
    assert "self.is_distributed_loading_by_transformers" in inspect.getsource(Trainer._save)
    train_loop = inspect.getsource(Trainer._prepare_for_training)
    assert "if self.is_distributed_loading_by_transformers:" in train_loop
    assert "evaluation_mode=True" in train_loop
    # the methods wrapped, with the arguments the wrappers pass on
    assert list(inspect.signature(Trainer._save_optimizer_and_scheduler).parameters) == [
        "self",
        "output_dir",
    ]
    assert list(inspect.signature(Trainer._load_optimizer_and_scheduler).parameters) == [
        "self",
        "checkpoint",
    ]
    # accelerate's data loaders split by the mesh `_prepare_device_mesh` returns
    assert "self._prepare_device_mesh()" in inspect.getsource(Accelerator.prepare_data_loader)
    # evaluate and predict gather through the accelerator's gather_for_metrics, looked up
    # again after each loop, which gathers tensors with the accelerator's gather
    loop = inspect.getsource(Trainer.evaluation_loop)
    assert "self.gather_function = self.accelerator.gather_for_metrics" in loop
    assert "data = self.gather(input_data)" in inspect.getsource(Accelerator.gather_for_metrics)
    # the no_sync of gradient accumulation reads the config tpplan sets
    assert "distributed_config.dp_replicate_size" in inspect.getsource(
        Trainer._defer_fsdp_gradient_reduction
    )


def test_a_sharded_hugging_face_model_tells_ddp_no() -> None:
    """DistributedDataParallel reads `_ddp_params_and_buffers_to_ignore` first; a sharded model's
    refuses with the message (here on one simulated group of 2 ranks: no real DDP starts)."""
    from support.models import tiny_llama

    from tpplan._runtime.local import simulated_ranks
    from tpplan.apply.trainers import TrainerSetupError

    with simulated_ranks(2) as mesh:
        from tpplan import apply_plan

        model = apply_plan(tiny_llama(), mesh)
    with pytest.raises(TrainerSetupError, match=r"DistributedDataParallel was asked to wrap"):
        set(model._ddp_params_and_buffers_to_ignore)
    assert model.config.distributed_config.tp_size == 1  # transformers sharded nothing itself


def test_sharding_leaves_the_trainer_unloaded_until_a_script_imports_it() -> None:
    """apply_plan on a Hugging Face model does not import transformers.trainer (~2 s); the
    Trainer is wrapped as it loads, and TRL's SFTTrainer, its subclass, goes through the
    wrapped methods. In a fresh interpreter: this one may have loaded the Trainer already."""
    code = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from support.models import tiny_llama
from tpplan import apply_plan
from tpplan._runtime.local import simulated_ranks
with simulated_ranks(2) as mesh:
    apply_plan(tiny_llama(), mesh)
assert "transformers.trainer" not in sys.modules, "apply_plan imported the Trainer"
from trl import SFTTrainer
from transformers import Trainer
assert Trainer._tpplan_installed and SFTTrainer._tpplan_installed
assert Trainer.__init__.__wrapped__ is not None
"""
    subprocess.run([sys.executable, "-c", code], check=True)
