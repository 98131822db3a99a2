"""2-D parallelism on 4 CPU ranks: FSDP over a "dp" axis of 2, tensor parallelism over a "tp"
axis of 2, trained a few steps and compared with the unsharded model trained on whole batches.

Run it as a plain script: `python examples/fsdp_tp.py`; it exits non-zero if a loss or a
trained parameter differs from the unsharded model's by more than TOL. tpplan.launch starts
the ranks through torch's own launcher; under torchrun (`torchrun --nproc-per-node 4 ...`),
call `main()` directly instead.

The mesh is (dp=2, tp=2): ranks 0,1 form one tp group and ranks 2,3 the other.
`tpplan.parallelize(model, mesh, plan)` splits the layers of the plan over "tp", then wraps
each block with FSDP2's fully_shard over "dp", the layout torchtitan uses. The data follows
the mesh: the sampler splits each batch over the dp axis only, so the two ranks of one tp
group read the same half and the two tp groups different halves. FSDP averages the gradients
of the two halves, which is the gradient of the mean loss over the whole batch: what the
unsharded model computes.

torch warns on the way that FSDP's root module returned a view (an in-place op on the logits
would skip a hook; nothing here does one), and that gathering a parameter split over both axes
takes two all-gathers (the comparison at the end does it once per parameter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

import tpplan

VOCAB, BATCH, STEPS = 128, 8, 3
# fp32; FSDP reduces gradients and TP sums matmuls in another order than one process does,
# which moves losses and weights by ~1e-7 over three steps. 1e-5 leaves room for that; both dp
# ranks reading the same half instead of one half each moves them by ~5e-2. Plain SGD keeps
# the weights comparable: its step is linear in the gradient. Adam's divides by the gradient's
# own scale and turns rounding-level differences in near-zero gradients into lr-sized steps
# (train_loop.py compares AdamW's losses, with a tolerance to match).
TOL = 1e-5


def build() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    return LlamaForCausalLM(config)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)  # the same data on every rank
    return TensorDataset(torch.randint(0, VOCAB, (BATCH * STEPS, 16), generator=g))


def step(
    model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, tokens: torch.Tensor
) -> torch.Tensor:
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def main() -> float:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    reference, model = build(), build()

    # The unsharded model on whole batches of BATCH sequences.
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    want = [
        step(reference, optimizer, tokens).item()
        for (tokens,) in DataLoader(dataset(), batch_size=BATCH)
    ]

    tpplan.parallelize(model, mesh, check_inputs=True)  # the plan inferred; a path works too
    # Each dp rank gets its half of every batch; both tp ranks of a dp rank the same half.
    data = dataset()
    sampler = DistributedSampler(
        data, num_replicas=mesh["dp"].size(), rank=mesh["dp"].get_local_rank(), shuffle=False
    )
    loader = DataLoader(data, batch_size=BATCH // mesh["dp"].size(), sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    got = []
    for (tokens,) in loader:
        loss = step(model, optimizer, tokens)
        # this rank's loss is its half's; the whole batch's is the mean over the dp axis
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        got.append(loss.item())

    loss_error = max(abs(a - b) for a, b in zip(got, want, strict=True))
    weight_error, where = 0.0, ""
    for (name, p), (_, r) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        err = (p.full_tensor() - r).abs().max().item()  # every parameter is a DTensor now
        if err > weight_error:
            weight_error, where = err, name
    if dist.get_rank() == 0:
        q = model.model.layers[0].self_attn.q_proj.weight
        norm = model.model.layers[0].input_layernorm.weight
        print(
            f"q_proj weight {tuple(q.shape)}: {q.placements} -> {tuple(q.to_local().shape)} per rank"
        )
        print(
            f"input_layernorm weight {tuple(norm.shape)}: {norm.placements} -> {tuple(norm.to_local().shape)} per rank"
        )
        print("step  2-D (dp, tp)  unsharded")
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            print(f"{i:>4}  {a:.6f}      {b:.6f}")
        print(
            f"worst loss difference {loss_error:.1e}, worst weight difference {weight_error:.1e} ({where}); tolerance {TOL:.0e}"
        )
    return max(loss_error, weight_error)


if __name__ == "__main__":
    errors = tpplan.launch(main, nprocs=4)
    if max(errors) > TOL:
        raise SystemExit(f"the 2-D model differs from the unsharded one by {max(errors):.2e}")
