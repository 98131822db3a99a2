"""Infer a plan for a small Llama, apply it on 2 CPU ranks, and compare with the unsharded
model. Run it as a plain script: `python examples/infer_and_apply.py`. tpplan.launch starts
the ranks through torch's own launcher; under torchrun, call `main()` directly instead.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import tpplan


def build() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    return LlamaForCausalLM(config).eval()


def main() -> float:
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    reference, model = build(), build()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    tpplan.apply_plan(model, mesh["tp"], check_inputs=True)  # no plan given: inferred
    with torch.no_grad():
        error = (model(tokens).logits - reference(tokens).logits).abs().max().item()
    if torch.distributed.get_rank() == 0:
        print(tpplan.infer_plan(build(), tp_size=mesh.size()).to_yaml())
        print(f"max abs difference from the unsharded model: {error:.2e}")
    return error


if __name__ == "__main__":
    errors = tpplan.launch(main, nprocs=2)
    if max(errors) > 1e-4:
        raise SystemExit(f"the sharded model differs from the unsharded one by {max(errors):.2e}")
