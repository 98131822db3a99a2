"""Plan rules -> torch ParallelStyle objects, plus what torch lacks.

`plan_to_torch` is what `Plan.to_torch` calls. Every style maps onto torch's own
(ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput/Output) except the
cases built here on the same classes:
- `replicate_grad_sum`: `ReplicateGradSum`;
- `split_params`: `SplitParams`;
- `vocab_parallel` with `sum_at: lookup`: `SumAtLookup`;
- `vocab_parallel` with `written`: `WrittenRows`;
- fused colwise layers (`parts`): `Colwise` gives each rank its slice of each part, so a
  rank's output is its own q, k and v (or gate and up) laid end to end (tpplan/compile/strided.py);
- weights stored (in, out) (`transposed`, GPT-2's Conv1D): `Colwise` / `Rowwise` shard the
  other dim of the weight.

Every parameter stays a DTensor whose full tensor is the unsharded one (a fused one of equal
parts a `_StridedShard`), so torch's state-dict, optimizer and checkpoint APIs see the
unsharded model's layout.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from .._runtime.lookup import put_in_lookup_place
from ..errors import TpplanError
from ..plan.layouts import parse_layout
from ..plan.patterns import match_names
from .strided import equal_parts, fused_order, split_parts, teach_checkpoint_chunks

if TYPE_CHECKING:
    from ..plan.schema import Plan, Rule

__all__ = [
    "Colwise",
    "Experts",
    "ReplicateGradSum",
    "Rowwise",
    "SplitParams",
    "SumAtLookup",
    "WrittenRows",
    "placement",
    "plan_to_torch",
    "rule_to_style",
]


def placement(layout: str | None) -> Placement | None:
    """The DTensor placement a layout string names (None stays None)."""
    if layout is None:
        return None
    kind, dim = parse_layout(layout)
    if kind == "shard":
        assert dim is not None  # parse_layout always returns a dim for shard
        return Shard(dim)
    return Replicate() if kind == "replicate" else Partial()


def _placements(layouts: list[str | None] | None) -> tuple[Placement | None, ...] | None:
    return None if layouts is None else tuple(placement(x) for x in layouts)


class ReplicateGradSum(ParallelStyle):
    """Parameters kept whole on every rank, used inside a sharded region.

    Each rank sees only its own shard of the activations, so its gradient for such a
    parameter (a per-head q/k norm weight, say) is a partial sum; summing the gradients
    over the tp axis gives every rank the full gradient, so replicas never drift apart.
    The forward pass is untouched.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh

        def _sum(grad: Any) -> Any:
            return funcol.wait_tensor(funcol.all_reduce(grad, "sum", group))

        for p in module.parameters(recurse=False):
            if p.requires_grad:
                p.register_hook(_sum)
        return module

    def __repr__(self) -> str:
        return "ReplicateGradSum()"


# ---- fused and transposed weights -----------------------------------------------------------


def _distribute(
    module: nn.Module,
    name: str,
    mesh: DeviceMesh,
    dim: int,
    parts: tuple[int, ...] | None,
    src_data_rank: int | None,
) -> None:
    """Split the parameter `name` of `module` (dotted for a child's) along `dim`; with equal
    fused `parts`, as each rank's slice of each part (a `_StridedShard`, see
    tpplan/compile/strided.py). Either way the parameter's full tensor is the original one."""
    path, _, name = name.rpartition(".")
    module = module.get_submodule(path)
    param = getattr(module, name)
    if parts is not None and equal_parts(parts):
        teach_checkpoint_chunks()
        data = split_parts(param, mesh, dim, parts, src_data_rank)
    else:
        data = distribute_tensor(param, mesh, [Shard(dim)], src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(data, param.requires_grad))


def _own_parts(parts: tuple[int, ...], mesh: DeviceMesh, device: torch.device) -> torch.Tensor:
    """The features of a whole fused output that make this rank's slice of each part, in
    order (each rank's own index, also on simulated ranks)."""
    order = torch.tensor(fused_order(parts, mesh.size()), device=device)
    return distribute_tensor(order, mesh, [Shard(0)], src_data_rank=None).to_local()


def _output(
    layouts: tuple[Placement, ...],
    local: bool,
    parts: tuple[int, ...] | None,
    mod: nn.Module,
    out: DTensor,
    mesh: DeviceMesh,
) -> Any:
    if parts is not None and not isinstance(layouts[0], Replicate):
        if not local:
            raise TpplanError(
                "a fused colwise layer (parts) hands each rank its slice of every part as a "
                "plain tensor; drop local_output: false from its rule."
            )
        if equal_parts(parts):
            # its weight is a _StridedShard: the local output already holds this rank's
            # slice of each part, in order
            return out.to_local()
        # pieces of unequal sizes are no DTensor layout: the weight is a plain Shard of the
        # original, so this rank's features are gathered and its slices picked out; the
        # gradient is partial (each rank's picks only), summed back to the shards
        whole = out.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        return whole.index_select(-1, _own_parts(parts, mesh, whole.device))
    if out.placements != layouts:
        out = out.redistribute(placements=layouts)
    if local and isinstance(layouts[0], Replicate) and torch.is_grad_enabled():
        # a gathered output handed back as its own tensor, so that the model may change it
        # in place (Gemma 3n); see `Rowwise`
        return out.to_local().clone()
    return out.to_local() if local else out


class Colwise(ColwiseParallel):
    """ColwiseParallel for fused layers (`parts`) and (in, out) weights (`transposed`).

    The output is split over its last dim like torch's: with parts, rank r's output holds
    rank r's slice of each part in order, which is what a model splitting the output into
    parts by sizes divided per rank (or into equal chunks) expects.
    """

    def __init__(
        self, *, parts: list[int] | None = None, transposed: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.parts = tuple(parts) if parts else None
        self.transposed = transposed

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        src = self.src_data_rank
        _distribute(module, "weight", mesh, 1 if self.transposed else 0, self.parts, src)
        if getattr(module, "bias", None) is not None:
            _distribute(module, "bias", mesh, 0, self.parts, src)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(_output, self.output_layouts, self.use_local_output, self.parts),
        )

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, parts={self.parts}, transposed={self.transposed})"


class Rowwise(RowwiseParallel):
    """RowwiseParallel for Linear-like layers, also with weights stored (in, out) (their dim
    0 is contracted), whose local output may be changed in place.

    torch hands back the local output of a DTensor through an autograd Function that returns
    it as a view, and autograd forbids changing such a view in place: a model that adds a
    residual in place (Falcon's `mlp_output += attention_output`) cannot train. While grad
    is recorded the output is handed back as its own tensor (one copy, beside the all-reduce
    that made it).
    """

    def __init__(self, *, transposed: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.transposed = transposed

    def _partition_linear_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _distribute(module, "weight", mesh, 0 if self.transposed else 1, None, self.src_data_rank)
        bias = getattr(module, "bias", None)
        if isinstance(bias, nn.Parameter):
            replicated = distribute_tensor(
                bias, mesh, [Replicate()], src_data_rank=self.src_data_rank
            )
            module.register_parameter("bias", nn.Parameter(replicated, bias.requires_grad))

    @staticmethod
    def _own_output(layouts: Any, local: bool, mod: nn.Module, out: DTensor, mesh: Any) -> Any:
        out = RowwiseParallel._prepare_output_fn(layouts, local, mod, out, mesh)
        return out.clone() if local and torch.is_grad_enabled() else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._own_output, self.output_layouts, self.use_local_output),
        )


# ---- a table whose forward does more than look up -------------------------------------------
class _SumAtLookup(nn.Embedding):
    """nn.Embedding's place in a split table's class order: the lookup of this rank's rows,
    summed over the tp ranks as it returns, so what the subclass's forward does next (a norm,
    rows overwritten) sees whole rows."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        assert isinstance(weight, DTensor)  # SumAtLookup split it
        mesh = weight.device_mesh
        ids = DTensor.from_local(input, mesh, [Replicate()], run_check=False)
        partial_rows = nn.Embedding.forward(self, ids)
        assert isinstance(partial_rows, DTensor)
        rows = partial_rows.redistribute(mesh, [Replicate()]).to_local()
        # its own tensor while grad is recorded, so the forward may change it in place
        return rows.clone() if torch.is_grad_enabled() else rows


class SumAtLookup(ParallelStyle):
    """vocab_parallel with `sum_at: lookup`: the weight split by rows like torch's
    RowwiseParallel on an Embedding, and the module's class given `_SumAtLookup` in the place
    of nn.Embedding, where the subclass's `super().forward(ids)` looks up (the way torch's
    parametrizations give a module a class of its own). The module keeps its name, its
    parameters' names and every other method; its input and output stay plain tensors.
    tpplan infers it only where the trace saw every lookup of the table made through that
    place."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TpplanError(
                f"sum_at: lookup applies to Embedding modules, not {type(module).__name__}."
            )
        _distribute(module, "weight", device_mesh, 0, None, self.src_data_rank)
        put_in_lookup_place(module, _SumAtLookup)
        return module


class _LocalLookup(nn.Embedding):
    """nn.Embedding's place in a split table's class order: this rank's partial rows, as a
    plain tensor. Ids in this rank's share of the vocab get their rows, the others zeros."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        assert isinstance(weight, DTensor)  # WrittenRows split it
        local = weight.to_local()
        first = _own_start(self.num_embeddings, weight.device_mesh, input.device)
        at = input - first
        mine = (at >= 0) & (at < local.shape[0])
        rows = F.embedding(torch.where(mine, at, torch.zeros_like(at)), local)
        rows = rows * mine.unsqueeze(-1).to(rows.dtype)
        if self.padding_idx is not None:  # its row is looked up but never trained
            padding = (input == self.padding_idx).unsqueeze(-1)
            rows = torch.where(padding, rows.detach(), rows)
        return rows


def _own_start(n: int, mesh: DeviceMesh, device: torch.device) -> torch.Tensor:
    """Where this rank's share of `n` entries split by `Shard` starts (a 1-element tensor;
    each rank's own without a collective, also on simulated ranks)."""
    step = -(-n // mesh.size())
    starts = torch.arange(mesh.size(), device=device) * step
    return distribute_tensor(starts, mesh, [Shard(0)], src_data_rank=None).to_local()


def _padded(param: DTensor) -> torch.Tensor:
    """This rank's share of a parameter split along its last dim, in place within zeros of
    the whole parameter's shape: summed over the ranks, the whole parameter."""
    local = param.to_local()
    start = _own_start(param.shape[-1], param.device_mesh, local.device)
    at = start + torch.arange(local.shape[-1], device=local.device)
    return local.new_zeros(param.shape).index_copy(-1, at, local)


class WrittenRows(ParallelStyle):
    """vocab_parallel with `written`: the weight split by rows like torch's RowwiseParallel on
    an Embedding, and the parameters the module's forward writes over looked-up rows
    (`written`) split along their last dim. The module's own forward then runs on each
    rank's partial rows as plain tensors (`_LocalLookup` in nn.Embedding's place, found by
    its `super().forward(ids)`), with each written parameter seen as its rank's share padded
    with zeros (put in the module's `__dict__` for the call); one sum of the output, an
    all-reduce (or a reduce-scatter to `output_layouts`), adds up rows and writes alike.
    tpplan infers it only where the trace saw every op from the lookup to the output linear
    in the rows, and the parameters written as they are."""

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

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TpplanError(f"written applies to Embedding modules, not {type(module).__name__}.")
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise TpplanError(
                "vocab_parallel with written looks each rank's rows up on its own, which "
                "max_norm, scale_grad_by_freq and sparse gradients do not allow; keep the "
                "table whole (style: replicate)."
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
        _distribute(module, "weight", device_mesh, 0, None, self.src_data_rank)
        for name in self.written:
            _distribute(module, name, device_mesh, own[name].dim() - 1, None, self.src_data_rank)
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
        return f"WrittenRows(written={self.written}, output={self.output_layout})"


# ---- mixture-of-experts ---------------------------------------------------------------------
class SplitParams(ParallelStyle):
    """Parameters of the module itself split along a dim (`shard`), and used in its forward
    as each rank's own part: a per-head attention sink, met element by element by the heads
    the colwise layers around split, so rank r needs exactly its heads' entries.

    The local parts are put in the module's `__dict__` for the call (attribute lookup finds
    them before the DTensor parameters); their gradients flow back into the rank's shard.
    """

    def __init__(self, *, shard: dict[str, int]) -> None:
        super().__init__()
        self.shard = dict(shard)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, dim in self.shard.items():
            _distribute(module, name, device_mesh, dim, None, 0)

        def before(mod: nn.Module, args: Any) -> None:
            for name in self.shard:
                p = mod._parameters[name]
                assert isinstance(p, DTensor)  # made one at apply
                mod.__dict__[name] = p.to_local()

        def after(mod: nn.Module, args: Any, out: Any) -> None:
            for name in self.shard:
                mod.__dict__.pop(name, None)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after, always_call=True)
        return module

    def __repr__(self) -> str:
        return f"SplitParams(shard={self.shard})"


class Experts(ParallelStyle):
    """A module holding every expert's weights as 3-D parameters (experts first), whose
    forward takes the tokens, the routing (expert ids per token, an integer tensor) and the
    routing weights, and returns the weighted sum of the chosen experts' outputs.

    torch has no style for it, so this one runs the module's own forward on each rank's local
    weights (put in the module's `__dict__` for the call, where attribute lookup finds them
    before the DTensor parameters) and makes the result exact with DTensor:

    - the floating-point inputs enter as Replicate and leave as local tensors whose gradient
      is a partial sum (so backward all-reduces it, Megatron's `f`);
    - the output is each rank's partial sum, all-reduced into the whole (Megatron's `g`);
    - mode `tensor`: the `shard` weights are split by features (gate|up `fused` pieces rank
      by rank), so each rank's experts compute a slice of every expert's hidden layer; a
      parameter added after the down projection (`after_sum`) is added as 1/tp per rank,
      and so is the output of a parameter-free submodule added whole to the experts' sum
      (`added_whole`, an identity expert): each rank makes it in full, without the split
      weights, so unscaled the all-reduce would count it tp times;
    - mode `expert`: the weights are split by experts; each rank renumbers the routing to its
      own experts and zeroes the routing weight of tokens sent to other ranks' experts.

    Replicated parameters of the module (and of its children) are used on each rank's share
    of the work, so their gradients are declared partial and summed as well.
    """

    def __init__(
        self,
        *,
        mode: str = "tensor",
        shard: dict[str, int],
        fused: dict[str, list[int]] | None = None,
        after_sum: list[str] | None = None,
        added_whole: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.mode = mode
        self.shard = dict(shard)
        self.fused = {k: tuple(v) for k, v in (fused or {}).items()}
        self.after_sum = tuple(after_sum or ())
        self.added_whole = tuple(added_whole or ())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        mesh = device_mesh
        tp = mesh.size()
        for name, dim in self.shard.items():
            _distribute(module, name, mesh, dim, self.fused.get(name), 0)
        held: list[tuple[nn.Module, str, str]] = []  # (owner, parameter, how it is used)
        for path, owner in module.named_modules():
            for pname, p in list(owner._parameters.items()):
                if p is None:
                    continue
                full = f"{path}.{pname}" if path else pname
                if full in self.shard:
                    held.append((owner, pname, "split"))
                    continue
                if not isinstance(p, DTensor):
                    whole = distribute_tensor(p.detach(), mesh, [Replicate()], src_data_rank=0)
                    owner.register_parameter(pname, nn.Parameter(whole, p.requires_grad))
                added = full in self.after_sum
                held.append((owner, pname, "after_sum" if added else "replicated"))
        n_experts = module.get_parameter(next(iter(self.shard))).shape[0]
        for child in self.added_whole:
            # the submodule is called inside the module's forward only, on local tensors;
            # its gradient is scaled alike, and the ranks' shares are summed at the inputs
            module.get_submodule(child).register_forward_hook(
                lambda mod, args, out: _tree_map_tensors(lambda x: x / tp, out)
            )

        def before(mod: nn.Module, args: Any, kwargs: Any) -> Any:
            for owner, pname, how in held:
                p = owner._parameters[pname]
                assert isinstance(p, DTensor)  # made one at apply
                if how == "split":
                    local = p.to_local()
                else:
                    local = p.to_local(grad_placements=[Partial()])
                    if how == "after_sum":
                        local = local / tp
                owner.__dict__[pname] = local
            args, kwargs = _tree_map_tensors(lambda x: _enter(x, mesh), (args, kwargs))
            if self.mode == "expert":
                args, kwargs = _own_experts(args, kwargs, n_experts, mesh)
            return args, kwargs

        def after(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
            return _tree_map_tensors(lambda x: _sum_partial(x, mesh), out)

        def clean(mod: nn.Module, args: Any, out: Any) -> None:
            for owner, pname, _ in held:
                owner.__dict__.pop(pname, None)

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)
        module.register_forward_hook(clean, always_call=True)
        module.__dict__[EXPERTS_MARK] = self.mode
        return module

    def __repr__(self) -> str:
        return (
            f"Experts(mode={self.mode}, shard={self.shard}, fused={self.fused}, "
            f"after_sum={self.after_sum}, added_whole={self.added_whole})"
        )


# On a module split by Experts: its mode. What its submodules compute is each rank's share
# of the experts' work, not a slice of the unsharded values.
EXPERTS_MARK = "_tpplan_experts"


def _tree_map_tensors(fn: Any, tree: Any) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(
        lambda x: fn(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree
    )


def _enter(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The same values on every rank; backward sums the ranks' partial gradients."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    elif x.placements != (Replicate(),):
        x = x.redistribute(placements=[Replicate()])
    return x.to_local(grad_placements=[Partial()])


def _sum_partial(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    partial_sum = DTensor.from_local(x, mesh, [Partial()], run_check=False)
    return partial_sum.redistribute(placements=[Replicate()]).to_local()


def _own_experts(args: Any, kwargs: Any, n_experts: int, mesh: DeviceMesh) -> tuple[Any, Any]:
    """Routing renumbered to this rank's experts; tokens routed elsewhere get weight 0."""
    leaves = [(k, v) for k, v in enumerate(args)] + list(kwargs.items())
    ids = [(k, v) for k, v in leaves if isinstance(v, torch.Tensor) and not v.is_floating_point()]
    if len(ids) != 1:
        raise TpplanError(
            "experts with mode expert needs exactly one integer tensor input (the expert chosen "
            f"for each token); this module got {len(ids)}. Use mode tensor for it."
        )
    where, index = ids[0]
    weights = [
        (k, v)
        for k, v in leaves
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == index.shape
    ]
    if len(weights) != 1:
        raise TpplanError(
            "experts with mode expert needs exactly one floating-point input shaped like the "
            f"routing {tuple(index.shape)} (the routing weights); this module got "
            f"{len(weights)}. Use mode tensor for it."
        )
    w_where, w = weights[0]
    every = torch.arange(n_experts, device=index.device)
    first = distribute_tensor(every, mesh, [Shard(0)], src_data_rank=None).to_local()[:1]
    local = index - first
    mine = (local >= 0) & (local < n_experts // mesh.size())
    found = {
        where: torch.where(mine, local, torch.zeros_like(local)),
        w_where: w * mine.to(w.dtype),
    }
    new_args = tuple(found.get(i, a) for i, a in enumerate(args))
    new_kwargs = {k: found.get(k, v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def rule_to_style(rule: Rule) -> ParallelStyle | None:
    """The style object for one rule; None for `replicate` (the module is left alone)."""
    kw: dict[str, Any] = {}
    if rule.local_output is not None:
        kw["use_local_output"] = rule.local_output
    if rule.style in ("colwise", "rowwise", "vocab_parallel"):
        if rule.input is not None:
            kw["input_layouts"] = placement(rule.input)
        elif rule.style == "vocab_parallel":
            kw["input_layouts"] = Replicate()
        if rule.output is not None:
            kw["output_layouts"] = placement(rule.output)
        if rule.style == "colwise" and (rule.parts or rule.transposed or rule.output):
            return Colwise(parts=rule.parts, transposed=bool(rule.transposed), **kw)
        if rule.style == "rowwise":
            return Rowwise(transposed=bool(rule.transposed), **kw)
        if rule.sum_at == "lookup":
            return SumAtLookup()
        if rule.written is not None:
            return WrittenRows(
                written=rule.written,
                output_layouts=kw.get("output_layouts"),
                use_local_output=kw.get("use_local_output", True),
            )
        return ColwiseParallel(**kw) if rule.style == "colwise" else RowwiseParallel(**kw)
    if rule.style == "sequence_parallel":
        _, dim = parse_layout(rule.input or "shard(1)")
        return SequenceParallel(sequence_dim=dim if dim is not None else 1, **kw)
    if rule.style == "prepare":
        return _prepare(rule)
    if rule.style == "replicate_grad_sum":
        return ReplicateGradSum()
    if rule.style == "split_params":
        assert rule.shard is not None  # the rule's validator requires it
        return SplitParams(shard=rule.shard)
    if rule.style == "experts":
        assert rule.shard is not None  # the rule's validator requires it
        return Experts(
            mode=rule.mode or "tensor",
            shard=rule.shard,
            fused=rule.fused,
            after_sum=rule.after_sum,
            added_whole=rule.added_whole,
        )
    return None  # replicate


def _prepare(rule: Rule) -> ParallelStyle:
    has_in = any(
        x is not None
        for x in (rule.inputs, rule.desired_inputs, rule.input_kwargs, rule.desired_input_kwargs)
    )
    has_out = rule.outputs is not None or rule.desired_outputs is not None
    ins: dict[str, Any] = {
        "input_layouts": _placements(rule.inputs),
        "desired_input_layouts": _placements(rule.desired_inputs),
        "input_kwarg_layouts": {k: placement(v) for k, v in (rule.input_kwargs or {}).items()}
        or None,
        "desired_input_kwarg_layouts": {
            k: placement(v) for k, v in (rule.desired_input_kwargs or {}).items()
        }
        or None,
    }
    outs: dict[str, Any] = {
        "output_layouts": _placements(rule.outputs),
        "desired_output_layouts": _placements(rule.desired_outputs),
    }
    local_out: dict[str, Any] = (
        {} if rule.local_output is None else {"use_local_output": rule.local_output}
    )
    if has_in and has_out:
        local_in: dict[str, Any] = (
            {} if rule.local_input is None else {"use_local_input": rule.local_input}
        )
        return PrepareModuleInputOutput(**ins, **outs, **local_in, **local_out)
    if has_out:
        return PrepareModuleOutput(**outs, **local_out)
    local_in_only: dict[str, Any] = (
        {} if rule.local_input is None else {"use_local_output": rule.local_input}
    )
    return PrepareModuleInput(**ins, **local_in_only)


def plan_to_torch(plan: Plan, model: nn.Module) -> dict[str, ParallelStyle]:
    """{full module name: style} in the model's module order, every rule expanded."""
    names = [n for n, _ in model.named_modules() if n]
    by_name: dict[str, ParallelStyle] = {}
    for rule in plan.rules:
        style = rule_to_style(rule)
        if style is None:
            continue
        for name in match_names(rule.match, names):
            by_name[name] = style
    return {n: by_name[n] for n in names if n in by_name}
