"""Vocab-parallel embeddings whose own forward does more than look up.

An embedding table is an nn.Embedding's weight, one row per token id; split by vocab (by
rows, torch's RowwiseParallel on an Embedding), each rank looks up only the ids in its share
and gets zeros for the others, so the looked-up rows are partial sums until summed over the
ranks. torch sums them at the module's output, which is wrong for an nn.Embedding subclass
whose forward goes on to norm or overwrite the rows. The two styles here serve such
subclasses, each through the subclass's own `super().forward(ids)`, given another lookup in
nn.Embedding's place (tpplan/_runtime/lookup.py):
- `SumAtLookup` (`sum_at: lookup`): the rows are summed right where they are looked up, so
  the rest of the forward sees whole rows;
- `WrittenRows` (`written`): the forward runs on each rank's partial rows, each rank
  writing its share of the parameters written over rows, and one sum at the output adds
  both up.
Start at `SumAtLookup`. A plain nn.Embedding needs neither: rules.py gives it torch's own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
)
from torch.distributed.tensor.parallel import ParallelStyle

from .._runtime.lookup import put_in_lookup_place
from ..errors import TpplanError
from .params import changeable, own_start, split_param

__all__ = ["SumAtLookup", "WrittenRows"]


class SumAtLookup(ParallelStyle):
    """vocab_parallel with `sum_at: lookup`: the weight split by rows like torch's
    RowwiseParallel on an Embedding, and the module's class given `_SummedLookup` in the
    place of nn.Embedding, where the subclass's `super().forward(ids)` looks up (the way
    torch's parametrizations give a module a class of its own). The module keeps its name,
    its parameters' names and every other method; its input and output stay plain tensors.
    tpplan infers it only where the trace saw every lookup of the embedding made through that
    place.

    Example::
        >>> parallelize_module(model, mesh, {"embed_tokens": SumAtLookup()})
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TpplanError(
                f"sum_at: lookup applies to Embedding modules, not {type(module).__name__}."
            )
        split_param(module, "weight", device_mesh, 0, None, self.src_data_rank)
        put_in_lookup_place(module, _SummedLookup)
        return module

    def __repr__(self) -> str:
        return "SumAtLookup()"


class _SummedLookup(nn.Embedding):
    """nn.Embedding's place in a split embedding's class order: the lookup of this rank's
    rows, summed over the tp ranks as it returns, so what the subclass's forward does next (a
    norm, rows overwritten) sees whole rows."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        assert isinstance(weight, DTensor)  # SumAtLookup split it
        mesh = weight.device_mesh
        ids = DTensor.from_local(input, mesh, [Replicate()], run_check=False)
        partial_rows = nn.Embedding.forward(self, ids)
        assert isinstance(partial_rows, DTensor)
        rows = partial_rows.redistribute(mesh, [Replicate()]).to_local()
        return changeable(rows)  # the forward may change it in place


class WrittenRows(ParallelStyle):
    """vocab_parallel with `written`: the weight split by rows like torch's RowwiseParallel on
    an Embedding, and the parameters the module's forward writes over looked-up rows
    (`written`) split along their last dim. The module's own forward then runs on each
    rank's partial rows as plain tensors (`_LocalLookup` in nn.Embedding's place, found by
    its `super().forward(ids)`), with each written parameter seen as its rank's share padded
    with zeros (put in the module's `__dict__` for the call); one sum of the output, an
    all-reduce (or a reduce-scatter to `output_layouts`), adds up rows and writes alike.
    tpplan infers it only where the trace saw every op from the lookup to the output linear
    in the rows, and the parameters written as they are.

    Keyword Args:
        written: names of the module's own parameters written over looked-up rows, each as
            wide as a row.
        output_layouts: the layout of the summed output (default Replicate, an all-reduce).
        use_local_output: hand back a plain tensor (default) or a DTensor.

    Example::
        >>> parallelize_module(model, mesh, {"embed": WrittenRows(written=["eoi_embedding"])})
    """

    def __init__(
        self,
        *,
        written: list[str],
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.written = list(written)
        self.output_layout = output_layouts or Replicate()
        self.use_local_output = use_local_output

    def _check(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """The module's own parameters, once it is known to be an embedding that can be
        looked up rank by rank and whose `written` parameters are as wide as its rows."""
        if not isinstance(module, nn.Embedding):
            raise TpplanError(f"written applies to Embedding modules, not {type(module).__name__}.")
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise TpplanError(
                "vocab_parallel with written looks each rank's rows up on its own, which "
                "max_norm, scale_grad_by_freq and sparse gradients do not allow; keep the "
                "embedding whole (style: replicate)."
            )
        own = dict(module.named_parameters(recurse=False))
        for name in self.written:
            p = own.get(name)
            if p is None or name == "weight" or p.shape[-1:] != (module.embedding_dim,):
                raise TpplanError(
                    f"written: '{name}' is not a parameter of {type(module).__name__} as "
                    f"wide as its rows ({module.embedding_dim}); its parameters are "
                    f"{', '.join(f'{n} {tuple(q.shape)}' for n, q in own.items())}. Name "
                    "the ones its forward writes over looked-up rows."
                )
        return own

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        own = self._check(module)
        split_param(module, "weight", device_mesh, 0, None, self.src_data_rank)
        for name in self.written:
            split_param(module, name, device_mesh, own[name].dim() - 1, None, self.src_data_rank)
        assert isinstance(module, nn.Embedding)  # _check made sure
        put_in_lookup_place(module, _LocalLookup)

        def before(mod: nn.Module, args: Any) -> None:
            for name in self.written:
                p = mod._parameters[name]
                assert isinstance(p, DTensor)  # made one above
                mod.__dict__[name] = _padded(p)

        def after(mod: nn.Module, args: Any, out: Any) -> Any:
            if not isinstance(out, torch.Tensor):
                raise TpplanError(
                    f"vocab_parallel with written sums the output of {type(mod).__name__}, "
                    f"which must be one tensor, not {type(out).__name__}."
                )
            partial_rows = DTensor.from_local(out, device_mesh, [Partial()], run_check=False)
            rows = partial_rows.redistribute(device_mesh, [self.output_layout])
            return rows.to_local() if self.use_local_output else rows

        def clean(mod: nn.Module, args: Any, out: Any) -> None:
            for name in self.written:
                mod.__dict__.pop(name, None)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
        module.register_forward_hook(clean, always_call=True)
        return module

    def __repr__(self) -> str:
        return f"WrittenRows(written={self.written}, output={self.output_layout!r})"


class _LocalLookup(nn.Embedding):
    """nn.Embedding's place in a split embedding's class order: this rank's partial rows, as
    a plain tensor. Ids in this rank's share of the vocab get their rows, the others zeros."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        assert isinstance(weight, DTensor)  # WrittenRows split it
        local = weight.to_local()
        first = own_start(self.num_embeddings, weight.device_mesh, input.device)
        at = input - first
        mine = (at >= 0) & (at < local.shape[0])
        rows = F.embedding(torch.where(mine, at, torch.zeros_like(at)), local)
        rows = rows * mine.unsqueeze(-1).to(rows.dtype)
        if self.padding_idx is not None:  # its row is looked up but never trained
            padding = (input == self.padding_idx).unsqueeze(-1)
            rows = torch.where(padding, rows.detach(), rows)
        return rows


def _padded(param: DTensor) -> torch.Tensor:
    """This rank's share of a parameter split along its last dim, in place within zeros of
    the whole parameter's shape: summed over the ranks, the whole parameter."""
    local = param.to_local()
    start = own_start(param.shape[-1], param.device_mesh, local.device)
    at = start + torch.arange(local.shape[-1], device=local.device)
    return local.new_zeros(param.shape).index_copy(-1, at, local)
