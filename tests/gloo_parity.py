"""Run by torchrun from test_processes.py: real gloo ranks apply a plan and compare the
forward output and gradients with the unsharded model on every rank. With no argument, the
tiny Llama and its hand-written plan; with `written`, support/tables.py's model whose embedding
writes a split parameter over rows, with its inferred plan (each rank finds where its
shares of the vocab and of the parameter start on its own, without a collective); with
`uneven`, a tied GPT-2 whose vocab of 257 no tp size divides, with its inferred plan (each
rank's share of the rows as DTensor holds it, the head's output padded to gather). With
`pieces`, test_region_pieces.py's attention whose fused q|k|v of unequal pieces opens a
DTensor region (held in its pieces until cut, with a norm over all query heads), inferred.
With `heads H K`, a tiny Qwen2 of H query and K key/value heads whose heads tp does not
divide (`heads H K gpt2`: a GPT-2 of H heads, q|k|v fused in equal pieces; `heads H K
phi3`: a Phi-3, q|k|v fused in unequal pieces; `heads H 1 falcon`: a multi-query Falcon),
split unevenly by its inferred plan (support/uneven_heads.py), a greedy generate too,
and its whole checkpoint (the original weights) loaded again by `tpplan.from_pretrained`.
With `refuse`, each rank first has a plan refused that only the dry run finds unrunnable (its
fake ranks beside this real group, at tp 2 and at a tp of 4 larger than the world), then
applies the good plan."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from support.models import tiny_llama, token_batch
from support.ranks import finish
from support.tables import table_ids, writing_table_model

import tpplan

TOL = 1e-5  # as in test_apply.py


def _refuse(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    from support.unrunnable import unrunnable

    bad = unrunnable("prepare_in_the_wrong_place")
    for problems in (tpplan.check_plan(bad, model, tp_size=4), _refusal(model, mesh, bad)):
        if [p.kind for p in problems] != ["dry_run"]:
            raise SystemExit(f"expected one dry_run problem, got {problems}")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise SystemExit("the refused plan touched the model")
    if (dist.get_backend(), dist.get_world_size()) != ("gloo", 2):
        raise SystemExit("the dry run changed the default process group")
    print(f"rank {dist.get_rank()} refused", flush=True)


def _refusal(model: torch.nn.Module, mesh: DeviceMesh, plan: tpplan.Plan) -> list[tpplan.Problem]:
    try:
        tpplan.apply_plan(model, mesh, plan)
    except tpplan.PlanProblemsError as e:
        return e.problems
    return []


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    if sys.argv[1:] == ["written"]:
        ref, model, x = (
            writing_table_model(),
            writing_table_model(),
            table_ids(),
        )  # seeded: the same on every rank
        plan = tpplan.infer_plan(model, tp_size=world)
        assert any(getattr(r, "written", None) for r in plan.rules), plan.to_yaml()
        tpplan.apply_plan(model, mesh["tp"], plan)
        want, got = ref(x), model(x)
    elif sys.argv[1:] == ["pieces"]:
        from support.models import seeded
        from test_region_pieces import _Model

        ref, model = (
            seeded(_Model, cut="slices", norm=True),
            seeded(_Model, cut="slices", norm=True),
        )
        x = token_batch(64)
        plan = tpplan.infer_plan(model, tp_size=world, example_inputs=x)
        assert [r.match for r in plan.regions] == ["attn"], plan.to_yaml()
        tpplan.apply_plan(model, mesh["tp"], plan)
        assert model.attn.__dict__["_tpplan_region"].startswith("DTensor"), "not on DTensors"
        want, got = ref(x), model(x)
    elif sys.argv[1:] == ["uneven"]:
        from test_uneven_vocab import VOCAB, _gpt2, _ids

        ref, model, x = _gpt2(), _gpt2(), _ids()  # seeded alike
        plan = tpplan.infer_plan(model, tp_size=world, example_inputs=x)
        assert model.lm_head.weight is model.transformer.wte.weight
        tpplan.apply_plan(model, mesh["tp"], plan)
        rows = model.transformer.wte.weight.to_local().shape[0]
        step = -(-VOCAB // world)
        assert rows == min(step, VOCAB - rank * step), rows
        want, got = ref(x).logits, model(x).logits
    elif sys.argv[1:2] == ["heads"]:
        from support.uneven_heads import falcon, gpt2, phi3, qwen2

        heads, kv = int(sys.argv[2]), int(sys.argv[3])
        build = {"gpt2": gpt2, "phi3": phi3, "falcon": falcon}.get(
            sys.argv[4] if sys.argv[4:] else "", qwen2
        )
        ref, model, x = build(heads, kv), build(heads, kv), token_batch(64)  # seeded alike
        # inferred on every rank, as a user's script does
        plan = tpplan.infer_plan(model, tp_size=world, example_inputs=x)
        if not any(r.uneven_group() is not None for r in plan.rules):
            finish(f"rank {rank}: the inferred plan does not split the heads unevenly")
        tpplan.apply_plan(model, mesh["tp"], plan)
        want, got = ref(x).logits, model(x).logits
        # a cached decode: each rank's cache holds its own key/value heads
        same = ref.generate(x, max_new_tokens=4, do_sample=False)
        mine = model.generate(x, max_new_tokens=4, do_sample=False)
        if not torch.equal(same, mine):
            finish(f"rank {rank}: greedy generate differs")
        # saved whole, the checkpoint is the original model's; loaded again at this tp by
        # from_pretrained (its plan inferred anew), the logits are the original's
        import tempfile

        folder = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(folder, src=0)
        tpplan.save_checkpoint(model, folder[0], sharded=False)
        dist.barrier()
        again = tpplan.from_pretrained(folder[0], mesh["tp"])
        with torch.no_grad():
            if (again(x).logits - ref(x).logits).abs().max() > TOL:
                finish(f"rank {rank}: the model loaded from its whole checkpoint differs")
        saved = {k: v for k, v in ref.state_dict().items()}
        from safetensors.torch import load_file

        whole = load_file(str(Path(folder[0]) / "model.safetensors"))
        if any(not torch.equal(whole[k], saved[k]) for k in whole):
            finish(f"rank {rank}: the whole checkpoint is not the original weights")
    else:
        ref, model, x = tiny_llama(), tiny_llama(), token_batch()  # seeded alike
        if sys.argv[1:] == ["refuse"]:
            _refuse(model, mesh["tp"])
        tpplan.apply_plan(model, mesh["tp"], Path(__file__).parent / "plans" / "llama.yaml")
        want, got = ref(x).logits, model(x).logits
    want.square().mean().backward()
    got.square().mean().backward()
    errors = {"logits": (got - want).abs().max().item()}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=False):
        g = p.grad.full_tensor() if isinstance(p.grad, torch.distributed.tensor.DTensor) else p.grad
        errors[name] = (g - q.grad).abs().max().item()
    worst = max(errors, key=errors.__getitem__)
    sharded = sum(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    print(
        f"rank {rank}/{world} worst {worst} {errors[worst]:.2e} sharded params {sharded}",
        flush=True,
    )
    bad = errors[worst] > TOL or sharded == 0
    finish(
        f"rank {rank}: {worst} differs by {errors[worst]:.2e} (sharded params: {sharded})"
        if bad
        else None
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
