"""transformers' Trainer (and TRL's trainers, its subclasses) on a model tpplan sharded.

Start at `prepare_for_trainers`, which apply_plan and parallelize call on every Hugging Face
model, so a trainer's script as its docs write it needs one change: the line that shards the
model. What the Trainer then does, and why:

- Why not accelerate's `ParallelismConfig(tp_size=...)`, transformers' route for its own
  tensor parallelism: accelerate 1.15 refuses it on CPU ranks (gloo), it would build a mesh
  of its own, and transformers' save_pretrained would then gather by its own plan. Instead
  the Trainer takes its path for a model that owns its placement and gradient reduction,
  and accelerate's data loaders get the model's mesh (below). Gradients over dp are FSDP2's,
  where `tpplan.parallelize` applied it; the Trainer's loss scaling counts tp ranks as data
  ranks on both sides of its division (items and processes), which cancels.
- What the Trainer does is not right for a model sharded after loading in five places, and
  there is no public hook for them, so `_install` wraps three Trainer methods, as
  transformers.trainer loads if it has not loaded yet (each wrapper does the original's work
  for any other model; `tests/test_trainers.py` fails when transformers changes what they
  wrap): `__init__` checks the setup (one message per wrong
  one) and then takes transformers' own path for a model that owns its placement and
  gradient reduction (`is_distributed_loading_by_transformers`: every rank joins
  `save_pretrained`, whose gathering tpplan gave the model; accelerate does not wrap it).
  Transformers' `__init__` refuses optimizer checkpoints on that path, since its own
  sharding cannot save them; tpplan's can, so the flag is set after it.
  `_save_optimizer_and_scheduler` and `_load_optimizer_and_scheduler` keep the optimizer
  state with torch's distributed checkpoint (each rank its shards, resharded on load: a
  checkpoint resumes at another tp size), where the Trainer would pickle rank 0's shards.
  And each Trainer's accelerator gets a mesh of the model's layout for its data loaders:
  every rank of a tp group reads the same batches, the data split over dp only; and a
  `gather_for_metrics` that keeps one copy of each tp group's rows, so evaluate and predict
  see each row of their dataset once, in order.
- DistributedDataParallel on a sharded model (accelerate without a Trainer, Lightning's DDP)
  raises a message as it starts (`_NoDDP`).
- A checkpoint's model weights are the unsharded model's files; the Trainer's resume loads
  them with `model.load_state_dict`, which a pre-hook (torch's public one) makes cut each
  whole tensor into this rank's slice.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from ..errors import TpplanError
from .guard import InputMismatchError, check_same_inputs

__all__ = ["OPTIMIZER_FOLDER", "TrainerSetupError", "prepare_for_trainers"]

# the optimizer state of a checkpoint, one torch.distributed.checkpoint folder
OPTIMIZER_FOLDER = "optimizer_dcp"


class TrainerSetupError(TpplanError, RuntimeError):
    """A trainer set up to train a tpplan model wrongly (DDP over tp ranks, tp ranks fed
    different batches, another mesh than the model's)."""


@dataclass(frozen=True)
class Meshes:
    """The meshes a model was sharded on: its tp axis, and its dp axis when it has one."""

    tp: DeviceMesh
    dp: DeviceMesh | None
    fsdp: bool
    """Whether FSDP2 shards the model over dp (and so averages its gradients over dp)."""

    @property
    def world(self) -> int:
        return self.tp.size() * (self.dp.size() if self.dp is not None else 1)


def prepare_for_trainers(
    model: nn.Module, tp: DeviceMesh, dp: DeviceMesh | None = None, *, fsdp: bool = False
) -> None:
    """Make a sharded Hugging Face model (or a peft model over one) train under transformers'
    Trainer as it is: called by apply_plan and parallelize; nothing for other models."""
    models = _hf_models(model)
    if not models:
        return
    from transformers import DistributedConfig

    for m in models:
        # transformers' record of how it sharded the model itself: not at all. The Trainer reads
        # it (its FSDP2 no_sync), and save_pretrained gathers nothing more by it: tpplan's
        # save_pretrained hands it whole tensors (saving.py)
        m.config.distributed_config = DistributedConfig()  # type: ignore[union-attr]
    model._tpplan_meshes = Meshes(tp, dp, fsdp)  # type: ignore[assignment]
    # DDP reads this attribute first thing; iterating it raises the message (_NoDDP)
    model._ddp_params_and_buffers_to_ignore = _NoDDP(tp.size())  # type: ignore[assignment]
    if not getattr(model, "_tpplan_loads_whole", False):
        model.register_load_state_dict_pre_hook(_cut_whole_tensors)
        model._tpplan_loads_whole = True  # type: ignore[assignment]
    _install_with_the_trainer()


def _hf_models(model: nn.Module) -> list[nn.Module]:
    """The transformers models in the tree (a peft model's base), when transformers is loaded."""
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel

    return [m for m in model.modules() if isinstance(m, PreTrainedModel)]


class _NoDDP:
    """Stands as a sharded model's `_ddp_params_and_buffers_to_ignore`, the attribute
    DistributedDataParallel reads as it starts: DDP over the ranks of a tp group would average
    each rank's different shards and feed them different batches, so iterating it raises."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size

    def __iter__(self) -> Any:
        raise TrainerSetupError(
            f"DistributedDataParallel was asked to wrap a model tpplan sharded over {self.tp_size} tp "
            "ranks; DDP would average each rank's own shards as if they were copies and give the "
            "ranks of one tp group different batches. Fix: let the trainer know the model is "
            "tensor-parallel (transformers' Trainer and TRL do when given the sharded model itself; "
            "accelerate: Accelerator(parallelism_config=ParallelismConfig(tp_size=...))), and for "
            "data parallelism shard over a (dp, tp) mesh with tpplan.parallelize (FSDP2 over dp)."
        )


def _cut_whole_tensors(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """load_state_dict pre-hook: a whole (unsharded) tensor given for a DTensor parameter or
    buffer becomes this rank's slice of it, cut locally (every rank holds the whole tensor)."""
    own: dict[str, torch.Tensor] = dict(module.named_parameters())
    own.update(module.named_buffers())
    for name, target in own.items():
        given = state_dict.get(prefix + name)
        if isinstance(target, DTensor) and type(given) is torch.Tensor:
            whole = given.to(device=target.device, dtype=target.dtype)
            state_dict[prefix + name] = distribute_tensor(
                whole, target.device_mesh, target.placements, src_data_rank=None
            )


def _meshes(model: Any) -> Meshes | None:
    found = getattr(model, "_tpplan_meshes", None)
    return found if isinstance(found, Meshes) else None


def _ranks(mesh: DeviceMesh) -> list[int]:
    return sorted(dist.get_process_group_ranks(mesh.get_group()))


# ---- the wrapped Trainer methods ------------------------------------------------------------


def _install_with_the_trainer() -> None:
    """Wrap the Trainer now if transformers.trainer is loaded, else as soon as it loads:
    importing it costs ~2 s, which a script that shards a model and never trains should not
    pay. Whichever comes second, the sharding or the import, installs."""
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is not None:
        _install(trainer_module.Trainer)
    elif not any(isinstance(f, _WhenTrainerLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenTrainerLoads())


class _WhenTrainerLoads(importlib.abc.MetaPathFinder):
    """An import hook, once: finds transformers.trainer as the other finders do and wraps
    the Trainer as the module finishes loading, before any code can construct one."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "transformers.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # the finders after this one
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            _install(module.Trainer)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's loader only
        return spec


def _install(trainer_class: type) -> None:
    """Wrap three of transformers' Trainer methods, once (see the module docstring)."""
    if getattr(trainer_class, "_tpplan_installed", False):
        return
    for name, wrapper in (
        ("__init__", _init),
        ("_save_optimizer_and_scheduler", _save_optimizer_and_scheduler),
        ("_load_optimizer_and_scheduler", _load_optimizer_and_scheduler),
    ):
        setattr(trainer_class, name, _wrapped(getattr(trainer_class, name), wrapper))
    trainer_class._tpplan_installed = True  # type: ignore[attr-defined]


def _wrapped(original: Any, wrapper: Any) -> Any:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return wrapper(original, self, *args, **kwargs)

    return method


def _init(original: Any, trainer: Any, *args: Any, **kwargs: Any) -> None:
    model = kwargs.get("model", args[0] if args else None)
    if isinstance(model, nn.Module):
        _check_model(model)
    original(trainer, *args, **kwargs)
    meshes = _meshes(trainer.model)
    if meshes is None:
        return
    _check_trainer(trainer, meshes)
    # transformers' own path for a model that owns its placement and gradient reduction
    trainer.is_distributed_loading_by_transformers = True
    _split_data_over_dp(trainer, meshes)
    _gather_one_copy_per_tp_group(trainer, meshes)
    _check_first_batches(trainer.model, meshes.tp)


def _check_model(model: nn.Module) -> None:
    """The model handed to the Trainer is the sharded one itself, sharded over every rank."""
    meshes = _meshes(model)
    if meshes is None:
        inner = next((m for m in model.modules() if _meshes(m) is not None), None)
        if inner is not None:
            raise TrainerSetupError(
                f"the Trainer was given a {type(model).__name__} holding a model tpplan sharded "
                f"({type(inner).__name__}); it cannot see that this one is tensor-parallel and would "
                "wrap it in DDP over the tp ranks. Fix: give the Trainer the sharded Hugging Face "
                "model itself (Trainer(model=model, ...)), or apply the plan to the outer model."
            )
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    if meshes.world != world:
        axes = f"tp {meshes.tp.size()}" + (f" x dp {meshes.dp.size()}" if meshes.dp else "")
        raise TrainerSetupError(
            f"the model was sharded on a mesh of {meshes.world} ranks ({axes}) but the trainer runs "
            f"on all {world}: the other ranks would train another model. Fix: shard over every rank, "
            f"on init_device_mesh(device, ({world // meshes.tp.size()}, {meshes.tp.size()}), "
            "mesh_dim_names=('dp', 'tp')) with tpplan.parallelize (FSDP2 over dp)."
        )
    if meshes.dp is not None and meshes.dp.size() > 1 and not meshes.fsdp:
        raise TrainerSetupError(
            f"the model is sharded over tp on a mesh with a dp axis of {meshes.dp.size()} ranks, "
            "but nothing averages its gradients over dp (the Trainer does not wrap a tensor-parallel "
            "model). Fix: tpplan.parallelize(model, mesh, plan) with its default dp='fsdp'."
        )


def _check_trainer(trainer: Any, meshes: Meshes) -> None:
    """Nothing else shards the model, and accelerate's split of the data (tp the innermost
    axis: ranks r and r + 1 share a batch) is the model's."""
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        which = "FSDP" if trainer.is_fsdp_enabled else "DeepSpeed"
        raise TrainerSetupError(
            f"the Trainer is set up for {which}, which would shard the tpplan model a second time. "
            "Fix: drop the fsdp/deepspeed training arguments; for FSDP2 over dp shard the model "
            "with tpplan.parallelize on a (dp, tp) mesh."
        )
    tp = meshes.tp.size()
    first = dist.get_rank() // tp * tp
    if _ranks(meshes.tp) != list(range(first, first + tp)):
        raise TrainerSetupError(
            f"the model was sharded on one mesh and is trained on another: its tp group is ranks "
            f"{_ranks(meshes.tp)}, but the trainer splits the data between groups of {tp} "
            f"consecutive ranks ({list(range(first, first + tp))} for this rank), so ranks that "
            "hold shards of one model would get different batches. Fix: make tp the last mesh "
            "axis, init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))."
        )


def _split_data_over_dp(trainer: Any, meshes: Meshes) -> None:
    """accelerate's data loaders give every rank of a tp group the same batches when its
    device mesh has a "tp" axis, and split the data over "dp_shard". Without a
    ParallelismConfig (which accelerate refuses on CPU ranks) it has no mesh, so this
    Trainer's accelerator is given one of the model's layout, named as accelerate names its
    axes: `_prepare_device_mesh` is what its data loaders read (accelerate 1.15), set on this
    accelerator only."""
    tp = meshes.tp.size()
    dp = dist.get_world_size() // tp
    device = meshes.tp.device_type
    if dp == 1:
        mesh = init_device_mesh(device, (tp,), mesh_dim_names=("tp",))
    else:
        mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    trainer.accelerator._prepare_device_mesh = lambda: mesh


def _gather_one_copy_per_tp_group(trainer: Any, meshes: Meshes) -> None:
    """evaluate and predict gather each batch's outputs from every rank with accelerate's
    `gather_for_metrics`, then cut the last batch to the rows the dataset has left, counted
    over dp (the data loader's split). The ranks of a tp group hold the same rows, so each
    group's copy but the first is dropped before that cut: predict returns the dataset's rows
    once, in order. On this Trainer's accelerator only. Its `gather` itself is left gathering
    over every rank: the Trainer's loss scaling counts the tp ranks on both sides (the module
    docstring)."""
    from accelerate.utils import recursively_apply

    accelerator = trainer.accelerator
    gather_every_rank, gather_for_metrics = accelerator.gather, accelerator.gather_for_metrics
    tp, world = meshes.tp.size(), dist.get_world_size()
    first_of_group = meshes.tp.get_local_rank() == 0

    def one_copy(t: torch.Tensor) -> torch.Tensor:
        # (world * n, ...) in rank order, tp the innermost axis -> (dp * n, ...)
        return t.unflatten(0, (world, -1))[::tp].flatten(0, 1)

    def gather_rows(data: Any) -> Any:
        return recursively_apply(one_copy, gather_every_rank(data))

    def gather_once(data: Any, use_gather_object: bool = False) -> Any:
        try:
            recursively_apply(lambda x: x, data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True  # as accelerate decides: objects are gathered as objects
        if use_gather_object:  # lists of each rank's rows, concatenated: one rank's per group
            return gather_for_metrics(data if first_of_group else data[:0], use_gather_object=True)
        accelerator.gather = gather_rows  # what gather_for_metrics calls for tensors
        try:
            return gather_for_metrics(data)
        finally:
            del accelerator.gather

    accelerator.gather_for_metrics = gather_once
    # the Trainer bound gather_for_metrics in its __init__ (and binds it again after each loop)
    trainer.gather_function = functools.partial(
        gather_once, use_gather_object=trainer.args.eval_use_gather_object
    )


def _check_first_batches(model: nn.Module, tp: DeviceMesh) -> None:
    """The first training forward compares its inputs across the tp group (one small
    all-gather), then stops checking: a sampler that splits the data over every rank shows
    there, before a step is taken."""

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not module.training:
            return
        handle.remove()
        try:
            check_same_inputs(tp, args, kwargs)
        except InputMismatchError as e:
            raise TrainerSetupError(
                f"the trainer fed the ranks of one tp group different batches ({e}) Its data loader "
                "splits the data over every rank; the ranks of a tp group must share each batch. "
                "Fix: leave the Trainer's sampler and accelerate's data loader as they are (for a "
                "tensor-parallel model they split over dp only), or split over the dp axis yourself."
            ) from None

    handle = model.register_forward_pre_hook(check, with_kwargs=True)


def _plain(optimizer: Any) -> torch.optim.Optimizer:
    """accelerate's AcceleratedOptimizer wraps the torch optimizer."""
    return getattr(optimizer, "optimizer", optimizer)


def _save_optimizer_and_scheduler(original: Any, trainer: Any, output_dir: str) -> None:
    if _meshes(trainer.model) is None:
        return original(trainer, output_dir)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from transformers.trainer import SCHEDULER_NAME

    state = get_optimizer_state_dict(trainer.model, _plain(trainer.optimizer))
    dcp.save(state, checkpoint_id=Path(output_dir) / OPTIMIZER_FOLDER)
    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_NAME)
    return None


def _load_optimizer_and_scheduler(original: Any, trainer: Any, checkpoint: str | None) -> None:
    if checkpoint is None or _meshes(trainer.model) is None:
        return original(trainer, checkpoint)
    folder = Path(checkpoint) / OPTIMIZER_FOLDER
    from transformers.trainer import SCHEDULER_NAME

    if not folder.is_dir() or not (Path(checkpoint) / SCHEDULER_NAME).is_file():
        return None  # as the Trainer does: a checkpoint without them resumes the weights only
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    optimizer = _plain(trainer.optimizer)
    state = get_optimizer_state_dict(trainer.model, optimizer)  # the layout to read into
    dcp.load(state, checkpoint_id=folder)
    set_optimizer_state_dict(trainer.model, optimizer, state)
    trainer.lr_scheduler.load_state_dict(
        torch.load(Path(checkpoint) / SCHEDULER_NAME, weights_only=True)
    )
    return None
