"""Split a small Qwen3-MoE's experts two ways on 2 CPU ranks and train it a few steps.

Run it as a plain script: `python examples/moe_experts.py`. For each mode the plan is
inferred from the model's data flow (`infer_plan(model, experts=MODE)`):

- tensor: every expert split like a dense MLP (gate|up by columns, down by rows);
- expert: each rank holds half of the experts whole and computes the tokens routed to them.

Each mode runs three SGD steps and prints the losses next to the unsharded model's; the script
exits non-zero if they differ. tpplan.launch starts the ranks through torch's own launcher;
under torchrun, call `main()` directly instead.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import tpplan

STEPS = 3


def build() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    return Qwen3MoeForCausalLM(config)


def train(model: torch.nn.Module, tokens: torch.Tensor) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> float:
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    want = train(build(), tokens)
    worst = 0.0
    for mode in ("tensor", "expert"):
        model = build()
        plan = tpplan.infer_plan(model, tp_size=mesh.size(), experts=mode)
        tpplan.apply_plan(model, mesh, plan)
        got = train(model, tokens)
        worst = max(worst, *(abs(a - b) for a, b in zip(got, want, strict=True)))
        if torch.distributed.get_rank() == 0:
            (experts,) = [r for r in plan.rules if r.style == "experts"]
            print(f"mode {mode}: shard {experts.shard}")
            print(
                f"  losses {[round(x, 5) for x in got]} (unsharded {[round(x, 5) for x in want]})"
            )
    return worst


if __name__ == "__main__":
    errors = tpplan.launch(main, nprocs=2)
    if max(errors) > 1e-4:
        raise SystemExit(f"the sharded losses differ from the unsharded ones by {max(errors):.2e}")
