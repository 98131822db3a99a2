"""LoRA wrappers run as one layer: base and adapters with the base's single collective.

Each child of a peft LoRA wrapper (_runtime/adapters.py) gets its own rule's style, which
distributes its parameters. Run child by child, the adapters would add a collective of r
features each (lora_B colwise sums its input's gradient; lora_A rowwise sums its output).
Where the plan splits the adapters as infer/adapters.py does, `fuse_adapters` gives the
wrapper a forward of its own (peft's forward is a known computation, as nn.Linear's is) that
folds them into the base's one collective, made r features wider:
- colwise: `a = lora_A(x)` is whole on every rank; the backward sums the gradients of x
  (from the base) and of a (from lora_B's shard) in one all-reduce (`_SumGradsTogether`);
- rowwise: the base's partial output and lora_A's partial r features are summed in one
  all-reduce (`_SumTogether`), then lora_B runs on the whole r features.
The replicated adapter weights become Replicate DTensors, so that peft's merge
(`base.weight += lora_B.weight @ lora_A.weight * scaling`) runs on DTensors shard by shard.
With `local_shards=False` the wrapper computes the same on DTensors (the reference path).
Start at `fuse_adapters`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from .._runtime.adapters import Adapter, lora_layers
from .linear import Colwise
from .local_run import _all_reduce, _Gather, _local, _rank, group_name
from .shared_heads import SharedHeadsColwise

__all__ = ["fuse_adapters", "fused_kind"]


@dataclass(frozen=True)
class _Fused:
    kind: Literal["colwise", "rowwise"]
    mesh: DeviceMesh
    local: bool
    """Run on local shards with direct collectives (else on DTensors)."""
    gather: bool
    """colwise: the output gathered whole."""
    group: str
    tp: int
    rank: Any


def fuse_adapters(
    model: nn.Module, mesh: DeviceMesh, styles: dict[str, ParallelStyle], *, local_shards: bool
) -> None:
    """Give each LoRA wrapper whose adapters are split as their base (`fused_kind`) the
    one-collective forward (module docstring); others run child by child."""
    for name, adapter in lora_layers(model).items():
        own = _as_plain(styles, model, adapter, mesh.size())
        kind = fused_kind(adapter, own)
        if kind is None:
            continue
        wrapper = model.get_submodule(name)
        for whole in adapter.a if kind == "colwise" else adapter.b:
            _replicate(model.get_submodule(whole), mesh)
        layouts = own[adapter.base].output_layouts  # type: ignore[attr-defined]
        gather = kind == "colwise" and isinstance(layouts[0], Replicate)
        wrapper._tpplan_fused = _Fused(  # type: ignore[assignment]
            kind=kind,
            mesh=mesh,
            local=local_shards,
            gather=gather,
            group=group_name(mesh),
            tp=mesh.size(),
            rank=_rank(mesh),
        )
        wrapper.forward = _forward.__get__(wrapper)


def fused_kind(
    adapter: Adapter, styles: dict[str, ParallelStyle]
) -> Literal["colwise", "rowwise"] | None:
    """'colwise' or 'rowwise' where the base and its adapters are split as infer/adapters.py
    splits them and the base's layouts are the plain ones; else None."""
    base = styles.get(adapter.base)
    if (
        base is None
        or getattr(base, "parts", None)
        or getattr(base, "transposed", False)
        or getattr(base, "uneven_heads", None)  # each rank its own rows: child by child
    ):
        return None
    kind: Literal["colwise", "rowwise"]
    if isinstance(base, ColwiseParallel):
        split, whole, kind = adapter.b, adapter.a, "colwise"
        plain = base.input_layouts == (Replicate(),) and base.use_local_output
    elif isinstance(base, RowwiseParallel):
        split, whole, kind = adapter.a, adapter.b, "rowwise"
        plain = (
            base.input_layouts == (Shard(-1),)
            and base.output_layouts == (Replicate(),)
            and base.use_local_output
        )
    else:
        return None
    if not plain or any(n in styles for n in whole):
        return None
    if not all(_same(styles.get(n), base) for n in split):
        return None
    return kind


def _as_plain(
    styles: dict[str, ParallelStyle], model: nn.Module, adapter: Adapter, tp: int
) -> dict[str, ParallelStyle]:
    """The styles of the adapter's layers, a key/value projection whose heads tp divides
    (SharedHeadsColwise, which is then a plain colwise) as the plain Colwise it applied."""
    out = {}
    for name in (adapter.base, *adapter.a, *adapter.b):
        style = styles.get(name)
        if isinstance(style, SharedHeadsColwise):
            heads = (
                int(model.get_submodule(name).get_parameter("weight").shape[0]) // style.head_dim
            )
            if heads % tp == 0:
                style = Colwise(input_layouts=style.input_layouts)
        if style is not None:
            out[name] = style
    return out


def _same(style: ParallelStyle | None, base: ParallelStyle) -> bool:
    keys = ("input_layouts", "output_layouts", "use_local_output", "parts", "transposed")
    return type(style) is type(base) and all(
        getattr(style, k, None) == getattr(base, k, None) for k in keys
    )


def _replicate(linear: nn.Module, mesh: DeviceMesh) -> None:
    """The linear's weight as a Replicate DTensor (its values unchanged)."""
    for key, p in list(linear._parameters.items()):
        if p is not None and not isinstance(p, DTensor):
            whole = distribute_tensor(p.detach(), mesh, [Replicate()], src_data_rank=None)
            linear.register_parameter(key, nn.Parameter(whole, requires_grad=p.requires_grad))


def _adapters(wrapper: Any) -> list[tuple[Any, Any, float, Any]]:
    """(lora_A, lora_B, scaling, dropout) of each active adapter, as peft's forward runs them."""
    return [
        (wrapper.lora_A[k], wrapper.lora_B[k], wrapper.scaling[k], wrapper.lora_dropout[k])
        for k in wrapper.active_adapters
        if k in wrapper.lora_A
    ]


def _forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    run: _Fused = self._tpplan_fused
    plain = isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
    if args or kwargs or self.merged or self.disable_adapters or not plain:
        # peft's own forward, child by child (merged weights, or a call this does not know)
        return type(self).forward(self, x, *args, **kwargs)
    if not run.local:
        return _on_dtensors(self, run, x)
    if run.kind == "colwise":
        return _colwise(self, run, x)
    return _rowwise(self, run, x)


class _SumGradsTogether(torch.autograd.Function):
    """Identity forward on several tensors; the backward sums all their gradients over the
    tp ranks in one all-reduce (`_sum_together`)."""

    @staticmethod
    def forward(ctx: Any, group: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, *_sum_together(list(grads), ctx.group))


class _SumTogether(torch.autograd.Function):
    """Several partial sums summed over the tp ranks in one all-reduce; their gradients (the
    same on every rank, the sums being replicated) pass as they are."""

    @staticmethod
    def forward(ctx: Any, group: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_sum_together(list(tensors), group))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, *grads)


def _sum_together(ts: list[torch.Tensor], group: str) -> list[torch.Tensor]:
    """Each of `ts` summed over the tp ranks, in one all-reduce: joined on the last dim in
    their widest dtype (peft may keep adapters in fp32 beside a bf16 base), cut apart, each
    cast back to its own dtype."""
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in ts])
    joined = _all_reduce(torch.cat([t.to(dtype) for t in ts], dim=-1), group)
    pieces = joined.split([t.shape[-1] for t in ts], dim=-1)
    return [piece.to(t.dtype) for piece, t in zip(pieces, ts, strict=True)]


def _lora_inputs(self: Any, x: Any) -> list[Any]:
    """Each active adapter's input, as peft's forward makes it: cast to lora_A's dtype, then
    its dropout."""
    return [drop(self._cast_input_dtype(x, a.weight.dtype)) for a, _, _, drop in _adapters(self)]


def _add_adapters(self: Any, out: Any, inner: list[Any]) -> Any:
    """peft's sum: the base's output plus each lora_B(inner) * scaling, in the base's dtype."""
    dtype = out.dtype
    for t, (_, b, scaling, _) in zip(inner, _adapters(self), strict=True):
        out = out + F.linear(t, _local(b.weight)) * scaling
    return out.to(dtype)


def _colwise(self: Any, run: _Fused, x: torch.Tensor) -> torch.Tensor:
    base = self.base_layer
    inner = [
        F.linear(t, _local(a.weight))  # (B, T, r), whole on every rank
        for t, (a, _, _, _) in zip(_lora_inputs(self, x), _adapters(self), strict=True)
    ]
    if run.tp > 1 and torch.is_grad_enabled():
        # x's gradient (from the base) and each r features' (from lora_B), all partial sums
        # over the ranks' output shards: summed together in one all-reduce
        needs = [i for i, t in enumerate([x, *inner]) if t.requires_grad]
        passed = _SumGradsTogether.apply(run.group, *[[x, *inner][i] for i in needs])
        both = dict(zip(needs, passed, strict=True))
        x, inner = both.get(0, x), [both.get(i + 1, t) for i, t in enumerate(inner)]
    out = F.linear(x, _local(base.weight), _local(base.bias))  # (B, T, out / tp)
    out = _add_adapters(self, out, inner)
    if not run.gather or run.tp == 1:
        return out
    return _Gather.apply(out, run.group, run.rank, run.tp, int(base.weight.shape[0]))


def _rowwise(self: Any, run: _Fused, x: torch.Tensor) -> torch.Tensor:
    base = self.base_layer
    partial = F.linear(x, _local(base.weight))  # (B, T, out), a partial sum
    inner = [
        F.linear(t, _local(a.weight))  # (B, T, r), a partial sum
        for t, (a, _, _, _) in zip(_lora_inputs(self, x), _adapters(self), strict=True)
    ]
    if run.tp > 1:
        # one all-reduce for the base's output and every adapter's r features
        summed = (
            _SumTogether.apply(run.group, partial, *inner)
            if torch.is_grad_enabled()
            else _sum_together([partial, *inner], run.group)
        )
        partial, *inner = summed
    out = partial if base.bias is None else partial + _local(base.bias)
    return _add_adapters(self, out, inner)


def _on_dtensors(self: Any, run: _Fused, x: torch.Tensor) -> torch.Tensor:
    """The same sum on DTensors, DTensor's propagation placing the collectives."""
    layout = Replicate() if run.kind == "colwise" else Shard(-1)
    xd = DTensor.from_local(x, run.mesh, [layout], run_check=False)
    base = self.base_layer
    out: Any = F.linear(xd, base.weight, base.bias)
    dtype = out.dtype
    for t, (a, b, scaling, _) in zip(_lora_inputs(self, xd), _adapters(self), strict=True):
        out = out + F.linear(F.linear(t, a.weight), b.weight) * scaling
    out = out.to(dtype)
    if run.kind == "rowwise" or run.gather:
        out = out.redistribute(run.mesh, [Replicate()])
    return out.to_local()
