"""Sharding strategies DTensor lacks, which regions that keep DTensor activations need.

Start at `teach_dtensor`. A region run on DTensors (infer/dtensor_regions.py, `Plan.regions`) lets
the model's own code see global shapes while DTensor's sharding propagation carries the
split through views, rotary embeddings and attention. Two gaps in torch 2.13 broke that:

- SDPA's CPU kernel (`_scaled_dot_product_flash_attention_for_cpu` and its backward) has
  no strategy, so a region through `F.scaled_dot_product_attention` on CPU raises
  NotImplementedError. Heads are independent: q, k, v, the output and the logsumexp
  sharded alike on the heads dim (dim 1) is exact, and so is everything replicated.
  Registered through torch's public `register_sharding`. (On CUDA torch has strategies
  for the flash and efficient kernels.)
- A fused opener (q|k|v in one weight) hands out a `_StridedShard(d, split_factor=k)`: each
  rank holds its slice of each of the k pieces. Cutting it into its k pieces
  (`qkv.split(C, dim=2)`, nanoGPT) gives each piece as a plain `Shard(d)`; torch's split
  strategy gathers it instead. The backward's `cat` of k `Shard(d)` pieces is the reverse.
  Both are added beside torch's own strategies (which stay as they are), through DTensor's
  private strategy table, in this one place.

Idempotent; called by `apply_plan` before a plan with regions is applied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from .._runtime.torch_compat import (
    DTensorSpec,
    OpSchema,
    OpSpec,
    RuntimeSchemaInfo,
    StridedShard,
    generate_redistribute_costs,
    normalize_dim,
    sharding_propagator,
)

__all__ = ["teach_dtensor"]

aten = torch.ops.aten
_taught = False


def teach_dtensor() -> None:
    """Register the strategies above, once per process."""
    global _taught
    if _taught:
        return
    _register_cpu_sdpa()
    _teach_strided_split()
    _teach_strided_views()
    _taught = True


# ---- SDPA on CPU ----------------------------------------------------------------------------
def _mask_layout(attn_mask: Any, heads: Placement) -> list[Placement | None]:
    """A mask's layout beside q/k/v laid out as `heads`: sharded alike when it has a head
    dim of its own, replicated when it broadcasts over the heads."""
    if attn_mask is None:
        return []
    if isinstance(heads, Shard) and attn_mask.shape[1] != 1:
        return [Shard(1)]
    return [Replicate()]


def _register_cpu_sdpa() -> None:
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _forward(
        query: Any,
        key: Any,
        value: Any,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        attn_mask: Any = None,
        scale: Any = None,
    ) -> list[tuple[list[Placement | None], list[Placement | None]]]:
        out: list[tuple[list[Placement | None], list[Placement | None]]] = []
        for p in (Replicate(), Shard(1)):
            out.append(([p, p], [p, p, p, *_mask_layout(attn_mask, p)]))
        return out

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _backward(
        grad_out: Any,
        query: Any,
        key: Any,
        value: Any,
        out: Any,
        logsumexp: Any,
        dropout_p: float,
        is_causal: bool,
        *,
        attn_mask: Any = None,
        scale: Any = None,
    ) -> list[tuple[list[Placement | None], list[Placement | None]]]:
        strategies: list[tuple[list[Placement | None], list[Placement | None]]] = []
        for p in (Replicate(), Shard(1)):
            strategies.append(([p, p, p], [p, p, p, p, p, p, *_mask_layout(attn_mask, p)]))
        return strategies


# ---- fused pieces ---------------------------------------------------------------------------
def _teach_strided_split() -> None:
    table = sharding_propagator().op_strategy_funcs
    for op in (aten.split.Tensor, aten.split_with_sizes.default):
        _wrap(op, table[op], _split_pieces, RuntimeSchemaInfo(1))
    _wrap(
        aten.cat.default,
        table[aten.cat.default],
        _cat_pieces,
        RuntimeSchemaInfo(1, needs_pytree=True),
    )
    adjusters = sharding_propagator().op_to_scalar_shape_adjuster
    for op in (aten.split.Tensor, aten.split_with_sizes.default):
        adjusters[op] = _local_split_sizes


def _wrap(
    op: Any, torch_strategy: Callable[..., Any], extra: Callable[..., Any], info: Any
) -> None:
    def strategy(op_schema: Any) -> Any:
        found = torch_strategy(op_schema)
        more = extra(op_schema)
        if more:
            found.strategies.extend(more)
        return found

    sharding_propagator().register_op_strategy(op, strategy, info)


def _sizes(total: int, split: int | Sequence[int]) -> list[int]:
    if isinstance(split, int):
        return [split] * (total // split) + ([total % split] if total % split else [])
    return list(split)


def _split_pieces(op_schema: Any) -> list[Any]:
    """split of a `_StridedShard(d, k)` into its k equal pieces along d: each a `Shard(d)`."""
    args = op_schema.args_schema
    source = args[0]
    dim = normalize_dim(args[2] if len(args) > 2 else 0, source.ndim)
    sizes = _sizes(source.shape[dim], args[1])
    found = []
    for spec in (s.output_spec for s in source.strategies):
        placements = spec.placements
        strided = [
            i
            for i, p in enumerate(placements)
            if isinstance(p, StridedShard) and p.dim == dim and p.split_factor == len(sizes)
        ]
        if len(strided) != 1 or len(set(sizes)) != 1:
            continue
        if any(
            isinstance(p, Shard) and p.dim == dim
            for i, p in enumerate(placements)
            if i != strided[0]
        ):
            continue
        out = list(placements)
        out[strided[0]] = Shard(dim)
        found.append(
            OpSpec(
                output_specs=tuple(DTensorSpec(spec.mesh, tuple(out)) for _ in sizes),
                input_specs=(DTensorSpec(spec.mesh, placements, spec.tensor_meta),),
                redistribute_cost=[generate_redistribute_costs(source, spec)],
            )
        )
    return found


def _cat_pieces(op_schema: Any) -> list[Any]:
    """cat of k equal `Shard(d)` pieces along d: a `_StridedShard(d, k)` (split's reverse)."""
    args = op_schema.args_schema
    children = args[0].children
    first = children[0]
    dim = normalize_dim(args[1] if len(args) > 1 else 0, first.ndim)
    if len({c.shape for c in children}) != 1 or len(children) < 2:
        return []
    found = []
    for spec in (s.output_spec for s in first.strategies):
        placements = spec.placements
        sharded = [
            i
            for i, p in enumerate(placements)
            if isinstance(p, Shard) and p.dim == dim and not isinstance(p, StridedShard)
        ]
        if len(sharded) != 1:
            continue
        out = list(placements)
        out[sharded[0]] = StridedShard(dim, split_factor=len(children))
        in_specs = tuple(
            DTensorSpec(spec.mesh, placements, c.strategies[0].output_spec.tensor_meta)
            for c in children
        )
        found.append(
            OpSpec(
                output_specs=DTensorSpec(spec.mesh, tuple(out)),
                input_specs=in_specs,
                redistribute_cost=[
                    generate_redistribute_costs(c, s)
                    for c, s in zip(children, in_specs, strict=True)
                ],
            )
        )
    return found


def _teach_strided_views() -> None:
    """torch's view-like strategies (view, reshape, unflatten's view, transpose, expand...)
    label a `_StridedShard` spec as a plain shard in a shard order of its own, where every
    other strategy reads `_StridedShard` as the shard order itself: the same layout in two
    labels, which the next op's strategy tells apart, and a region's backward then gathers
    a fused output's gradient (a matmul of a viewed gradient with the fused weight) and
    gathers it again. On a 1-D mesh the two mean one thing: the views' specs are relabelled
    as the others write them."""
    propagator = sharding_propagator()
    for op, func in list(propagator.op_strategy_funcs.items()):
        if getattr(func, "__name__", "") == "reshape_strategy" and "_view_ops" in func.__module__:
            info = propagator.op_to_schema_info.get(op)
            propagator.register_op_strategy(op, _relabelled(func), info)


def _relabelled(torch_strategy: Callable[..., Any]) -> Callable[..., Any]:
    def strategy(op_schema: Any) -> Any:
        found = torch_strategy(op_schema)
        for s in found.strategies:
            s.output_specs = _one_label(s.output_specs)
            s.input_specs = tuple(_one_label(i) for i in s.input_specs or ())
        return found

    return strategy


def _one_label(spec: Any) -> Any:
    """`spec` with its `_StridedShard` read as the shard order, on a 1-D mesh."""
    if (
        isinstance(spec, DTensorSpec)
        and spec.mesh.ndim == 1
        and not spec.use_strided_shard_as_shard_order
        and any(isinstance(p, StridedShard) for p in spec.placements)
    ):
        return DTensorSpec(spec.mesh, spec.placements, spec.tensor_meta)
    return spec


def _local_split_sizes(input_specs: list[Any], schema: Any) -> Any:
    """The local op cuts a rank's `_StridedShard` of k pieces into its k local pieces: the
    split sizes, given globally, become local (each divided by the mesh dims that split it)."""
    spec = input_specs[0]
    args = list(schema.args_schema)
    dim = normalize_dim(args[2] if len(args) > 2 else 0, spec.ndim)
    ways = 1
    for size, p in zip(spec.mesh.shape, spec.placements, strict=True):
        if isinstance(p, StridedShard) and p.dim == dim:
            ways *= size
    if ways == 1:
        return schema
    split = args[1]
    args[1] = split // ways if isinstance(split, int) else [s // ways for s in split]
    return OpSchema(schema.op, tuple(args), schema.kwargs_schema, schema.schema_info)
