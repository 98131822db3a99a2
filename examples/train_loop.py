"""Train a small Llama split over 2 CPU ranks with a plain PyTorch loop (DataLoader, AdamW,
gradient clipping) and print its losses next to the unsharded model's.

Run it as a plain script: `python examples/train_loop.py`; it exits non-zero if a loss differs
from the unsharded model's by more than TOL. tpplan.launch starts the ranks through torch's
own launcher; under torchrun (`torchrun --nproc-per-node 2 ...`), call `main()` directly
instead.

The loop is an ordinary one with two tp-specific lines. Every tp rank must read the same
batches, so the loader shuffles with a generator of its own and does not split the data
between them (no DistributedSampler over the tp ranks). And gradients are clipped with
`tpplan.clip_grad_norm_`: the split layers' parameters are DTensors (key/value heads shared
past their count on a 2-D view of the tp mesh), the replicated ones (norms) plain tensors,
and torch's own clip_grad_norm_ refuses to mix them in one norm. tpplan's takes each mesh's
norm with torch's code and combines them: the norm of the whole, unsplit gradients, the same
as the unsharded model's.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

import tpplan

VOCAB, STEPS = 128, 8
# fp32 on both sides; the sharded model sums its matmuls in another order (each rank its half,
# then an all-reduce), which moves these losses by ~5e-7 over the 8 steps. 1e-4 leaves room for
# that, and for AdamW, whose step divides by the gradient's own scale and so magnifies rounding
# in near-zero gradients. A sharded run that differs in substance, e.g. one that skips the
# clipping, is off by 1e-3 at step 3 and 1e-2 by step 7.
TOL = 1e-4


def build() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    return LlamaForCausalLM(config)


def batches() -> DataLoader:
    # Counting sequences (start, start + step, ...) mod VOCAB: learnable, so the loss falls.
    g = torch.Generator().manual_seed(0)
    start, step = (
        torch.randint(0, VOCAB, (32, 1), generator=g),
        torch.randint(1, 4, (32, 1), generator=g),
    )
    data = (start + step * torch.arange(24)) % VOCAB
    # shuffle with a generator of our own: both tp ranks draw the same order
    return DataLoader(
        TensorDataset(data), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
    )


def train(model: LlamaForCausalLM) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model.train()
    losses = []
    for step, (tokens,) in enumerate(batches()):
        if step == STEPS:
            break
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        tpplan.clip_grad_norm_(model.parameters(), max_norm=1.0)  # norms 1.5-2.5: clips
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> float:
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    want = train(build())
    model = tpplan.apply_plan(build(), mesh["tp"], check_inputs=True)  # the plan inferred
    got = train(model)
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    if torch.distributed.get_rank() == 0:
        print("step  sharded    unsharded  difference")
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            print(f"{step:>4}  {a:.6f}   {b:.6f}   {abs(a - b):.1e}")
        print(f"worst difference {worst:.1e} (tolerance {TOL:.0e})")
    return worst


if __name__ == "__main__":
    errors = tpplan.launch(main, nprocs=2)
    if max(errors) > TOL:
        raise SystemExit(f"the sharded losses differ from the unsharded ones by {max(errors):.2e}")
