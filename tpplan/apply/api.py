"""apply_plan: check a plan, then hand it to torch's parallelize_module over a DeviceMesh.

The only module (with checkpoints and launch helpers) that touches torch.distributed.
Everything that can be wrong with the plan is found by check_plan first, so torch is
never left with a half-sharded model because of a bad rule.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..check import complete_plan, splits_nothing
from ..check.run import prove_local_regions
from ..compile.shard import shard_model
from ..errors import MeshError, ModelError, PlanProblemsError
from ..plan.load import load_plan
from ..plan.schema import Plan
from .caches import size_caches_by_keys
from .guard import guard_inputs, wants_guard
from .meta_weights import guard_meta_weights
from .saving import gather_on_save
from .trainers import prepare_for_trainers

__all__ = ["apply_plan", "resolve_plan", "tp_mesh"]


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D tensor-parallel mesh; an N-D mesh must be sliced to its tp axis first."""
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(
            f"expected a torch DeviceMesh, got {type(mesh).__name__}; build one with "
            "torch.distributed.device_mesh.init_device_mesh('cuda' or 'cpu', (tp_size,))."
        )
    if mesh.ndim != 1:
        axes = ", ".join(mesh.mesh_dim_names or [str(i) for i in range(mesh.ndim)])
        raise MeshError(
            f"apply_plan shards over one mesh axis, but this mesh has {mesh.ndim} (axes: {axes}). "
            "Pass the tensor-parallel axis, e.g. apply_plan(model, mesh['tp'])."
        )
    return mesh


def _check_unsharded(model: object) -> None:
    """A model apply_plan can shard: an nn.Module no plan was applied to. Torch itself would
    fail deep inside a second plan over DTensors, naming a rule instead of the model."""
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"apply_plan shards a torch nn.Module, but the model given is "
            f"{'None' if model is None else 'a ' + type(model).__name__}. Fix: pass the model "
            "itself (a function that builds it and returns nothing gives None)."
        )
    split = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if split or getattr(model, "_tpplan_plan", None) is not None:
        how = (
            f"its parameters {', '.join(split[:2])}{', ...' if len(split) > 2 else ''} are DTensors"
            if split
            else "apply_plan ran on it"
        )
        raise ModelError(
            f"this {type(model).__name__} is already sharded ({how}); a plan applies once, "
            "to the unsharded model. Fix: build a fresh model and apply the plan to it (before "
            "FSDP's fully_shard, when there is one)."
        )


def resolve_plan(plan: Plan | str | Path | None, model: nn.Module, *, tp_size: int | None) -> Plan:
    """A Plan from a Plan, a file path, or None (inferred from the model)."""
    if isinstance(plan, Plan):
        return plan
    if plan is None:
        from ..infer import infer_plan

        return infer_plan(model, tp_size=tp_size)
    if isinstance(plan, (str, Path)):
        return load_plan(plan)
    raise TypeError(
        f"plan must be a Plan, a path to a plan file, or None; got {type(plan).__name__}."
    )


def apply_plan(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: Plan | str | Path | None = None,
    *,
    check_inputs: bool | None = None,
    local_shards: bool = True,
) -> nn.Module:
    """Shard `model` in place over the 1-D tensor-parallel `mesh` and return it.

    `plan` is a Plan, a path to a plan file, or None to infer one from the model. The plan is
    checked first; all problems are raised together as PlanProblemsError and the model is
    left untouched. Sizes the plan's rules leave out (head_dim, fused parts, as the shipped
    plans do) are read from the model; `model._tpplan_plan` keeps the plan completed with
    them. Works on models on the meta device (materialize or load weights after)
    as well as on CPU/CUDA. A Hugging Face model's (or peft model's) `save_pretrained`,
    called on every rank, then writes the unsharded model's files (apply/saving.py), and
    transformers' Trainer and TRL's trainers train it without DDP over the tp ranks
    (apply/trainers.py).

    `check_inputs` (default: the TPPLAN_CHECK_INPUTS environment variable) makes every
    forward verify that the model's tensor inputs are identical on all tp ranks, raising
    InputMismatchError naming the input and the ranks that differ.

    `local_shards` (default True): colwise, rowwise and vocab-parallel layers whose sizes the
    plan makes local run on their local shards and call their collectives directly, which
    saves DTensor's dispatch on every call; their parameters stay DTensors either way.
    False runs every split layer on DTensors (the reference path). A DTensor region (attention
    whose local sizes the tracer could not prove) runs on local shards too where a proof on
    fake ranks shows how (compile/local_regions.py); with False, on DTensors.
    """
    _check_unsharded(model)
    mesh = tp_mesh(mesh)
    tp_size = mesh.size()
    plan = resolve_plan(plan, model, tp_size=tp_size)
    # the sizes a plan leaves to the model (a shipped plan's head_dim, fused parts) are read
    # from it here: the plan sharded with, and kept, is the completed one
    plan, problems = complete_plan(plan, model, tp_size=tp_size)
    if problems:
        raise PlanProblemsError(problems, tp_size=tp_size)
    if tp_size > 1 and splits_nothing(plan):
        # not an error (a baseline run may want it), but tp ranks that each run the whole
        # model are a waste nobody asks for by accident; at tp 1 there is nothing to split
        warnings.warn(
            f"the plan splits nothing ({len(plan.rules)} rules, none splitting a module): "
            f"each of the {tp_size} tp ranks holds and runs the whole model.",
            UserWarning,
            stacklevel=2,
        )
    # a region runs on local shards where its proof on fake ranks shows how (else DTensors)
    notes = prove_local_regions(plan, model, tp_size=tp_size) if local_shards else None
    shard_model(model, mesh, plan, local_shards=local_shards, notes=notes)
    gather_on_save(model)  # save_pretrained writes the unsharded model's tensors
    size_caches_by_keys(model)  # a static cache holds each rank's own heads
    prepare_for_trainers(model, mesh)  # transformers' Trainer and TRL train it as it is
    if wants_guard(check_inputs):
        guard_inputs(model, mesh)
    guard_meta_weights(model)  # a forward before load_checkpoint names the fix, not torch
    model._tpplan_plan = plan  # type: ignore[assignment]  # read back by checkpoint helpers
    return model
