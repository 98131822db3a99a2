"""torch's ColwiseParallel and RowwiseParallel, extended to the Linear-like layers torch's
own cannot split: fused layers and weights stored (in, out).

Start at `Colwise`:
- fused layers (`parts`, q|k|v or gate|up laid end to end in one weight): each rank gets
  its slice of every part, so its output is its own q, k and v (or gate and up) in order.
  Parts of equal sizes make the weight a `_StridedShard` (strided.py) and cost nothing at
  run time; unequal ones are no DTensor layout, so the weight is a plain Shard: on local
  shards the layer computes with a working copy of the rank's rows (own_rows.py), on the
  DTensor path each rank gathers the output and picks its own slices;
- weights stored (in, out) (`transposed`, GPT-2's Conv1D): the other dim of the weight is
  split.
`Rowwise` splits (in, out) weights too, takes equal `parts` (its input is several tensors
joined, each split on its own: rank r contracts its slice of every piece), and hands back an
output the model may change in place. rules.py uses torch's own styles where these are not needed.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from .._runtime.torch_compat import StridedShard, rowwise_prepare_output
from ..errors import TpplanError
from .local_run import LocalRun, install, local_run_reason
from .params import changeable, split_param
from .region_pieces import hold_in_pieces, whole_shared_pieces
from .strided import equal_parts, gather_pieces, own_slices
from .uneven_heads import uneven_rows

__all__ = ["Colwise", "Rowwise"]


class Colwise(ColwiseParallel):
    """ColwiseParallel for fused layers (`parts`) and (in, out) weights (`transposed`).

    The output is split over its last dim like torch's: with parts, rank r's output holds
    rank r's slice of each part in order, which is what a model splitting the output into
    parts by sizes divided per rank (or into equal chunks) expects. An nn.Embedding is left
    to torch's ColwiseParallel.

    Keyword Args:
        parts: sizes of the pieces laid end to end along the output features (q|k|v).
        transposed: the weight is stored (in_features, out_features); its dim 1 is split.
        input_layouts, output_layouts, use_local_output: as torch's ColwiseParallel; a
            fused layer's output must be local (or gathered, `output_layouts=Replicate()`).

    Example::
        >>> parallelize_module(attn, mesh, {"c_attn": Colwise(parts=[768] * 3, transposed=True)})
    """

    def __init__(
        self,
        *,
        parts: list[int] | None = None,
        transposed: bool = False,
        local_shards: bool = True,
        shared_head_dim: int | None = None,
        uneven_heads: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.parts = tuple(parts) if parts else None
        self.transposed = transposed
        self.local_shards = local_shards
        self.unit = shared_head_dim
        self.uneven_heads = uneven_heads

    def local_run_reason(self, module: nn.Module, tp: int) -> str | None:
        """Why `module` cannot run on its local shards (local_run.py); None: it can."""
        return _local_run_reason(self, module, "colwise", tp)

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        src = self.src_data_rank
        # an embedding's features are its weight's columns, as a transposed layer's outputs
        features = 1 if self.transposed or isinstance(module, nn.Embedding) else 0
        split_param(module, "weight", mesh, features, self.parts, src)
        if getattr(module, "bias", None) is not None:
            split_param(module, "bias", mesh, 0, self.parts, src)

    @staticmethod
    def _own_output(
        layouts: tuple[Placement, ...],
        local: bool,
        parts: tuple[int, ...] | None,
        unit: int | None,
        mod: nn.Module,
        out: DTensor,
        mesh: DeviceMesh,
    ) -> Any:
        if parts is not None and not isinstance(layouts[0], Replicate):
            if not local and equal_parts(parts):
                # a DTensor region: the output stays a `_StridedShard`, whose global value
                # is the unsplit fused output the model's code cuts into its pieces
                return out
            if not local:
                # a DTensor region: DTensor has no layout for a rank's slice of each of
                # pieces of several sizes, so its own rows go on held in pieces, to be cut
                # apart at their bounds by the region's code (region_pieces.py)
                own = own_slices(out, mesh, parts, -1, unit)
                if unit is None:
                    return hold_in_pieces(own, mesh, parts, out.shape)
                # key/value heads shared among ranks: each its own head in every place
                filled, shared = whole_shared_pieces(own, parts, unit, mesh)
                return hold_in_pieces(filled, mesh, parts, out.shape, shared, unit)
            if equal_parts(parts):
                # its weight is a _StridedShard: the local output already holds this rank's
                # slice of each part, in order
                return out.to_local()
            # pieces of unequal sizes are no DTensor layout: the weight is a plain Shard of
            # the original, so this rank's features are gathered and its slices picked out;
            # the gradient is partial (each rank's picks only), summed back to the shards
            return own_slices(out, mesh, parts, -1, unit)
        if parts is not None and equal_parts(parts) and isinstance(layouts[0], Replicate):
            # gathered by pieces (strided.py): torch's own gather of the _StridedShard
            # output reads shard offsets off tensor values, which a dry run cannot
            whole = gather_pieces(out.to_local(), mesh, parts, -1)
            if not local:
                return DTensor.from_local(whole, mesh, [Replicate()], run_check=False)
            return changeable(whole)
        if out.placements != layouts:
            out = out.redistribute(placements=layouts)
        if local and isinstance(layouts[0], Replicate):
            # a gathered output the model may change in place (Gemma 3n)
            return changeable(out.to_local())
        return out.to_local() if local else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.uneven_heads is not None:
            # a plain Shard of the output features, fused pieces or not (the rank's own
            # rows are copied out of it, not laid out as a _StridedShard)
            plain = partial(_plain_colwise, self.transposed, self.src_data_rank)
            return _uneven_heads(self, module, device_mesh, "colwise", plain)
        input_fn = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        output_fn = partial(
            self._own_output, self.output_layouts, self.use_local_output, self.parts, self.unit
        )
        if self.local_shards and self.local_run_reason(module, device_mesh.size()) is None:
            distribute_module(module, device_mesh, self._partition)
            gather = isinstance(self.output_layouts[0], Replicate)
            run = LocalRun(
                "colwise",
                device_mesh,
                self.transposed,
                gather,
                input_fn,
                output_fn,
                parts=self.parts,
                unit=self.unit,
                held=not self.use_local_output and len(set(self.parts or ())) > 1,
            )
            install(module, run)
            return module
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        return distribute_module(module, device_mesh, self._partition, input_fn, output_fn)

    def __repr__(self) -> str:
        shared = f", shared_head_dim={self.unit}" if self.unit else ""
        uneven = f", uneven_heads={self.uneven_heads}" if self.uneven_heads else ""
        return (
            f"{super().__repr__()[:-1]}, parts={self.parts}, transposed={self.transposed}"
            f"{shared}{uneven})"
        )


def _plain_colwise(
    transposed: bool, src: int | None, name: str, module: nn.Module, mesh: DeviceMesh
) -> None:
    """Colwise's partition less its fused pieces: each parameter a plain Shard."""
    split_param(module, "weight", mesh, 1 if transposed else 0, None, src)
    if getattr(module, "bias", None) is not None:
        split_param(module, "bias", mesh, 0, None, src)


def _uneven_heads(
    style: Colwise | Rowwise, module: nn.Module, mesh: DeviceMesh, kind: Any, partition: Any
) -> nn.Module:
    """A layer whose heads tp does not divide (uneven_heads.py): its weight a plain Shard
    of the original, and each call on its local shards computes with a working copy of the
    rank's own heads' rows (colwise) or columns (rowwise). Such a layer runs on local shards
    only, also where the plan is applied with local_shards=False: DTensor has no layout for
    uneven whole heads."""
    assert style.uneven_heads is not None
    head_dim, group = style.uneven_heads
    tp = mesh.size()
    weight = module.get_parameter("weight")
    embedding = isinstance(module, nn.Embedding)  # its features are its weight's columns
    features = int(weight.shape[0 if (kind == "colwise") != (style.transposed or embedding) else 1])
    where = f"{type(module).__name__} of {features} {'output' if kind == 'colwise' else 'input'} features"
    reason = style.local_run_reason(module, tp)
    if embedding:
        reason = "an embedding's lookup takes no rows of its own"
    if features % head_dim or reason is not None:
        why = (
            f"they are no whole number of heads of head_dim {head_dim}"
            if features % head_dim
            else f"it cannot run on its local shards: {reason}"
        )
        raise TpplanError(
            f"a {kind} layer with uneven heads ({where}) needs whole heads on local shards, "
            f"and {why}. Fix the rule's head_dim, or drop uneven and keep the layer whole."
        )
    pieces = style.parts if isinstance(style, Colwise) and style.parts else (features,)
    order = tuple(tuple(rows) for rows in uneven_rows(pieces, head_dim, group, tp))
    distribute_module(module, mesh, partition)

    def refuse(*_: Any) -> Any:
        raise TpplanError(
            f"a {kind} layer with uneven heads ({where}) was handed a DTensor (a DTensor "
            "region or a sequence-parallel input); its heads split unevenly have no DTensor "
            "layout. Drop uneven from its rule, or the region or sequence parallelism."
        )

    install(module, LocalRun(kind, mesh, style.transposed, False, refuse, None, order=order))
    return module


def _local_run_reason(style: Any, module: nn.Module, kind: Any, tp: int) -> str | None:
    """local_run_reason for a Colwise or Rowwise style's settings."""
    return local_run_reason(
        module,
        kind,
        transposed=style.transposed,
        parts=style.parts,
        input_layout=style.input_layouts[0],
        output_layout=style.output_layouts[0],
        local_output=style.use_local_output,
        tp=tp,
        unit=getattr(style, "unit", None),
    )


class Rowwise(RowwiseParallel):
    """RowwiseParallel for Linear-like layers, also with weights stored (in, out) (their dim
    0 is contracted), whose local output may be changed in place.

    While grad is recorded its output is handed back as its own tensor (`changeable`), so a
    model that adds a residual in place (Falcon's `mlp_output += attention_output`) trains.
    An nn.Embedding is left to torch's RowwiseParallel.

    With equal `parts` the input features are pieces laid end to end (attention heads and
    MLP features joined by `cat`), each split on its own: the weight is a `_StridedShard`
    and a local input is read as rank r's slice of every piece, in order.

    Keyword Args:
        parts: sizes of the input pieces, all equal.
        transposed: the weight is stored (in_features, out_features); its dim 0 is split.
        input_layouts, output_layouts, use_local_output: as torch's RowwiseParallel.

    Example::
        >>> parallelize_module(mlp, mesh, {"c_proj": Rowwise(transposed=True)})
    """

    def __init__(
        self,
        *,
        parts: list[int] | None = None,
        transposed: bool = False,
        local_shards: bool = True,
        uneven_heads: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.uneven_heads = uneven_heads
        if parts and not equal_parts(parts):
            raise TpplanError(
                f"a rowwise layer takes input pieces of one size only, not {list(parts)}."
            )
        self.parts = tuple(parts) if parts else None
        self.transposed = transposed
        self.local_shards = local_shards

    def local_run_reason(self, module: nn.Module, tp: int) -> str | None:
        """Why `module` cannot run on its local shards (local_run.py); None: it can."""
        kind = "lookup" if isinstance(module, nn.Embedding) else "rowwise"
        return _local_run_reason(self, module, kind, tp)

    def _partition_linear_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        dim = 0 if self.transposed else 1
        split_param(module, "weight", mesh, dim, self.parts, self.src_data_rank)
        bias = getattr(module, "bias", None)
        if isinstance(bias, nn.Parameter):
            replicated = distribute_tensor(
                bias, mesh, [Replicate()], src_data_rank=self.src_data_rank
            )
            module.register_parameter("bias", nn.Parameter(replicated, bias.requires_grad))

    @staticmethod
    def _own_output(layouts: Any, local: bool, mod: nn.Module, out: DTensor, mesh: Any) -> Any:
        out = rowwise_prepare_output(layouts, local, mod, out, mesh)
        return changeable(out) if local else out

    @staticmethod
    def _pieces_input(parts: int, mod: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
        """The input as rank r's slice of each of `parts` pieces (the weight's layout): a
        local tensor is labelled so, a DTensor laid out otherwise is redistributed."""
        x = inputs[0]
        pieces = [StridedShard(x.dim() - 1, split_factor=parts)]
        if isinstance(x, DTensor):
            x = x if x.placements == tuple(pieces) else x.redistribute(placements=pieces)
        else:
            x = DTensor.from_local(x, mesh, pieces, run_check=False)
        return (x, *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding):
            if not self.local_shards or self.local_run_reason(module, device_mesh.size()):
                return super()._apply(module, device_mesh)
            # a vocab-parallel lookup (torch's RowwiseParallel on an Embedding)
            self.desired_input_layouts = (Replicate(),)
            distribute_module(module, device_mesh, self._partition_embedding_fn)
            input_fn = partial(
                self._prepare_input_fn, self.input_layouts, self.desired_input_layouts
            )
            output_fn = partial(self._prepare_output_fn, self.output_layouts, self.use_local_output)
            install(module, LocalRun("lookup", device_mesh, False, False, input_fn, output_fn))
            return module
        if self.uneven_heads is not None:
            return _uneven_heads(self, module, device_mesh, "rowwise", self._partition_linear_fn)
        self.desired_input_layouts = (Shard(-1),)
        prepare = (
            partial(self._pieces_input, len(self.parts))
            if self.parts
            else partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        )
        output_fn = partial(self._own_output, self.output_layouts, self.use_local_output)
        if self.local_shards and self.local_run_reason(module, device_mesh.size()) is None:
            distribute_module(module, device_mesh, self._partition_linear_fn)
            run = LocalRun("rowwise", device_mesh, self.transposed, False, prepare, output_fn)
            install(module, run)
            return module
        return distribute_module(module, device_mesh, self._partition_linear_fn, prepare, output_fn)

    def __repr__(self) -> str:
        uneven = f", uneven_heads={self.uneven_heads}" if self.uneven_heads else ""
        return (
            f"{super().__repr__()[:-1]}, parts={self.parts}, transposed={self.transposed}{uneven})"
        )
