"""Every rank of a tensor-parallel mesh in this one process, with real numbers.

The single place that runs torch's private LocalTensorMode (taken from torch_compat.py, like
every private torch name), so that a change of how it is used is mended here only. Used by
the tests and by `tpplan verify` for numeric parity without spawning processes.
`fake_ranks` is the same without numbers (shapes and collectives only); `solo_fake_mesh` is
a fake mesh of its own beside whatever process group is already there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.overrides import TorchFunctionMode

from .torch_compat import (
    create_fake_backend,
    fake_store,
    register_process_group,
    unregister_process_group,
)

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = [
    "fake_ranks",
    "outside_simulation",
    "own_replicas",
    "rank_values",
    "simulated_ranks",
    "solo_fake_grid",
    "solo_fake_mesh",
]


@contextmanager
def _fake_group(world_size: int) -> Iterator[None]:
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_backend() != "fake":
            raise RuntimeError(
                f"a process group of world size {dist.get_world_size()} ({dist.get_backend()}) is "
                f"already initialised; simulating {world_size} ranks needs its own fake group."
            )
        yield
        return
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def outside_simulation() -> AbstractContextManager[Any]:
    """Run plain tensor code once, not once per simulated rank (a no-op outside
    `simulated_ranks`)."""
    from .torch_compat import maybe_disable_local_tensor_mode

    return maybe_disable_local_tensor_mode()


@contextmanager
def fake_ranks(world_size: int) -> Iterator[DeviceMesh]:
    """A 1-D CPU mesh of `world_size` ranks on a fake process group: shapes, no numbers."""
    with _fake_group(world_size):
        yield init_device_mesh("cpu", (world_size,))


@contextmanager
def solo_fake_mesh(world_size: int) -> Iterator[DeviceMesh]:
    """A 1-D mesh of `world_size` fake ranks (this process is rank 0) on a fake process group
    of its own, beside any process group this process already has (gloo, NCCL, fake), which
    it neither needs nor touches: no rendezvous, no collective with the other ranks. Its
    collectives send nothing. For DTensor runs on meta tensors (shapes only).

    Built from torch's private pieces (a DeviceMesh without backend init, a registered
    FakeProcessGroup); a torch that changes them raises here, and callers give up the run.
    """
    from torch.distributed.distributed_c10d import GroupName

    # One name per size, and one axis name no user mesh has: DTensor caches sharding
    # decisions by mesh equality (ranks, device type, axis names), so a real mesh must never
    # equal this one, and a cached decision that names an earlier solo mesh of this size
    # must find its group registered again.
    name = GroupName(f"tpplan-solo-fake-{world_size}")
    group = _fake_group_of(name, world_size)
    mesh = DeviceMesh(
        "cpu",
        torch.arange(world_size),
        mesh_dim_names=(SOLO_AXIS,),
        _init_backend=False,
        _rank=0,
    )
    mesh._dim_group_names = [name]
    mesh._pg_registry[name] = group
    unregister_process_group(name)  # a group left by a run that never got to its finally
    register_process_group(name, group)
    try:
        yield mesh
    finally:
        unregister_process_group(name)


SOLO_AXIS = "tpplan-solo"


def _fake_group_of(name: GroupName, size: int) -> Any:
    """A fake process group of `size` ranks named `name` (this process rank 0), on CPU and
    meta tensors; not yet registered."""
    group = dist.ProcessGroup(dist.HashStore(), 0, size)
    backend = create_fake_backend(0, size)
    custom = dist.ProcessGroup.BackendType.CUSTOM
    for device in ("cpu", "meta"):
        group._register_backend(torch.device(device), custom, backend)
    group._set_default_backend(custom)
    group._set_group_name(name)
    return group


def solo_fake_grid(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A mesh of `shape` fake ranks (this process is rank 0), one fake group per axis, beside
    any process group: what `solo_fake_mesh` is for a 1-D mesh, for a view of one as several
    axes (compile/shared_heads.py). Its groups stay registered (one per shape and axis)."""
    from torch.distributed.distributed_c10d import GroupName

    mesh = DeviceMesh(
        "cpu",
        torch.arange(math.prod(shape)).view(shape),
        mesh_dim_names=tuple(f"{SOLO_AXIS}-{n}" for n in names),
        _init_backend=False,
        _rank=0,
    )
    groups = []
    for axis, size in enumerate(shape):
        name = GroupName(f"tpplan-solo-fake-{'x'.join(map(str, shape))}-{axis}")
        group = _fake_group_of(name, size)
        mesh._pg_registry[name] = group
        unregister_process_group(name)
        register_process_group(name, group)
        groups.append(name)
    mesh._dim_group_names = groups
    return mesh


@contextmanager
def simulated_ranks(world_size: int) -> Iterator[DeviceMesh]:
    """A 1-D CPU mesh whose ranks all run here, each with its own real tensors.

    Inside, tensors produced by sharded modules hold one value per rank; read them with
    `rank_values`. Make inputs before entering: random ops inside draw different values on
    each rank, as separately seeded processes would.
    """
    from .torch_compat import LocalTensorMode

    with _fake_group(world_size), LocalTensorMode(world_size), _SizedReshape():
        yield init_device_mesh("cpu", (world_size,))


class _SizedReshape(TorchFunctionMode):
    """A `reshape` with a -1 of a tensor whose sizes differ across simulated ranks (heads
    split unevenly: a SymInt of each rank's own) given that size computed: torch's reshape
    infers it only where it can view, and raises NYI where it must copy (a transposed
    attention output). Real ranks hold numbers and never need it."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.reshape, torch.reshape) and len(args) >= 2:
            t, sizes = args[0], args[1:]
            if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
                sizes = tuple(sizes[0])
            if -1 in [s for s in sizes if isinstance(s, int)] and any(
                isinstance(d, torch.SymInt) for d in t.shape
            ):
                known = 1
                for s in sizes:
                    if not (isinstance(s, int) and s == -1):
                        known = known * s
                sizes = tuple(
                    t.numel() // known if isinstance(s, int) and s == -1 else s for s in sizes
                )
                return func(t, sizes, **kwargs)
        return func(*args, **kwargs)


def rank_values(t: Any) -> list[torch.Tensor]:
    """The per-rank values of a tensor computed under `simulated_ranks` (a DTensor is made
    whole first); a plain tensor counts as the same on every rank."""
    from torch.distributed.tensor import DTensor

    from .torch_compat import LocalTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    if isinstance(t, LocalTensor):
        return [t._local_tensors[r] for r in sorted(t._local_tensors)]
    return [t]


def own_replicas(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """Give every simulated rank its own copy of the plain (replicated) parameters.

    A plain tensor is one object shared by all simulated ranks, so an in-place update with
    per-rank gradients (an optimizer step) would be applied once per rank. Real processes
    each hold their own copy; this makes the simulation do the same. Call after apply_plan,
    inside `simulated_ranks`, before building the optimizer.
    """
    from torch.distributed.tensor import DTensor

    from .torch_compat import LocalTensor

    done: dict[int, torch.nn.Parameter] = {}  # tied parameters stay one parameter
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = _owned(p, world_size, LocalTensor, DTensor)
            module._parameters[name] = done[id(p)]
    return model


def _owned(p: torch.nn.Parameter, world_size: int, local_type: Any, dtensor_type: Any) -> Any:
    """`p`, or a copy of it in which no two simulated ranks share storage."""
    if isinstance(p, dtensor_type):
        # distribute_tensor(..., [Replicate()]) may hand every rank the same tensor
        local = p._local_tensor
        shards = getattr(local, "_local_tensors", None)
        if shards is None:  # one plain tensor stands for every rank
            shards = dict.fromkeys(range(world_size), local.detach())
        elif len({t.data_ptr() for t in shards.values()}) == len(shards):
            return p
        copies = local_type({r: t.clone() for r, t in shards.items()})
        new = torch.nn.Parameter(
            dtensor_type.from_local(copies, p.device_mesh, p.placements, run_check=False),
            requires_grad=p.requires_grad,
        )
        new.__dict__.update({k: v for k, v in p.__dict__.items() if k != "_is_param"})
        return new
    if isinstance(p, local_type):
        return p
    copies = local_type({r: p.data.clone() for r in range(world_size)})
    new = torch.nn.Parameter(copies, requires_grad=p.requires_grad)
    if p._backward_hooks:  # a replicated parameter whose gradient is summed over the ranks
        new._backward_hooks = p._backward_hooks
    return new
