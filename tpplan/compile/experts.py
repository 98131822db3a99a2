"""Mixture-of-experts modules that hold every expert's weights in 3-D parameters, split by
features (mode `tensor`) or by experts (mode `expert`).

torch has no style for them: `Experts` runs the module's own forward on each rank's local
weights and makes the result exact with DTensor at the module's inputs and output (Megatron's
`f` and `g`). Start at `Experts`; the helpers below it move tensors in and out of the
module's forward. `EXPERTS_MARK` tells `tpplan verify` which modules compute each rank's
share of the experts' work rather than a slice of the unsharded values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle

from .._runtime.torch_compat import tree_map
from ..errors import TpplanError
from .local_run import copy_to_ranks, group_name, sum_over_ranks
from .params import own_start, split_param

__all__ = ["EXPERTS_MARK", "Experts"]

# On a module split by Experts: its mode. What its submodules compute is each rank's share
# of the experts' work, not a slice of the unsharded values.
EXPERTS_MARK = "_tpplan_experts"

# (module holding the parameter, parameter name, how the forward uses it: "split",
# "replicated" or "after_sum")
_Held = tuple[nn.Module, str, str]


class Experts(ParallelStyle):
    """A module holding every expert's weights as 3-D parameters (experts first), whose
    forward takes the tokens, the routing (expert ids per token, an integer tensor) and the
    routing weights, and returns the weighted sum of the chosen experts' outputs.

    This style runs the module's own forward on each rank's local weights (put in the
    module's `__dict__` for the call, where attribute lookup finds them before the DTensor
    parameters) and makes the result exact with DTensor:

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

    Keyword Args:
        mode: "tensor" (split by features) or "expert" (split by experts).
        shard: parameter (dotted for a child's) -> the dim it is split on.
        fused: parameter -> sizes of the pieces laid end to end along its split dim.
        after_sum: parameters added to the experts' output after the down projection.
        added_whole: submodules whose output the forward adds whole to the experts' sum.

    Example::
        >>> style = Experts(shard={"gate_up_proj": 2, "down_proj": 1}, fused={"gate_up_proj": [8, 8]})
        >>> parallelize_module(model, mesh, {"layers.0.mlp.experts": style})
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

    def _hold(self, module: nn.Module, mesh: DeviceMesh) -> list[_Held]:
        """Split the `shard` parameters, make every other one of the module and its children
        a replicated DTensor, and say how the forward uses each."""
        for name, dim in self.shard.items():
            split_param(module, name, mesh, dim, self.fused.get(name), 0)
        held: list[_Held] = []
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
        return held

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        mesh = device_mesh
        tp = mesh.size()
        group = group_name(mesh)
        held = self._hold(module, mesh)
        n_experts = module.get_parameter(next(iter(self.shard))).shape[0]
        for child in self.added_whole:
            # the submodule is called inside the module's forward only, on local tensors;
            # its gradient is scaled alike, and the ranks' shares are summed at the inputs
            module.get_submodule(child).register_forward_hook(
                lambda mod, args, out: _tree_map_tensors(lambda x: x / tp, out)
            )

        # per call, what puts this rank's rows of the output back in the tokens' order
        undo: list[Any] = []

        def before(mod: nn.Module, args: Any, kwargs: Any) -> Any:
            for owner, pname, how in held:
                owner.__dict__[pname] = _local(owner._parameters[pname], how, tp)
            if tp > 1 or _has_dtensor((*args, *kwargs.values())):
                # at tp 1 a plain input enters as it is: no tree walk per call
                args, kwargs = _tree_map_tensors(lambda x: _enter(x, mesh, group), (args, kwargs))
            if self.mode == "expert":
                args, kwargs, back = _own_experts(args, kwargs, n_experts, mesh)
                undo.append(back)
            return args, kwargs

        def after(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
            if undo:
                out = _tree_map_tensors(undo.pop(), out)
            return (
                out if tp == 1 else _tree_map_tensors(lambda x: sum_over_ranks(x, group, tp), out)
            )

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


def _local(p: Any, how: str, tp: int) -> torch.Tensor:
    """What the module's forward sees of a held parameter on this rank: its shard, or the
    whole one with a partial gradient (1/tp of it when added after the sum)."""
    assert isinstance(p, DTensor)  # made one at apply
    if how == "split":
        return p.to_local()
    local = p.to_local(grad_placements=[Partial()])
    return local / tp if how == "after_sum" and tp > 1 else local


def _has_dtensor(values: Any) -> bool:
    """Whether any of `values`, or of the tuples and lists among them, is a DTensor."""
    return any(
        isinstance(v, DTensor) or (isinstance(v, (tuple, list)) and _has_dtensor(v)) for v in values
    )


def _tree_map_tensors(fn: Any, tree: Any) -> Any:
    """`fn` applied to every floating-point tensor in `tree`; the rest as it is."""
    return tree_map(
        lambda x: fn(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree
    )


def _enter(x: torch.Tensor, mesh: DeviceMesh, group: str) -> torch.Tensor:
    """The same values on every rank; backward sums the ranks' partial gradients (direct
    collectives on a plain tensor: a DTensor per call costs a decode step more host time
    than the experts' matmuls)."""
    if not isinstance(x, DTensor):
        return copy_to_ranks(x, group, mesh.size())
    if x.placements != (Replicate(),):
        x = x.redistribute(placements=[Replicate()])
    return x.to_local(grad_placements=[Partial()])


def _own_experts(args: Any, kwargs: Any, n_experts: int, mesh: DeviceMesh) -> tuple[Any, Any, Any]:
    """Routing renumbered to this rank's experts; tokens routed elsewhere get weight 0. Or,
    given tokens grouped by expert and a count per expert, this rank's groups. With what
    maps each output tensor back to the tokens' order (zeros where other ranks' experts
    ran)."""
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
    if not weights and index.dim() == 1 and index.shape[0] == n_experts:
        return _own_groups(args, kwargs, leaves, where, index, mesh)
    if len(weights) != 1:
        raise TpplanError(
            "experts with mode expert needs exactly one floating-point input shaped like the "
            f"routing {tuple(index.shape)} (the routing weights); this module got "
            f"{len(weights)}. Use mode tensor for it."
        )
    w_where, w = weights[0]
    first = own_start(n_experts, mesh, index.device)
    local = index - first
    mine = (local >= 0) & (local < n_experts // mesh.size())
    found = {
        where: torch.where(mine, local, torch.zeros_like(local)),
        w_where: w * mine.to(w.dtype),
    }
    new_args = tuple(found.get(i, a) for i, a in enumerate(args))
    new_kwargs = {k: found.get(k, v) for k, v in kwargs.items()}
    return new_args, new_kwargs, lambda x: x


def _own_groups(
    args: Any, kwargs: Any, leaves: list[Any], where: Any, counts: torch.Tensor, mesh: DeviceMesh
) -> tuple[Any, Any, Any]:
    """Tokens grouped by expert (rows in expert order, `counts[e]` of expert e): this rank's
    groups rolled to the front with only its experts' counts; the output is rolled back with
    the other rows zeroed (the forward leaves them padding, or unwritten). No host sync."""
    tokens = [(k, v) for k, v in leaves if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if len(tokens) != 1 or tokens[0][1].dim() != 2:
        raise TpplanError(
            "experts with mode expert given counts per expert need exactly one 2-D "
            f"floating-point input (the tokens grouped by expert); this module got {len(tokens)}."
        )
    x_where, x = tokens[0]
    n = x.shape[0]
    per = counts.shape[0] // mesh.size()
    first = own_start(counts.shape[0], mesh, counts.device)  # (1,)
    mine = first + torch.arange(per, device=counts.device)  # (per,)
    start = (torch.cumsum(counts, 0) - counts)[first]  # (1,) row where this rank's groups start
    rows = torch.arange(n, device=x.device)  # (n,)
    order = (rows + start) % n  # this rank's rows first
    kept = (rows < counts[mine].sum())[:, None]  # (n, 1)
    back = (rows - start) % n
    # rows past this rank's groups are none of its experts' tokens: the grouped matmul leaves
    # their outputs, and in the backward their gradients, unwritten; `where` keeps whatever
    # is there out of the tokens' gradients both ways
    found = {where: counts[mine], x_where: torch.where(kept, x[order], torch.zeros_like(x))}
    new_args = tuple(found.get(i, a) for i, a in enumerate(args))
    new_kwargs = {k: found.get(k, v) for k, v in kwargs.items()}

    def unroll(out: torch.Tensor) -> torch.Tensor:
        if out.dim() != 2 or out.shape[0] != n:
            raise TpplanError(
                f"experts with mode expert given counts per expert must return one row per "
                f"token ({n}); this module returned {tuple(out.shape)}."
            )
        return torch.where(kept, out, torch.zeros_like(out))[back]

    return new_args, new_kwargs, unroll
