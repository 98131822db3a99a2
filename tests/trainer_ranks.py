"""Run by torchrun from test_trainers.py: transformers' Trainer and TRL's SFTTrainer train the
tiny Llama tpplan sharded, against the unsharded model trained by the same trainer with DDP
over the same ranks on the same global batch.

`tp DIR` (2 ranks, tp 2) and `dptp DIR` (4 ranks, a (dp 2, tp 2) mesh, FSDP2 over dp): for
each trainer, 6 steps (gradient accumulation 2, clipping on every step, a linear schedule
with warmup) give the unsharded losses; the checkpoint of step 3 resumed (model, optimizer,
scheduler) gives the uninterrupted run's losses; evaluate gives the unsharded eval loss;
predict gives each row of its dataset once, in order, with the unsharded logits; the final
save_model loads into plain transformers with the sharded model's logits. `dptp` also
resumes that checkpoint at tp 4. `tp` then sets up each wrong thing once (DDP over the tp
ranks, a sampler over every rank, a model sharded on fewer ranks) and checks its message;
`dptp` a mesh with tp as its outer axis. Each rank prints one line per check the test counts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).parent))
from support.models import tiny_llama, tiny_tokenizer, token_batch
from support.ranks import finish

import tpplan
from tpplan.apply.trainers import TrainerSetupError

BATCH, STEPS, SEQ = 4, 6, 16  # BATCH: the global batch of one micro-step
# the bar per step; fp32, observed ~1e-6 (the sharded matmuls sum in another order)
TOL = 1e-4


def rows(n: int = 48) -> torch.Tensor:
    """Counting sequences mod 128: learnable, so the loss falls and the steps differ."""
    g = torch.Generator().manual_seed(0)
    start, step = (
        torch.randint(0, 128, (n, 1), generator=g),
        torch.randint(1, 4, (n, 1), generator=g),
    )
    return (start + step * torch.arange(SEQ)) % 128


class Counting(torch.utils.data.Dataset):
    def __init__(self, n: int = 48) -> None:
        self.rows = rows(n)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def trainer(kind: str, model: Any, per_device: int, out: Path, **extra: Any) -> Any:
    common: dict[str, Any] = dict(
        output_dir=str(out), per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=3e-3, warmup_steps=2,
        lr_scheduler_type="linear", max_grad_norm=0.5, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, disable_tqdm=True, bf16=False, seed=0,
    )  # fmt: skip
    common.update(extra)
    if kind == "trainer":
        from transformers import Trainer, TrainingArguments

        data = Counting()
        return Trainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=data,
            eval_dataset=Counting(8),
        )
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tokens = Dataset.from_dict({"input_ids": rows().tolist()})
    return SFTTrainer(
        model=model,
        args=SFTConfig(**common, max_length=SEQ),
        train_dataset=tokens,
        eval_dataset=Dataset.from_dict({"input_ids": rows(8).tolist()}),
        processing_class=tiny_tokenizer(),
    )


def losses(t: Any) -> list[float]:
    return [h["loss"] for h in t.state.log_history if "loss" in h]


def shard(mode: str, *, tp_last: bool = True) -> Any:
    world = dist.get_world_size()
    if mode == "tp":
        return tpplan.apply_plan(tiny_llama(), init_device_mesh("cpu", (world,)))
    names = ("dp", "tp") if tp_last else ("tp", "dp")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names)
    return tpplan.parallelize(tiny_llama(), mesh)


def worst(got: list[float], want: list[float]) -> float:
    if len(got) != len(want):
        return float("inf")
    return max(abs(a - b) for a, b in zip(got, want, strict=True))


def train_and_resume(mode: str, kind: str, out: Path, say: Any) -> None:
    world = dist.get_world_size()
    dp = 1 if mode == "tp" else 2
    ref = trainer(kind, tiny_llama(), BATCH // world, out / "ref")  # DDP, the unsharded model
    ref.train()
    want, want_eval = losses(ref), ref.evaluate()["eval_loss"]

    run = trainer(kind, shard(mode), BATCH // dp, out / "run", save_strategy="steps", save_steps=3)
    run.train()
    got = losses(run)
    say(f"{kind} losses", worst(got, want))
    say(f"{kind} eval", abs(run.evaluate()["eval_loss"] - want_eval))
    say(f"{kind} predict", predict_error(kind, run, ref.model))

    checkpoint = out / "run" / "checkpoint-3"
    again = trainer(kind, shard(mode), BATCH // dp, out / "again")
    again.train(resume_from_checkpoint=str(checkpoint))
    say(f"{kind} resumed", worst(losses(again), got))
    if mode == "dptp" and kind == "trainer":  # the same checkpoint at tp 4 (dp 1)
        wide = tpplan.apply_plan(tiny_llama(), init_device_mesh("cpu", (world,)))
        at4 = trainer(kind, wide, BATCH, out / "at4")
        at4.train(resume_from_checkpoint=str(checkpoint))
        say(f"{kind} resumed at tp {world}", worst(losses(at4), got))

    run.save_model(str(out / "final"))  # every rank; rank 0 writes the unsharded files
    x = token_batch()
    run.model.eval()
    with torch.no_grad():
        logits = run.model(x).logits
    if dist.get_rank() == 0:
        from transformers import LlamaForCausalLM

        with torch.no_grad():
            plain = LlamaForCausalLM.from_pretrained(out / "final")(x).logits
        err = (plain - logits).abs().max().item()
    else:
        err = 0.0
    say(f"{kind} saved model", err)


def predict_error(kind: str, run: Any, unsharded: Any) -> float:
    """How far predict's logits are from the unsharded model's on 7 rows (the last batch short
    at tp 2 and at dp 2 x tp 2); inf unless predict returned those rows once each, in order
    (accelerate gathers over every rank, each tp group's rows tp times)."""
    data = rows(7)
    if kind == "trainer":
        given: Any = Counting(7)
    else:
        from datasets import Dataset

        given = Dataset.from_dict({"input_ids": data.tolist()})
    got = run.predict(given).predictions
    got = torch.as_tensor(got[0] if isinstance(got, tuple) else got)
    unsharded.eval()
    with torch.no_grad():
        want = unsharded(data).logits  # (7, SEQ, vocab), every row on every rank
    if got.shape != want.shape:
        return float("inf")
    return (got - want).abs().max().item()


def expect(what: str, message: str, action: Any, say: Any) -> None:
    """`action` raises TrainerSetupError with `message` in it."""
    try:
        action()
    except TrainerSetupError as e:
        ok = message in str(e)
        say(f"message {what}", 0.0 if ok else float("inf"), str(e) if not ok else "")
        return
    say(f"message {what}", float("inf"), "no error")


def wrong_setups(mode: str, out: Path, say: Any) -> None:
    if mode == "dptp":
        expect(
            "mesh",
            "sharded on one mesh and is trained on another",
            lambda: trainer("trainer", shard(mode, tp_last=False), BATCH // 2, out / "mesh"),
            say,
        )
        return
    model = shard(mode)
    expect(
        "ddp",
        "DistributedDataParallel was asked to wrap a model tpplan sharded",
        lambda: torch.nn.parallel.DistributedDataParallel(model),
        say,
    )
    holder = torch.nn.ModuleDict({"inner": model})
    expect(
        "holder",
        "cannot see that this one is tensor-parallel",
        lambda: trainer("trainer", holder, BATCH, out / "holder"),
        say,
    )
    half = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    expect(
        "fewer ranks",
        "the model was sharded on a mesh of 1 ranks",
        lambda: trainer("trainer", tpplan.apply_plan(tiny_llama(), half["tp"]), BATCH, out / "few"),
        say,
    )

    def every_rank_its_own_batches() -> None:
        from transformers import Trainer

        class SplitOverEveryRank(Trainer):  # what a DistributedSampler of one's own does
            def _get_train_sampler(self, *args: Any) -> Any:
                return torch.utils.data.DistributedSampler(self.train_dataset, shuffle=False)

        t = trainer("trainer", shard(mode), BATCH, out / "sampler")
        t.__class__ = SplitOverEveryRank
        t.train()

    expect(
        "sampler",
        "fed the ranks of one tp group different batches",
        every_rank_its_own_batches,
        say,
    )


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    failures: list[str] = []

    def say(what: str, err: float, detail: str = "") -> None:
        print(f"rank {rank} {what} worst {err:.1e}", flush=True)
        if not err <= TOL:
            failures.append(f"rank {rank}: {what} differs by {err:.2e} {detail}")

    for kind in ("trainer", "sft"):
        train_and_resume(mode, kind, out / kind, say)
    wrong_setups(mode, out, say)
    finish("\n".join(failures) or None)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
