"""Train a small Llama split over 2 CPU ranks with transformers' Trainer, as its docs write it,
and compare its losses with the unsharded model's trained by the same Trainer.

Run it under torchrun: `torchrun --nproc-per-node 2 examples/hf_trainer.py`; it exits non-zero
when a loss differs from the unsharded model's by more than TOL.

The one tensor-parallel line is `tpplan.apply_plan(model, mesh)`. The Trainer reads from the
sharded model that it is tensor-parallel over the 2 ranks: it does not wrap it in DDP, and both
ranks get the same batches (the data is split over the data-parallel axis only, of size 1
here). Gradient accumulation, clipping (transformers clips over the model's meshes), the
learning-rate schedule, checkpoints and `save_model` work as they do unsharded; `save_model`
writes the unsharded model's files. The unsharded reference trains with DDP over the same 2
ranks, each on half of the same global batch.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import tpplan

VOCAB, BATCH, STEPS = 128, 4, 6  # BATCH: the global batch of one micro-step
# fp32 on both sides; the sharded model sums its matmuls in another order, which moves the
# losses by ~1e-6 over 6 AdamW steps. A run that skips the clipping or feeds the two ranks
# different batches is off by 1e-3 or more.
TOL = 1e-4


class Counting(torch.utils.data.Dataset):
    """Counting sequences (start, start + step, ...) mod VOCAB: learnable, so the loss falls."""

    def __init__(self, n: int = 64, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.rows = (start + step * torch.arange(seq)) % VOCAB

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def build() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    return LlamaForCausalLM(config)


def train(model: LlamaForCausalLM, per_device: int, output_dir: str) -> Trainer:
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=3e-3,
        warmup_steps=2,
        lr_scheduler_type="linear",
        max_grad_norm=0.5,  # gradient norms here are 1-3: every step clips
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Counting())
    trainer.train()
    return trainer


def losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main() -> float:
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))
    world = mesh.size()
    out = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(out)  # one folder for every rank
    want = losses(train(build(), BATCH // world, f"{out[0]}/unsharded"))  # DDP

    model = tpplan.apply_plan(build(), mesh)  # the one line: shard over every rank
    trainer = train(model, BATCH, f"{out[0]}/sharded")  # one tp group: the whole batch
    got = losses(trainer)
    trainer.save_model(f"{out[0]}/final")  # every rank calls it; rank 0 writes whole tensors

    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    if dist.get_rank() == 0:
        saved = LlamaForCausalLM.from_pretrained(f"{out[0]}/final")  # plain transformers
        print(f"saved model: {sum(p.numel() for p in saved.parameters())} parameters, unsharded")
        print("step  sharded    unsharded  difference")
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            print(f"{step:>4}  {a:.6f}   {b:.6f}   {abs(a - b):.1e}")
        print(f"worst difference {worst:.1e} (tolerance {TOL:.0e})")
    return worst


if __name__ == "__main__":
    worst = main()
    dist.barrier()
    dist.destroy_process_group()
    if worst > TOL:
        raise SystemExit(f"the sharded losses differ from the unsharded ones by {worst:.2e}")
