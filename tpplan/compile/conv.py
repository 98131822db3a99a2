"""colwise and rowwise for convolutions of one group: a Linear over the channels (dim 1).

Start at `ChannelConv`. DTensor has no convolution over a split weight: given one, its
convolution rule runs each rank's shard as if it were the whole weight and returns
wrong numbers without a word. So the convolution never sees a DTensor here. Its weight
and bias are DTensors split like a Linear's (state dicts and checkpoints see the unsharded
layout), and each call runs the module's own forward (torch's kernel, any memory format) on
the rank's local tensors, put in the module's `__dict__` for the call as `SplitParams` does.
The collectives are DTensor's: the input and output are labelled and redistributed as
torch's ColwiseParallel and RowwiseParallel do for a Linear, with the channels where a
Linear has its last dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle

from .._runtime.torch_compat import StridedShard
from ..errors import TpplanError
from .local_run import group_name
from .own_rows import OwnRows, own_rows
from .params import changeable, split_param
from .strided import equal_parts, gather_pieces, own_slices

__all__ = ["ChannelConv"]

_CHANNELS = Shard(1)


class ChannelConv(ParallelStyle):
    """A convolution of one group (any kernel) split over its output channels (colwise) or its input channels
    (rowwise), as a Linear is over its features.

    Colwise: the input is whole on every rank (its gradient summed over them), the weight and
    bias are split on dim 0, and the output holds the rank's channels (`Shard(1)`). Rowwise:
    the input holds the rank's channels, the weight is split on dim 1, each rank's output is
    a partial sum, all-reduced before the whole bias is added.

    A fused convolution (q|k|v laid end to end over its output channels, `parts`) gives
    each rank its slice of every piece, as a fused Linear does (linear.py): with pieces of
    one size its weight is a `_StridedShard`, and its local output the rank's slice of each
    piece in order; with pieces of several sizes the weight is a plain Shard and the rank's
    slices are picked from the gathered output. A rowwise one takes input pieces of one size.

    Keyword Args:
        rowwise: split the input channels instead of the output channels.
        parts: sizes of the pieces laid end to end along the split channels.
        input_layouts, output_layouts, use_local_output: as torch's ColwiseParallel and
            RowwiseParallel, with `Shard(1)` (the channels) where they have `Shard(-1)`.

    Example::
        >>> parallelize_module(mlp, mesh, {"fc1": ChannelConv(), "fc2": ChannelConv(rowwise=True)})
    """

    def __init__(
        self,
        *,
        rowwise: bool = False,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        parts: list[int] | None = None,
        shared_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.rowwise = rowwise
        self.parts = tuple(parts) if parts else None
        self.unit = shared_head_dim  # parts' heads shared past their count (own_rows.py)
        if self.parts and rowwise and not equal_parts(self.parts):
            raise TpplanError(
                f"a rowwise convolution takes input pieces of one size only, not {list(self.parts)}."
            )
        if self.parts and not rowwise and not use_local_output and not equal_parts(self.parts):
            raise TpplanError(
                f"a fused colwise convolution of unequal parts {list(self.parts)} has no DTensor "
                "layout for its output; drop local_output: false from its rule."
            )
        pieces = len(self.parts) if self.parts and equal_parts(self.parts) else 0
        split = StridedShard(1, split_factor=pieces) if pieces else _CHANNELS
        whole = Replicate()
        self.input_layout = input_layouts or (split if rowwise else whole)
        self.wanted_input = split if rowwise else whole
        self.wanted_output = split  # a colwise output's channels as each rank computes them
        self.output_layout = output_layouts or (whole if rowwise else split)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        mesh, src = device_mesh, self.src_data_rank
        split_param(module, "weight", mesh, 1 if self.rowwise else 0, self.parts, src)
        bias = module._parameters.get("bias")
        if bias is not None and not self.rowwise:
            split_param(module, "bias", mesh, 0, self.parts, src)
        elif bias is not None:
            whole = distribute_tensor(bias, mesh, [Replicate()], src_data_rank=src)
            module.register_parameter("bias", nn.Parameter(whole, bias.requires_grad))

        # pieces of several sizes on local shards: the rank's own rows of the weight, copied
        # once per change of it (own_rows.py), as a fused Linear's
        rows = None
        if self.parts is not None and self._own_rows(mesh):
            rows = OwnRows(self.parts, mesh, group_name(mesh), unit=self.unit)

        def before(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = self._local_input(args[0], mesh)
            weight = mod._parameters["weight"]
            assert isinstance(weight, DTensor)  # made one above
            b = mod._parameters.get("bias")
            # a rowwise bias is added once, after the partial sums are summed
            own = isinstance(b, DTensor) and not self.rowwise
            if rows is not None:
                mod.__dict__["weight"] = own_rows(rows, "weight", weight, 0)
                mod.__dict__["bias"] = own_rows(rows, "bias", b, 0) if own else None
                return (x, *args[1:])
            mod.__dict__["weight"] = weight.to_local()
            mod.__dict__["bias"] = b.to_local() if own else None
            return (x, *args[1:])

        def after(mod: nn.Module, args: Any, out: torch.Tensor) -> Any:
            mod.__dict__.pop("weight", None)
            mod.__dict__.pop("bias", None)
            if rows is not None:
                return out  # already the rank's slice of each piece
            return self._output(mod, out, mesh)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
        return module

    def _own_rows(self, mesh: DeviceMesh) -> bool:
        """Whether the layer computes with a copy of its own rows: fused pieces of several
        sizes, its output kept split as local tensors."""
        return (
            self.parts is not None
            and not self.rowwise
            and not equal_parts(self.parts)
            and not isinstance(self.output_layout, Replicate)
            and self.use_local_output
            and mesh.size() > 1
        )

    def _local_input(self, x: Any, mesh: DeviceMesh) -> torch.Tensor:
        """The rank's input as the convolution takes it: whole (colwise), whose gradient is
        then each rank's partial sum, or the rank's channels (rowwise)."""
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
        if x.placements != (self.wanted_input,):
            x = x.redistribute(placements=[self.wanted_input])
        return x.to_local(grad_placements=None if self.rowwise else [Partial()])

    def _output(self, mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> Any:
        gathered = isinstance(self.output_layout, Replicate)
        if self.parts and not self.rowwise and not equal_parts(self.parts) and not gathered:
            # pieces of several sizes: a plain Shard of the weight, this rank's slices picked
            split = DTensor.from_local(out, mesh, [_CHANNELS], run_check=False)
            return own_slices(split, mesh, self.parts, 1, self.unit)
        if self.parts and not self.rowwise and equal_parts(self.parts) and gathered:
            # gathered by pieces (strided.py), as a fused Linear's
            whole = gather_pieces(out, mesh, self.parts, 1)
            if not self.use_local_output:
                return DTensor.from_local(whole, mesh, [Replicate()], run_check=False)
            return whole
        got: DTensor = DTensor.from_local(
            out, mesh, [Partial() if self.rowwise else self.wanted_output], run_check=False
        )
        if got.placements != (self.output_layout,):
            got = got.redistribute(placements=[self.output_layout])
        bias = mod._parameters.get("bias")
        if self.rowwise and isinstance(bias, DTensor):
            got = got + bias.reshape(-1, *([1] * (out.dim() - 2)))
        if not self.use_local_output:
            return got
        local = got.to_local()
        return changeable(local) if self.rowwise else local

    def __repr__(self) -> str:
        kind = "rowwise" if self.rowwise else "colwise"
        return (
            f"ChannelConv({kind}, input_layouts={self.input_layout}, "
            f"output_layouts={self.output_layout}, use_local_output={self.use_local_output}, "
            f"parts={self.parts})"
        )
