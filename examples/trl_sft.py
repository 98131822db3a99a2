"""Fine-tune a small Llama split over 2 CPU ranks with TRL's SFTTrainer, as its docs write it,
and compare its losses with the unsharded model's trained by the same SFTTrainer.

Run it under torchrun: `torchrun --nproc-per-node 2 examples/trl_sft.py` (needs `pip install
trl`, or tpplan's `test` extra); it exits non-zero when a loss differs from the unsharded
model's by more than TOL.

The one tensor-parallel line is `tpplan.apply_plan(model, mesh)`: SFTTrainer is transformers'
Trainer underneath, which reads from the sharded model that it is tensor-parallel (no DDP over
the tp ranks, the same batches on both). The model and the tokenizer are built in memory (no
download); the dataset is already tokenized, one of the forms SFTTrainer takes.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import tpplan

VOCAB, SEQ, BATCH, STEPS = 128, 16, 4, 6  # BATCH: the global batch of one micro-step
TOL = 1e-4  # fp32; the sharded matmuls sum in another order (~1e-6 over 6 steps)


def tokenizer() -> PreTrainedTokenizerFast:
    """Words t0 ... t127, one token each (t0 pads)."""
    inner = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="t0", eos_token="t1")


def dataset() -> Dataset:
    """Counting sequences (start, start + step, ...) mod VOCAB, tokenized."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (64, 1), generator=g)
    step = torch.randint(1, 4, (64, 1), generator=g)
    return Dataset.from_dict({"input_ids": ((start + step * torch.arange(SEQ)) % VOCAB).tolist()})


def build() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    return LlamaForCausalLM(config)


def train(model: LlamaForCausalLM, per_device: int, output_dir: str) -> list[float]:
    args = SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=3e-3,
        warmup_steps=2,
        max_grad_norm=0.5,  # gradient norms here are 1-3: every step clips
        max_length=SEQ,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset(), processing_class=tokenizer()
    )
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main() -> float:
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))
    out = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(out)  # one folder for every rank
    want = train(build(), BATCH // mesh.size(), f"{out[0]}/unsharded")  # DDP over the ranks
    model = tpplan.apply_plan(build(), mesh)  # the one line: shard over every rank
    got = train(model, BATCH, f"{out[0]}/sharded")  # one tp group: the whole batch
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    if dist.get_rank() == 0:
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
