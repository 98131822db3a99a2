"""The aten ops the tracer knows, by what they do to a tensor, and `Op`, one call of one.

Start at `Op`: the dispatch driver (tracer.py) wraps every aten call in one and hands it to
the trackers and the per-op rules (rules.py). The sets below name ops by their overload
packet (`aten.view`, whatever the overload); an op in no set is one the tracer does not know,
which ends any split it receives. `run_op` runs an op as the tracer does, on fake and meta
tensors too; check/ and diagnose/ run ops through it so that they see the same kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from .._runtime.torch_compat import FakeTensor, grouped_mm, tree_leaves

__all__ = [
    "ADDS",
    "COPIES",
    "ELEMENTWISE",
    "LINEAR_IN_PARTIAL",
    "MADE_LIKE",
    "METADATA",
    "NEW_FROM",
    "NORMS",
    "PASS_THROUGH",
    "REDUCTIONS",
    "RESHAPES",
    "SAME_SHAPE_OVER_DIM",
    "SHARD_SIZED",
    "SIZED",
    "SPLITS",
    "Op",
    "linear_in",
    "run_op",
]

# Ops that look at a tensor's metadata only.
METADATA = {
    "device",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "dim",
    "is_contiguous",
}
# Element-wise ops that carry no pointwise tag; anything tagged pointwise is element-wise too.
ELEMENTWISE = {
    "where", "_to_copy", "clone", "alias", "detach", "lift_fresh", "native_dropout",
    "masked_fill", "fill_", "zero_", "copy_", "contiguous", "dropout",
}  # fmt: skip
RESHAPES = {
    "view",
    "_unsafe_view",
    "reshape",
    "_reshape_alias",
    "unsqueeze",
    "squeeze",
    "view_as",
    "flatten",
    "unflatten",
}
# Ops that keep the shape and compute along one dim: over the split dim they end the split.
SAME_SHAPE_OVER_DIM = {
    "_softmax",
    "_safe_softmax",
    "_log_softmax",
    "softmax",
    "log_softmax",
    "cumsum",
    "cumprod",
    "logcumsumexp",
}
REDUCTIONS = {
    "sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "std_mean", "prod",
    "logsumexp", "norm", "linalg_vector_norm", "argmax", "argmin", "any", "all",
}  # fmt: skip
# Ops that cut one tensor into several along a dim.
SPLITS = {
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "unsafe_split",
    "unsafe_split_with_sizes",
    "tensor_split",
}
NORMS = {"native_layer_norm", "_fused_rms_norm", "rms_norm", "layer_norm"}
# Ops making a tensor whose values are the same along every dim it is given a size for:
# sized by a split dim read just before, it is split like that dim (`sized_by_a_shard`).
NEW_FROM = {"new_empty", "new_zeros", "new_ones"}
SHARD_SIZED = NEW_FROM | {"empty", "zeros", "ones", "expand"}
# Ops making a tensor from another's dtype, device (and shape), not its values.
MADE_LIKE = NEW_FROM | {
    "new_empty_strided", "new_full", "zeros_like", "empty_like", "ones_like", "full_like",
}  # fmt: skip
# Ops whose output is the same data as their one input: a parameter or a model input passed
# through them is still that parameter or input.
PASS_THROUGH = RESHAPES | {
    "alias",
    "detach",
    "t",
    "transpose",
    "permute",
    "expand",
    "_to_copy",
    "clone",
    "lift_fresh",
    "slice",
    "contiguous",
}
# Ops whose integer arguments size a tensor (views, expansions, new tensors).
SIZED = RESHAPES | {
    "expand", "new_zeros", "new_ones", "new_empty", "new_full", "zeros", "ones", "empty", "full",
    "arange", "repeat", "split", "split_with_sizes", "narrow", "slice",
}  # fmt: skip
# Ops linear in their first argument (a partial sum), given plain other arguments.
LINEAR_IN_PARTIAL = RESHAPES | {
    "t", "transpose", "permute", "_to_copy", "clone", "contiguous", "alias", "detach",
    "index", "index_select", "select", "slice", "narrow", "sum", "expand", "gather", "neg",
}  # fmt: skip
# Sums of tensors that must all be partial sums (or per-expert biases, added once).
ADDS = {
    "add", "add_", "sub", "sub_", "index_add", "index_add_", "index_put", "index_put_",
    "scatter_add", "scatter_add_", "cat", "stack",
}  # fmt: skip
# Copies: a reshape of a strided tensor runs as one of these, then a view.
COPIES = {"clone", "contiguous", "alias", "_reshape_alias", "_to_copy"}


@dataclass
class Op:
    """One aten call: the op, its arguments as given, and what it returned."""

    func: Any
    args: Any
    kwargs: dict[str, Any]
    out: Any

    @cached_property
    def name(self) -> str:
        """The op's overload packet name (`view`, `add_`), what the sets above hold."""
        return str(self.func.overloadpacket.__name__)

    @cached_property
    def named(self) -> dict[str, Any]:
        """The arguments by their names in the op's schema (trailing defaults are absent)."""
        names = [arg.name for arg in self.func._schema.arguments]
        out = dict(zip(names, self.args, strict=False))  # trailing defaults are not passed
        out.update(self.kwargs)
        return out

    @cached_property
    def ins(self) -> list[torch.Tensor]:
        """Every tensor among the arguments, nested ones included (a cat's list)."""
        leaves = tree_leaves((self.args, self.kwargs))
        return [t for t in leaves if isinstance(t, torch.Tensor)]

    @cached_property
    def outs(self) -> list[torch.Tensor]:
        """Every tensor the op returned."""
        return [o for o in tree_leaves(self.out) if isinstance(o, torch.Tensor)]


def run_op(func: Any, args: Any, kwargs: Any) -> Any:
    """The op, on fake or meta tensors too. The meta kernel of the grouped matmul
    (mixture-of-experts layers) takes bf16 only, though CPU runs it in fp32: its shapes are
    the same, so it is asked in bf16 and the result given the dtype the real op would have.
    bf16 rows must also be whole 16-byte runs, which fp32 rows need not be on CPU: where only
    that stands in the way, the output is made at the shape the real op gives."""
    if (
        func is grouped_mm
        and args[0].dtype == torch.float32
        and (isinstance(args[0], FakeTensor) or args[0].device.type == "meta")
    ):
        half = [
            a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args
        ]
        try:
            return func(*half, **kwargs).to(torch.float32)
        except RuntimeError as e:
            if "16 bytes" not in str(e):
                raise
            return _grouped_mm_like(args, kwargs)
    return func(*args, **kwargs)


def _grouped_mm_like(args: Any, kwargs: Any) -> torch.Tensor:
    """An empty fp32 output of `torch._grouped_mm(a, b, offs=...)`: (M, N) for tokens (M, K)
    by stacked weights (G, K, N); (G, M, N) for batches by batches, or for (M, K) by (K, N)
    grouped along K."""
    a, b = args[0], args[1]
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    shape: tuple[int, ...]
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    elif a.dim() == 2 and b.dim() == 2 and offs is not None:
        shape = (offs.shape[0], a.shape[0], b.shape[-1])
    else:
        raise RuntimeError(f"grouped matmul of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return a.new_empty(shape, dtype=torch.float32)


def linear_in(
    name: str,
    ins: list[torch.Tensor],
    mine: list[torch.Tensor],
    others: list[torch.Tensor],
    unsplit: Callable[[torch.Tensor], bool],
) -> bool | None:
    """Whether the op's output is linear in `mine` (the tensors followed), given the
    `others`: views and copies of the first input, a product with (or a quotient by) one
    `unsplit` tensor. None for any other op: sums are each caller's to judge."""
    if name in LINEAR_IN_PARTIAL:
        return ins[0] is mine[0] and not others
    if name in ("mul", "div", "mul_", "div_"):
        return (
            len(mine) == 1
            and (name.startswith("mul") or ins[0] is mine[0])
            and all(unsplit(t) for t in others)
        )
    return None
