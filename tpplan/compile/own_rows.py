"""A fused layer of unequal pieces on its local shards: each rank computes with a working
copy of its own rows, while the parameter stays a plain Shard of the original.

Start at `own_rows`. A q|k|v weight whose pieces differ in size (grouped-query attention in
one Linear: q of H*d rows, k and v of K*d) has no DTensor layout in which rank r holds its
slice of every piece (`_StridedShard` cuts equal pieces only). The parameter is therefore a
contiguous `Shard` of the original weight, which is what state dicts, optimizers, DCP and
FSDP see (its full tensor is the original, never a reordering). The rank's forward needs
other rows: [q_r | k_r | v_r], its slice of each piece (strided.py's `fused_order`). Those
are copied out of the shards by one all-gather when the parameter changes and kept beside
it (`_Cache`): at inference they are built once, in training once per optimizer step; a
decode step pays no collective for them, where the DTensor path gathers the layer's whole
output at every call (strided.py's `own_slices`).

The copy is keyed on the parameter's and its local tensor's version counters (an optimizer
step bumps the parameter's, a write into the local tensor its own) and on the local tensor
itself (a load into new storage, `.to()`), so it is never read stale. On a tp axis cut from
a larger mesh (FSDP2 over dp beside it) the copy is rebuilt at every call: FSDP2 gathers each
step's new weights into the same unsharded tensor without a version bump, so no key would
show the change (one weight all-gather per call, beside FSDP2's own). Its gradient goes
back to the Shard layout: scattered into a zero weight of the whole size at the rows'
places and reduce-scattered (`_OwnRows`); every row's gradient comes from exactly one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DeviceMesh, DTensor

from .._runtime.torch_compat import (
    all_gather_op,
    reduce_scatter_op,
    root_mesh_dims,
    wait_tensor_op,
)

__all__ = ["OwnRows", "own_order", "own_rows"]


def own_order(parts: Sequence[int], tp: int, unit: int | None = None) -> list[list[int]]:
    """Per rank, the rows of the whole fused tensor it computes with, in order: its slice of
    each piece whose size splits `tp` ways; with `unit` (head_dim), a piece of fewer heads
    than ranks (grouped-query attention's k and v at tp above their head count, multi-query
    attention's single head) gives each rank one whole head, head r // (tp / heads): the
    head its query heads read, as Megatron's layout for shared key/value heads."""
    out: list[list[int]] = [[] for _ in range(tp)]
    start = 0
    for size in parts:
        shared = shares_a_head(size, tp, unit)
        for r in range(tp):
            if shared and unit:
                head = r // (tp // (size // unit))
                out[r].extend(range(start + head * unit, start + (head + 1) * unit))
            elif size % (tp * (unit or 1)) == 0:  # whole heads to each rank
                step = size // tp
                out[r].extend(range(start + r * step, start + (r + 1) * step))
            else:
                raise ValueError(f"a piece of {size} rows splits neither {tp} ways nor by heads")
        start += size
    return out


def shares_a_head(size: int, tp: int, unit: int | None) -> bool:
    """Whether a fused piece of `size` rows is fewer heads of `unit` than ranks, their count
    dividing `tp`: each rank then holds one whole head (`own_order`), not its slice."""
    if not unit or size % unit or size % (tp * unit) == 0:
        return False
    return tp % (size // unit) == 0


def _gather(shard: torch.Tensor, dim: int, group: str, tp: int) -> torch.Tensor:
    """The whole tensor from each rank's contiguous shard of `dim` (equal shards)."""
    moved = shard.movedim(dim, 0).contiguous()
    whole = wait_tensor_op(all_gather_op(moved, tp, group))  # (tp * rows, ...)
    return whole.movedim(0, dim)


def _scatter_sum(whole: torch.Tensor, dim: int, group: str, tp: int) -> torch.Tensor:
    """Each rank's contiguous shard of `dim` of the ranks' `whole` tensors summed."""
    moved = whole.movedim(dim, 0).contiguous()
    shard = wait_tensor_op(reduce_scatter_op(moved, "sum", tp, group))  # (rows / tp, ...)
    return shard.movedim(0, dim)


class _OwnRows(torch.autograd.Function):
    """The cached rows, tied to the shard they were copied from: forward hands them on; the
    gradient of the rows is put at their places in a zero weight and reduce-scattered back
    to the shard (the Shard layout of the parameter)."""

    @staticmethod
    def forward(
        ctx: Any,
        shard: torch.Tensor,
        rows: torch.Tensor,
        index: torch.Tensor,
        dim: int,
        group: str,
        tp: int,
    ) -> torch.Tensor:
        ctx.index, ctx.dim, ctx.group, ctx.tp = index, dim, group, tp
        ctx.whole = list(shard.shape)
        ctx.whole[dim] *= tp
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # a row held by several ranks (a shared key/value head) gets each one's gradient,
        # summed by the reduce-scatter
        whole = grad.new_zeros(ctx.whole).index_copy(ctx.dim, ctx.index, grad)
        return _scatter_sum(whole, ctx.dim, ctx.group, ctx.tp), None, None, None, None, None


class _OwnRowsUneven(torch.autograd.Function):
    """_OwnRows for a parameter whose split dim tp does not divide (DTensor's uneven
    shares, the first ranks one row more): gathered and scattered back through DTensor,
    which pads the shares (its weight copied once per change, so the cost is rare)."""

    @staticmethod
    def forward(
        ctx: Any, shard: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, p: DTensor, dim: int
    ) -> torch.Tensor:
        ctx.index, ctx.dim, ctx.mesh, ctx.whole = index, dim, p.device_mesh, list(p.shape)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        from torch.distributed.tensor import Partial, Shard

        whole = grad.new_zeros(ctx.whole).index_copy(ctx.dim, ctx.index, grad)
        summed = DTensor.from_local(whole, ctx.mesh, [Partial()], run_check=False)
        shard = summed.redistribute(placements=[Shard(ctx.dim)]).to_local()
        return shard, None, None, None, None


@dataclass
class _Cache:
    local: torch.Tensor
    """The local tensor the rows were copied from (kept: compared by identity)."""
    versions: tuple[int, int]
    rows: torch.Tensor


class OwnRows:
    """The working copies of one layer's fused parameters (weight, bias): per parameter name,
    the rank's slice of each of `parts` along `dim`, rebuilt when the parameter changes."""

    def __init__(
        self,
        parts: Sequence[int],
        mesh: DeviceMesh,
        group: str,
        *,
        unit: int | None = None,
        order: list[list[int]] | None = None,
    ) -> None:
        self.parts = tuple(parts)
        self.unit = unit
        # per rank, its rows where they are given (heads split unevenly, uneven_heads.py)
        self.order = order
        self.mesh = mesh
        self.group = group
        self.tp = mesh.size()
        # kept across calls on a mesh of its own only (see the module docstring)
        self.keeps = root_mesh_dims(mesh) == 1
        self._index: torch.Tensor | None = None
        self._cache: dict[str, _Cache] = {}

    def index(self, device: torch.device) -> torch.Tensor:
        """The whole tensor's rows that are this rank's own, in order (each rank's own, also
        on simulated ranks)."""
        if self._index is None or self._index.device != device:
            from torch.distributed.tensor import Shard, distribute_tensor

            order = self.order or own_order(self.parts, self.tp, self.unit)
            every = torch.tensor([i for rows in order for i in rows], device=device)
            if len({len(rows) for rows in order}) == 1:
                # each rank its own list (all of one length), also on simulated ranks
                self._index = distribute_tensor(
                    every, self.mesh, [Shard(0)], src_data_rank=None
                ).to_local()
            else:
                # lists of several lengths (heads split unevenly)
                from .uneven_heads import own_tensor

                self._index = own_tensor(self.mesh, order, device)
        return self._index

    def kept(self) -> list[torch.Tensor]:
        """The working copies kept now (one per parameter that has run)."""
        return [c.rows for c in self._cache.values()]

    def rows(self, name: str, p: DTensor, dim: int) -> torch.Tensor:
        """The rank's own rows of parameter `p`: cached, rebuilt where `p` changed; while
        grad is recorded, tied to `p`'s shard so its gradient reaches the Shard layout."""
        local = p._local_tensor
        versions = (p._version, local._version)
        index = self.index(local.device)
        found = self._cache.get(name)
        # a dim tp does not divide: DTensor's uneven shares (heads split unevenly of a
        # layer whose features tp does not divide either)
        uneven = p.shape[dim] % self.tp != 0
        if (
            not self.keeps
            or found is None
            or found.local is not local
            or found.versions != versions
        ):
            with torch.no_grad():
                if uneven:
                    from torch.distributed.tensor import Replicate

                    whole = p.redistribute(placements=[Replicate()]).to_local()
                else:
                    whole = _gather(local, dim, self.group, self.tp)
                rows = whole.index_select(dim, index)
            found = self._cache[name] = _Cache(local, versions, rows)
        if torch.is_grad_enabled() and p.requires_grad:
            if uneven:
                return _OwnRowsUneven.apply(p.to_local(), found.rows, index, p, dim)
            return _OwnRows.apply(p.to_local(), found.rows, index, dim, self.group, self.tp)
        return found.rows


def own_rows(holder: OwnRows, name: str, p: Any, dim: int) -> Any:
    """`p`'s rows this rank computes with: its own slice of each piece (a plain tensor), or
    `p` itself where it is no DTensor (None, a bias the layer lacks)."""
    if not isinstance(p, DTensor):
        return p
    return holder.rows(name, p, dim)
