"""What a plan does to a zoo model, measured on simulated ranks with real numbers: the
parameters each rank holds, the forward output against the unsharded model's, and the
collectives each attention and MLP block runs in its forward.

A block is split the Megatron way when its forward runs no all-gather (the split it opens
is closed by a reduction, never by gathering the activations back; counted on a second
call, after any weight rows a fused layer of unequal pieces copies once, which are
reported apart) and at least one of its
Linear weights (or 1x1 convolutions', ConvNeXt's MLP) is sharded (a block kept whole also gathers nothing). Judged without sequence
parallel, where the only all-gathers are the ones a plan chose. A block that is attention
and MLP at once (Flux's single-stream block) leaves out the collectives of what its entry
sets apart (`Entry.apart`: its timestep modulation).

Start at `measure`.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode

import tpplan
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan.plan import Plan

from .models import Inputs

__all__ = ["Measured", "block_names", "measure", "output_tensor"]


@dataclass(frozen=True)
class Measured:
    """One plan applied at one tp size."""

    blocks: dict[str, str]
    """{module path: kind} of the model's attention and MLP blocks (`block_names`)."""
    param_fraction: float
    """Parameter bytes the most loaded rank holds, over the unsharded model's."""
    forward_error: float
    """Max abs difference of the output from the unsharded model's, over the ranks."""
    collectives: dict[str, dict[str, int]]
    """{block: {kind: count}} of each block's forward ("all_reduce", "all_gather_into_tensor"),
    counted on the second call: what every call pays."""
    weight_gathers: dict[str, int]
    """{block: all-gathers its first call made and its second did not}: a fused layer of
    unequal pieces gathers its own rows of the weight once per change of the weight
    (compile/own_rows.py), at inference once, in training once per optimizer step."""
    sharded: frozenset[str]
    """The blocks with at least one sharded Linear weight."""

    def megatron(self, block: str) -> bool:
        """Whether `block` is split the Megatron way (see the module docstring)."""
        gathers = any(kind.startswith("all_gather") for kind in self.collectives[block])
        return block in self.sharded and not gathers


def block_names(model: nn.Module, patterns: dict[str, str]) -> dict[str, str]:
    """{module path: its kind} of every module a pattern matches in full."""
    out = {}
    for name, _ in model.named_modules():
        for kind, pattern in patterns.items():
            if re.fullmatch(pattern, name):
                out[name] = kind
    return out


def output_tensor(out: object) -> torch.Tensor:
    """The tensor a model's output holds: the first of a tuple (diffusers' `return_dict=False`)
    or of a Hugging Face ModelOutput (its logits)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return output_tensor(out[0])
    return output_tensor(out.to_tuple())  # type: ignore[attr-defined]


def _run(model: nn.Module, x: Inputs) -> torch.Tensor:
    return output_tensor(model(**x) if isinstance(x, dict) else model(x))


def _is_sharded(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    # _StridedShard (a fused layer cut in parts) is a Shard too
    return isinstance(w, DTensor) and any(isinstance(p, Shard) for p in w.placements)


def _bytes_per_rank(model: nn.Module) -> int:
    """Parameter bytes the most loaded simulated rank holds (tied parameters once)."""
    total = 0
    for p in model.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        total += max(v.numel() for v in rank_values(local)) * p.element_size()
    return total


def _comm_mode() -> CommDebugMode:
    """CommDebugMode whose per-module counts survive a module called more than once in one
    forward (the one SiLU a diffusers resnet applies three times). torch 2.13's tracker
    registers a forward hook on every call of a module, so the module's next call leaves
    its parents' stack one pop short per extra hook, and the forward fails on an empty
    stack; here each call first drops the hook its previous call left."""
    mode = CommDebugMode()
    tracker = mode.advanced_module_tracker
    first = tracker._fw_pre_hook
    handles = tracker.register_forward_hook_handles

    def pre_hook(mod: nn.Module, args: object) -> None:
        old = handles.get(tracker._get_mod_name(mod))
        first(mod, args)
        if old is not None and handles.get(tracker._get_mod_name(mod)) is not old:
            old.remove()

    tracker._fw_pre_hook = pre_hook  # type: ignore[method-assign]
    return mode


def measure(
    model: nn.Module,
    plan: Plan,
    tp: int,
    x: Inputs,
    blocks: dict[str, str],
    apart: str | None = None,
) -> Measured:
    """Apply `plan` to a copy of `model` on `tp` simulated ranks and run one forward on `x`,
    counting each block's collectives (`blocks`: {kind: module path regex}) but those of
    the modules inside it that `apart` matches (`Entry.apart`)."""
    names = block_names(model, blocks)
    with torch.no_grad():
        want = _run(copy.deepcopy(model), x)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        fraction = _bytes_per_rank(sharded) / whole
        # gradients on, as in training: the forward a plan is judged by is that one; the
        # first call may copy weight rows once (own_rows.py), the second is every call's
        with _comm_mode() as first:
            got = rank_values(_run(sharded, x))
        with _comm_mode() as comms:
            _run(sharded, x)
        split = frozenset(
            name
            for name in names
            if any(
                isinstance(m, (nn.Linear, nn.Conv2d)) and _is_sharded(m)
                for m in sharded.get_submodule(name).modules()
            )
        )
    others = [n for n, _ in model.named_modules() if apart and re.fullmatch(apart, n)]
    collectives = _per_block(comms, type(model).__name__, names, others)
    once = _per_block(first, type(model).__name__, names, others)
    weight_gathers = {
        name: sum(n for k, n in once[name].items() if k.startswith("all_gather"))
        - sum(n for k, n in collectives[name].items() if k.startswith("all_gather"))
        for name in names
    }
    error = max((v.detach() - want).abs().max().item() for v in got)
    return Measured(names, fraction, error, collectives, weight_gathers, split)


def _per_block(
    comms: CommDebugMode, root: str, names: dict[str, str], others: list[str]
) -> dict[str, dict[str, int]]:
    """{block: {kind: count}} of one forward, less those of the modules in `others`."""
    # CommDebugMode names a module by its path under the root class's name and counts a
    # collective in every module around it; a block that did not run is missing
    counts = {
        fqn.removeprefix(f"{root}."): per.get("forward", {})
        for fqn, per in comms.comm_module_counts.items()
    }
    collectives = {}
    for name in names:
        kinds: dict[str, int] = {}
        for op, n in counts.get(name, {}).items():
            less = sum(counts.get(o, {}).get(op, 0) for o in others if o.startswith(f"{name}."))
            if n - less:
                kinds[str(op).rpartition(".")[2]] = n - less
        collectives[name] = kinds
    return collectives
