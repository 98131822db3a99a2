"""Run by torchrun from test_processes.py: torch.compile (inductor, CPU) of an applied model
runs forward and backward on real gloo ranks and matches the eager unsharded model, on both
execution paths (local shards through tpplan.compile_model, and every layer on DTensors
through torch.compile); on local shards the forward is one graph (no break at the layers'
direct collectives). A model with a region on local shards (BLOOM) compiles too, the region
run eagerly inside it, and so does a fused q|k|v of unequal pieces (its own rows copied
once per change of its weight)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._inductor.compile_fx import compile_fx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from support.models import tiny_llama, token_batch
from support.ranks import finish
from support.shipped import PLANS, generate_config, plan_spec

import tpplan
from tpplan._runtime.models import build_model

# inductor fuses and reorders float math; 1e-4 on fp32 leaves room for that and still
# catches a wrong split (errors of order 1).
TOL = 1e-4


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref = tiny_llama(layers=1)
    x = token_batch()
    want = ref(x).logits
    want.square().mean().backward()
    want_grad = ref.model.layers[0].self_attn.q_proj.weight.grad
    failures = []
    for local in (True, False):
        torch._dynamo.reset()
        model = tiny_llama(layers=1)
        tpplan.apply_plan(
            model, mesh, Path(__file__).parent / "plans" / "llama.yaml", local_shards=local
        )
        graphs: list[torch.fx.GraphModule] = []

        def counting(
            gm: torch.fx.GraphModule, inputs: list[torch.Tensor], graphs: list[Any] = graphs
        ) -> Any:
            graphs.append(gm)
            return compile_fx(gm, inputs)

        # the local path through tpplan.compile_model (its guard filter), the DTensor path
        # through torch.compile itself
        compiled = tpplan.compile_model if local else torch.compile
        got = compiled(model, backend=counting)(x).logits
        got.square().mean().backward()
        err = (got - want).abs().max().item()
        g = model.model.layers[0].self_attn.q_proj.weight.grad
        g = g.full_tensor() if isinstance(g, DTensor) else g
        gerr = (g - want_grad).abs().max().item()
        path = "local shards" if local else "DTensor path"
        print(
            f"rank {dist.get_rank()} compiled {path}: logits {err:.2e} grad {gerr:.2e} "
            f"graphs {len(graphs)}",
            flush=True,
        )
        if max(err, gerr) > TOL:
            failures.append(
                f"{path}: compiled model differs: logits {err:.2e}, q_proj grad {gerr:.2e}"
            )
        if local and len(graphs) != 1:
            failures.append(f"{path}: the forward compiled to {len(graphs)} graphs, not 1")
    failures += _region_model(mesh)
    failures += _unequal_fused(mesh)
    finish("; ".join(failures) or None)


def _region_model(mesh: Any) -> list[str]:
    """BLOOM, whose attention is a region on local shards: tpplan.compile_model runs the
    region eagerly (its mode finds call sites by their frames, which dynamo cannot trace)
    and compiles the rest; forward and a gradient inside the region match."""
    [path] = [p for p in PLANS if p.stem == "bloom"]
    spec, overrides = plan_spec(path)
    torch.manual_seed(0)
    ref = build_model(spec, {**overrides, **generate_config("bloom")}, device="cpu")
    torch.manual_seed(0)
    model = build_model(spec, {**overrides, **generate_config("bloom")}, device="cpu")
    x = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    want = ref(input_ids=x).logits
    want.square().mean().backward()
    torch._dynamo.reset()
    tpplan.apply_plan(model, mesh, path)
    got = tpplan.compile_model(model)(input_ids=x).logits
    got = got.full_tensor() if isinstance(got, DTensor) else got
    got.square().mean().backward()
    qkv = "transformer.h.0.self_attention.query_key_value.weight"
    g = model.get_parameter(qkv).grad
    g = g.full_tensor() if isinstance(g, DTensor) else g
    err = (got - want).abs().max().item()
    gerr = (g - ref.get_parameter(qkv).grad).abs().max().item()
    print(f"rank {dist.get_rank()} compiled region: logits {err:.2e} grad {gerr:.2e}", flush=True)
    if max(err, gerr) > TOL:
        return [f"region model: compiled model differs: logits {err:.2e}, qkv grad {gerr:.2e}"]
    return []


def _unequal_fused(mesh: Any) -> list[str]:
    """A fused q|k|v of unequal pieces (test_fused_cuts.py's), whose layer computes with a
    working copy of its own rows (compile/own_rows.py): compiled, forward and the fused
    weight's gradient match."""
    from test_fused_cuts import _ids, _model

    ref, x = _model("split_chunk"), _ids()
    plan = tpplan.infer_plan(ref, tp_size=mesh.size(), example_inputs=x)
    model = _model("split_chunk")
    want = ref(x)
    want.square().mean().backward()
    torch._dynamo.reset()
    tpplan.apply_plan(model, mesh, plan)
    got = tpplan.compile_model(model)(x)
    got.square().mean().backward()
    g = model.attn.qkv.weight.grad
    g = g.full_tensor() if isinstance(g, DTensor) else g
    err = (got - want).abs().max().item()
    gerr = (g - ref.attn.qkv.weight.grad).abs().max().item()
    print(f"rank {dist.get_rank()} compiled unequal fused: logits {err:.2e} grad {gerr:.2e}")
    if max(err, gerr) > TOL:
        return [f"unequal fused: compiled model differs: logits {err:.2e}, qkv grad {gerr:.2e}"]
    return []


if __name__ == "__main__":
    main()
