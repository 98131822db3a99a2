"""The run-time fast path: sharded layers computed on their local shards, the collectives
called directly.

A layer split by torch's styles runs its forward on DTensors: every call goes through
DTensor's dispatch (sharding propagation, wrapping, unwrapping), host work that costs more
than the matmul itself when a decode step's matmuls are small. Where the plan's sizes are
local (a colwise layer's output handed on as a plain tensor, a rowwise layer's input one),
nothing inside the layer needs DTensor: rank r's output is its weight shard times its input,
and the only communication is the one Megatron's layers make (the f and g of its paper):

- colwise: the input passes as it is; its gradient is summed over the tp ranks (`_Copy`);
  a fused layer of unequal pieces computes with a working copy of its own rows, gathered
  once per change of its weight (own_rows.py);
  an output gathered whole (`output: replicate`) is all-gathered on its last dim (`_Gather`);
  an embedding split on its features (T5's relative position bias, split by heads) looks up
  the rank's columns;
- rowwise: the partial outputs are summed over the ranks (`_Sum`), then the bias is added
  once; heads split unevenly (colwise and rowwise) compute with a working copy of the
  rank's own heads' rows or columns (own_rows.py, uneven_heads.py);
- vocab-parallel lookup: each rank looks up the ids in its share of the rows, zeroes the
  others' rows, and the rows are summed over the ranks (`_Sum`).

The parameters stay DTensors (state dicts, optimizers, checkpoints and FSDP see the same
model as on the DTensor path); each call reads their local shards (`to_local`, whose
gradient flows back into the DTensor's). The layer's forward is replaced by one that does
the above (`install`), for the forwards whose computation is known: nn.Linear's, nn.Embedding's
and GPT-2's Conv1D (weight stored (in, out)), and a subclass's own forward that extends one
of them (known_forwards.py: Gemma's scaled embeddings), whose `super().forward` becomes the
local one. A call that is handed a DTensor (a layer inside
a DTensor region) takes the DTensor path for that call, through the style's own input and
output functions. `local_run_reason` says why a layer cannot take this path at all; stats
shows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

from .._runtime.torch_compat import (
    all_gather_op,
    all_reduce_op,
    mark_static_address,
    resolve_group_name,
    wait_tensor_op,
)
from .known_forwards import forward_of, known_base, local_class
from .own_rows import OwnRows, own_order, own_rows
from .params import own_start
from .region_pieces import hold_in_pieces, whole_shared_pieces
from .strided import shard_step

__all__ = [
    "LocalRun",
    "copy_to_ranks",
    "install",
    "local_run_reason",
    "runs_locally",
    "sum_over_ranks",
]

Kind = Literal["colwise", "rowwise", "lookup"]


def _all_reduce(t: torch.Tensor, group: str) -> torch.Tensor:
    # torch's functional collective ops themselves: funcol's wrappers around them add a
    # tensor subclass per call, host time a decode step pays at every layer
    out = all_reduce_op(t.contiguous(), "sum", group)
    return wait_tensor_op(out)


def _all_gather(t: torch.Tensor, group: str, tp: int, total: int | None = None) -> torch.Tensor:
    """The ranks' tensors joined on the last dim (gathered on dim 0, as the op does). With
    `total` (the whole dim's size, split unevenly as DTensor's Shard does: the first ranks
    ceil(total/tp) each, the last what is left), each is padded to that share first, and the
    padding, all at the end, cut off after."""
    if total is not None and total % tp:
        t = F.pad(t, (0, shard_step(total, tp) - t.shape[-1]))
    out = all_gather_op(t.contiguous(), tp, group)
    out = wait_tensor_op(out)
    whole = torch.cat(out.chunk(tp), dim=-1)
    return whole if total is None or total % tp == 0 else whole[..., :total]


# The functions take the process group's name, not the mesh: torch.compile traces a string
# argument of an autograd Function, and a DeviceMesh one would break the graph at every layer.


class _Copy(torch.autograd.Function):
    """Identity forward; the gradient summed over the tp ranks (each rank's colwise shard
    contributes its part of the input's gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _Sum(torch.autograd.Function):
    """Partial results summed over the tp ranks; the gradient (the same on every rank, the
    sum being replicated) passes as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    """Each rank's slice of the last dim (of `total` entries in all: DTensor's shares),
    gathered whole; the gradient (the same on every rank) cut back to the rank's own slice."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: str, rank: int, tp: int, total: int
    ) -> torch.Tensor:
        ctx.start = rank * shard_step(total, tp)
        ctx.size = x.shape[-1]
        return _all_gather(x, group, tp, total)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return grad.narrow(-1, ctx.start, ctx.size), None, None, None, None


def copy_to_ranks(x: torch.Tensor, group: str, tp: int) -> torch.Tensor:
    """A replicated input that colwise shards consume: itself, its gradient (where one is
    recorded) summed over the `tp` ranks of `group` (a name as `group_name` gives it)."""
    if tp > 1 and torch.is_grad_enabled() and x.requires_grad:
        return _Copy.apply(x, group)
    return x


def group_name(mesh: DeviceMesh) -> str:
    """The name funcol knows a 1-D mesh's process group by (also a fake mesh's, check's)."""
    return resolve_group_name(mesh)


def _sum(x: torch.Tensor, group: str) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _Sum.apply(x, group)
    return _all_reduce(x, group)


def sum_over_ranks(x: torch.Tensor, group: str, tp: int) -> torch.Tensor:
    """Partial results summed over the `tp` ranks of `group`, the gradient passed as it is
    (Megatron's g); at tp 1, `x` itself."""
    return x if tp == 1 else _sum(x, group)


@dataclass(frozen=True)
class LocalRun:
    """How one layer runs on its local shards."""

    kind: Kind
    mesh: DeviceMesh
    transposed: bool = False
    """The weight is stored (in, out) (GPT-2's Conv1D)."""
    gather: bool = False
    """A colwise output gathered whole on every rank."""
    input_fn: Callable[..., Any] | None = None
    output_fn: Callable[..., Any] | None = None
    """The style's own functions, for a call handed a DTensor (the DTensor path)."""
    group: str = ""
    """The name funcol knows the mesh's process group by (set by `install`)."""
    tp: int = 1
    """The mesh's size (set by `install`)."""
    rank: Any = 0
    """This rank's index on the mesh (set by `install`): an int, or on simulated ranks each
    rank's own."""
    base_forward: Any = None
    """The known forward (nn.Linear's, ...) the layer's own is or extends (set by `install`):
    what a call handed a DTensor runs."""
    parts: tuple[int, ...] | None = None
    """A colwise layer's fused pieces of unequal sizes (q|k|v of grouped-query attention):
    it computes with a working copy of its own rows (own_rows.py)."""
    own: OwnRows | None = None
    """Those working copies (set by `install` where `parts` are unequal)."""
    unit: int | None = None
    """The head size of `parts` whose heads ranks share past their count (colwise
    `replicate_heads` with `parts`): each rank's copy holds its one head of such a part."""
    held: bool = False
    """Its unequal `parts` open a DTensor region: the output, its own rows, is handed on
    held in pieces (region_pieces.py)."""
    order: tuple[tuple[int, ...], ...] | None = None
    """Per rank, the rows it computes with (a colwise layer's output rows, a rowwise one's
    input columns): heads split unevenly (uneven_heads.py); a working copy of them is kept
    (own_rows.py)."""


def _forward_reason(module: nn.Module, kind: Kind, transposed: bool) -> str | None:
    """Why the local forward of `kind` would not compute what `module`'s own does."""
    forward = forward_of(module)
    want = {
        "lookup": ("embedding",),
        # an embedding split on its features (T5's relative position bias: heads) looks up
        # the rank's columns
        "colwise": ("linear", "conv1d", "embedding"),
        "rowwise": ("linear", "conv1d"),
    }
    if forward not in want[kind]:
        return f"its forward ({type(module).__name__}.forward) is not one whose computation tpplan knows"
    if (forward == "conv1d") != transposed:
        return "the rule's `transposed` does not match the layer's weight layout"
    if type(module).forward not in (nn.Linear.forward, nn.Embedding.forward) and any(
        n not in ("weight", "bias") for n, _ in module.named_parameters(recurse=False)
    ):
        return "its own forward may read parameters other than the weight and bias"
    return None


def local_run_reason(
    module: nn.Module,
    kind: Kind,
    *,
    transposed: bool,
    parts: tuple[int, ...] | None,
    input_layout: Any,
    output_layout: Any,
    local_output: bool,
    tp: int,
    unit: int | None = None,
) -> str | None:
    """Why `module` cannot run on its local shards under this rule (None: it can). At tp 1
    a forward tpplan does not know runs too: as it is, on its parameters' local tensors,
    which are the whole ones (`_whole`)."""
    reason = _forward_reason(module, kind, transposed)
    if reason is not None and tp > 1:
        return reason
    forward = forward_of(module)
    if any(isinstance(getattr(type(module), n, None), property) for n in ("weight", "bias")):
        return "its weight is computed (a parametrization), not a parameter"
    if forward == "embedding" and getattr(module, "max_norm", None) is not None:
        return "its lookup renormalizes rows in place (max_norm)"
    if forward == "embedding" and (module.scale_grad_by_freq or module.sparse):
        return "its gradient is scaled by id counts or sparse"
    # a fused output of unequal pieces handed on in a DTensor region: its own rows, held
    # in pieces (region_pieces.py)
    held = False
    if parts is not None and len(set(parts)) > 1:
        if kind != "colwise":
            return "its fused pieces are of unequal sizes (no local layout)"
        if not local_output:
            if output_layout not in (None, Shard(-1)):
                return "its fused pieces of unequal sizes stay DTensors (a DTensor region)"
            held = True
        if sum(parts) % tp:
            return f"its {sum(parts)} output features do not split {tp} ways"
        try:
            own_order(parts, tp, unit)
        except ValueError:
            shared = " (nor share whole heads among ranks)" if unit else ""
            return f"its fused pieces {list(parts)} do not all split {tp} ways{shared}"
    if not local_output and not held:
        return "its output stays a DTensor (a DTensor region)"
    want_in = Shard(-1) if kind == "rowwise" else Replicate()
    if input_layout not in (None, want_in):
        return f"its input arrives as {input_layout} (sequence parallel)"
    if kind == "colwise":
        if output_layout not in (None, Shard(-1)):
            if not isinstance(output_layout, Replicate):
                return f"its output is laid out as {output_layout}"
            if parts is not None:
                return "its fused output is gathered whole"
    elif output_layout not in (None, Replicate()):
        return f"its output is laid out as {output_layout} (sequence parallel)"
    return None


def install(module: nn.Module, run: LocalRun) -> None:
    """Replace `module`'s forward by its local-shard one (its parameters already split)."""
    # the group and rank are read once here: torch.compile traces neither lookup
    cls = type(module)
    found = known_base(cls)
    whole = _forward_reason(module, run.kind, run.transposed) is not None
    # local_run_reason said it can: a known forward, one extending it, or one of its own
    # proved to compute a Linear (whose own forward the local one replaces)
    assert found is not None or whole or forward_of(module) == "linear", cls
    base_forward = cls.forward if whole or found is None else found[0].__dict__["forward"]
    run = replace(
        run,
        group=group_name(run.mesh),
        rank=_rank(run.mesh),
        tp=run.mesh.size(),
        base_forward=base_forward,
    )
    if run.parts is not None and len(set(run.parts)) > 1 and run.tp > 1:
        run = replace(run, own=OwnRows(run.parts, run.mesh, run.group, unit=run.unit))
    elif run.order is not None and run.tp > 1:
        order = [list(rows) for rows in run.order]
        run = replace(run, own=OwnRows((), run.mesh, run.group, order=order))
    module._tpplan_local_run = run  # type: ignore[assignment]
    for p in module.parameters(recurse=False):
        if isinstance(p, DTensor):
            _static(p._local_tensor)
    forward = {"colwise": _colwise, "rowwise": _rowwise, "lookup": _lookup}[run.kind]
    if whole:
        assert run.tp == 1, (cls, run.tp)
        forward = _whole
    if cls.forward is base_forward:
        module.forward = forward.__get__(module)
        return
    # a forward extending the known one: it runs as it is, on plain tensors (its buffers,
    # made replicated DTensors by distribute_module, back to the whole tensors they were),
    # and its super() call reaches the local forward
    module.__class__ = local_class(cls, forward)
    for name, b in module._buffers.items():
        if isinstance(b, DTensor):
            module._buffers[name] = b.to_local()


def _run_of(module: nn.Module) -> LocalRun:
    return cast(LocalRun, module._tpplan_local_run)


def runs_locally(module: nn.Module) -> bool:
    """Whether `module` was given the local-shard forward."""
    return getattr(module, "_tpplan_local_run", None) is not None


def _dtensor_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The DTensor path for one call: the style's input function, the class's own forward
    on the DTensor parameters, the style's output function (what distribute_module's hooks
    would do)."""
    run: LocalRun = _run_of(module)
    if run.input_fn is not None:
        args = run.input_fn(module, args, run.mesh)
        args = args if isinstance(args, tuple) else (args,)
    out = run.base_forward(module, *args, **kwargs)
    return out if run.output_fn is None else run.output_fn(module, out, run.mesh)


def _local(p: Any) -> Any:
    """A parameter's local shard. Without grad, the DTensor's own local tensor: torch's
    `to_local` makes a view of it for a parameter on every call, and torch.compile then
    takes the plain tensor as the graph's input instead of unwrapping a DTensor per call.
    With grad, `to_local`, whose gradient flows back into the DTensor parameter."""
    if not isinstance(p, DTensor):
        return p
    if torch.is_grad_enabled():
        return p.to_local()
    local = p._local_tensor
    if not hasattr(local, "_dynamo_static_input_type") and not torch.compiler.is_compiling():
        _static(local)
    return local


def _static(t: torch.Tensor) -> None:
    """Tell torch.compile a local weight keeps its address, as a parameter does: CUDA graphs
    (`mode="reduce-overhead"`) then read it in place instead of copying every weight into
    the graph's inputs at each replay. A tensor replaced later (moved, loaded into new
    storage) is re-recorded, not read stale (torch's mark_static_address, unguarded)."""
    mark_static_address(t)


def _matmul(module: nn.Module, run: LocalRun, x: torch.Tensor, bias: Any) -> torch.Tensor:
    w = _local(module._parameters["weight"])
    return F.linear(x, w.t() if run.transposed else w, bias)


def _own_matmul(module: nn.Module, run: LocalRun, own: OwnRows, x: torch.Tensor) -> Any:
    """A fused layer of unequal pieces: its output features are this rank's slice of each
    piece, computed with the working copy of those rows (own_rows.py)."""
    w = own_rows(own, "weight", module._parameters["weight"], 1 if run.transposed else 0)
    bias = own_rows(own, "bias", module._parameters.get("bias"), 0)
    return F.linear(x, w.t() if run.transposed else w, bias)


def _colwise(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    run = _run_of(self)
    x = args[0] if len(args) == 1 and not kwargs else None
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
        return _dtensor_call(self, args, kwargs)
    if isinstance(self, nn.Embedding):
        out = F.embedding(x, _local(self._parameters["weight"]), self.padding_idx)
    else:
        x = copy_to_ranks(x, run.group, run.tp)
        if run.own is not None:
            out = _own_matmul(self, run, run.own, x)
            if not run.held:
                return out
            assert run.parts is not None
            shape = (*out.shape[:-1], sum(run.parts))
            if run.unit is None:
                return hold_in_pieces(out, run.mesh, run.parts, shape)
            # key/value heads shared among ranks: each its own head in every place
            filled, shared = whole_shared_pieces(out, run.parts, run.unit, run.mesh)
            return hold_in_pieces(filled, run.mesh, run.parts, shape, shared, run.unit)
        out = _matmul(self, run, x, _local(self._parameters.get("bias")))
    if not run.gather or run.tp == 1:
        return out
    whole = cast(torch.Tensor, self._parameters["weight"])  # global shape, split or not
    total = int(whole.shape[1 if isinstance(self, nn.Embedding) else 0])
    if torch.is_grad_enabled() and out.requires_grad:
        return _Gather.apply(out, run.group, run.rank, run.tp, total)
    return _all_gather(out, run.group, run.tp, total)


def _rowwise(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    run = _run_of(self)
    x = args[0] if len(args) == 1 and not kwargs else None
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
        return _dtensor_call(self, args, kwargs)
    bias = _local(self._parameters.get("bias"))
    if run.tp == 1:
        return _matmul(self, run, x, bias)
    if run.own is not None:
        # heads split unevenly: the working copy of this rank's heads' columns
        w = own_rows(run.own, "weight", self._parameters["weight"], 0 if run.transposed else 1)
        partial_out = F.linear(x, w.t() if run.transposed else w)
    else:
        partial_out = _matmul(self, run, x, None)
    out = _sum(partial_out, run.group)
    # the bias is whole on every rank: added once, to the sum
    return out if bias is None else out + bias


def _whole(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """At tp 1, a layer whose forward tpplan does not know: that forward, as it is, on its
    parameters' local tensors (whole at tp 1; a gradient flows back into the DTensors), put
    in the instance's __dict__ for the call, where attribute lookup finds them first."""
    if any(isinstance(a, DTensor) for a in (*args, *kwargs.values())):
        return _dtensor_call(self, args, kwargs)
    names = [n for n, p in self._parameters.items() if isinstance(p, DTensor)]
    for n in names:
        self.__dict__[n] = _local(self._parameters[n])
    try:
        return _run_of(self).base_forward(self, *args, **kwargs)
    finally:
        for n in names:
            self.__dict__.pop(n, None)


def _lookup(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    run = _run_of(self)
    ids = args[0] if len(args) == 1 and not kwargs else None
    if not isinstance(ids, torch.Tensor) or isinstance(ids, DTensor):
        return _dtensor_call(self, args, kwargs)
    weight = _local(self._parameters["weight"])
    emb: nn.Embedding = self  # type: ignore[assignment]
    if run.tp == 1:
        return F.embedding(ids, weight, emb.padding_idx)
    # this rank's rows are [start, start + rows): others' ids look up row 0, zeroed after
    vocab = int(emb.num_embeddings)
    local = ids - _start(run, vocab, ids.device)
    outside = (local < 0) | (local >= weight.shape[0])
    found = F.embedding(local.masked_fill(outside, 0), weight)
    if emb.padding_idx is not None:
        # padding_idx's row is looked up as it is but gets no gradient, as in nn.Embedding
        found = torch.where((ids == emb.padding_idx).unsqueeze(-1), found.detach(), found)
    return _sum(found.masked_fill(outside.unsqueeze(-1), 0), run.group)


def _start(run: LocalRun, rows: int, device: torch.device) -> Any:
    """The first row of this rank's share of `rows` (DTensor's: ceil(rows/tp) per rank, the
    last ranks what is left): on a real process group a number; on simulated ranks, whose
    ranks differ within one process, a tensor holding each rank's own (own_start)."""
    if isinstance(run.rank, int):
        return run.rank * shard_step(rows, run.tp)
    return own_start(rows, run.mesh, device)


def _rank(mesh: DeviceMesh) -> int:
    """This rank's index on the 1-D mesh: its coordinate, which the mesh also gives on fake
    meshes (check's) and, rank by rank, on simulated ones."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # a rank applying a plan is on its mesh
    return coordinate[0]
