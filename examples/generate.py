"""Greedy `generate` with a small Qwen3 split over 2 CPU ranks: the tokens must be the
unsharded model's, token for token.

Run it as a plain script: `python examples/generate.py`; it exits non-zero if any generated
token differs. tpplan.launch starts the ranks through torch's own launcher; under torchrun
(`torchrun --nproc-per-node 2 ...`), call `main()` directly instead.

The plan is inferred from the model's data flow; apply_plan takes the path of a plan file in
its place (`plan.to_yaml()` is the text of one, for this model, to save and edit).
generate runs the sharded model as it is: attention reshapes with -1 heads, so each rank
keeps its own heads in the KV cache and only the logits are gathered (the plan's last rule).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3Config, Qwen3ForCausalLM

import tpplan

NEW_TOKENS = 12


def build() -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    return Qwen3ForCausalLM(config).eval()


def greedy(model: Qwen3ForCausalLM, prompts: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, prompts.shape[1] :]


def main() -> bool:
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    reference, model = build(), build()
    plan = tpplan.infer_plan(model, tp_size=mesh.size())
    tpplan.apply_plan(model, mesh["tp"], plan, check_inputs=True)
    # Every tp rank must be given the same prompts: seeded from a generator of our own.
    prompts = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    want, got = greedy(reference, prompts), greedy(model, prompts)
    same = torch.equal(got, want)
    if torch.distributed.get_rank() == 0:
        for rule in plan.rules:
            print(f"  {rule.match:<36} {rule.style}")
        q = model.model.layers[0].self_attn.q_proj.weight
        print(f"q_proj weight: {tuple(q.to_local().shape)} on each rank of {tuple(q.shape)}")
        print(f"sharded:   {got.tolist()}")
        print(f"unsharded: {want.tolist()}")
        print(
            f"greedy tokens {'match' if same else 'DIFFER'} ({NEW_TOKENS} new tokens x 2 prompts)"
        )
    return same


if __name__ == "__main__":
    if not all(tpplan.launch(main, nprocs=2)):
        raise SystemExit("the sharded model generated other tokens than the unsharded one")
