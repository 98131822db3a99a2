"""plan_stats: what a plan costs per rank, measured on the meta device with a fake process
group: parameter bytes, the collectives of one forward (and backward) by kind with counts
and bytes, and activation bytes per token. No weights, no numbers, any model size.

Start at `plan_stats`; `_Collectives` is the dispatch mode that sees every collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
)
from torch.utils.hooks import RemovableHandle

from .._runtime.fake import meta_copy
from .._runtime.inputs import example_inputs
from .._runtime.local import fake_ranks
from .._runtime.torch_compat import TorchDispatchMode
from .._runtime.tree import first_tensor, local_bytes
from ..apply.api import apply_plan
from ..compile.local_run import runs_locally
from ..compile.params import ReplicateGradSum, SplitParams
from ..compile.rules import plan_to_torch
from ..plan.patterns import collapse, match_names
from ..plan.schema import Plan
from ..trace import run_op

__all__ = ["Stats", "plan_stats"]


@dataclass
class Stats:
    """Per-rank costs of a plan at one tp size."""

    tp_size: int
    param_bytes_total: int
    """Parameter bytes of the unsharded model."""
    param_bytes_per_rank: int
    """Parameter bytes each rank holds once the plan is applied."""
    tokens: int
    """Tokens in the example batch the collectives were counted on."""
    activation_bytes_per_token: float
    """Bytes of module outputs one rank produces per token in one forward."""
    collectives: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    """{'forward' | 'backward': {kind: {'count': n, 'bytes': b}}}, bytes as sent per rank."""
    kv_cache_bytes_per_token: float | None = None
    """Bytes of the key/value cache one rank keeps per token (every layer), as the forward
    returned it (`past_key_values`); None for a model that returns no cache."""
    kv_cache_bytes_per_token_total: float | None = None
    """The same for the unsharded model."""
    execution: dict[str, str] = field(default_factory=dict)
    """{module pattern: how its split layers ran in the forward}: "local shards", or
    "DTensor: <why>" (local_run.py)."""
    working_bytes_per_rank: int = 0
    """Bytes each rank keeps beside its parameters as working copies of its own rows of fused
    layers of unequal pieces (compile/own_rows.py: one more local shard of each such weight,
    a whole key/value head where heads are shared past their count)."""

    @property
    def param_fraction(self) -> float:
        return self.param_bytes_per_rank / max(1, self.param_bytes_total)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp_size": self.tp_size,
            "param_bytes_total": self.param_bytes_total,
            "param_bytes_per_rank": self.param_bytes_per_rank,
            "working_bytes_per_rank": self.working_bytes_per_rank,
            "param_fraction": round(self.param_fraction, 6),
            "tokens": self.tokens,
            "activation_bytes_per_token": round(self.activation_bytes_per_token, 3),
            "collectives": self.collectives,
            "execution": self.execution,
            **(
                {}
                if self.kv_cache_bytes_per_token is None
                else {
                    "kv_cache_bytes_per_token": round(self.kv_cache_bytes_per_token, 3),
                    "kv_cache_bytes_per_token_total": round(
                        self.kv_cache_bytes_per_token_total or 0.0, 3
                    ),
                }
            ),
        }


_NOT_TRAFFIC = {"wait_tensor", "_wrap_tensor_autograd"}
# styles that split no layer's computation (execution paths are about layers)
_NOT_LAYERS = (
    PrepareModuleInput,
    PrepareModuleOutput,
    PrepareModuleInputOutput,
    ReplicateGradSum,
    SplitParams,
)


class _Collectives(TorchDispatchMode):
    """Counts the functional collectives DTensor issues, with the bytes each one sends."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kind = func.__name__.split(".")[0]
        # wait_tensor and the autograd wrappers are bookkeeping, not traffic
        if func.namespace.startswith("_c10d_functional") and kind not in _NOT_TRAFFIC:
            entry = self.seen.setdefault(kind, {"count": 0, "bytes": 0})
            entry["count"] += 1
            if args and isinstance(args[0], torch.Tensor):
                entry["bytes"] += args[0].numel() * args[0].element_size()
        return run_op(func, args, kwargs or {})  # meta kernels as the tracer runs them


def plan_stats(
    model: nn.Module,
    plan: Plan,
    *,
    tp_size: int,
    backward: bool = False,
    batch: int = 1,
    seq: int = 128,
) -> Stats:
    """Costs of `plan` on `model` at `tp_size`, measured on a meta copy of the model."""
    meta = meta_copy(model)
    total = sum(local_bytes(p) for p in meta.parameters())
    inputs = example_inputs(meta, batch=batch, seq=seq, device="meta")
    tokens = batch * seq
    with torch.no_grad(), _Collectives():  # the unsharded cache, meta ops run as the tracer's
        cache_total = _cache_bytes(meta(**inputs))
    act = 0
    with fake_ranks(tp_size) as mesh:
        apply_plan(meta, mesh, plan)
        per_rank = sum(local_bytes(p) for p in meta.parameters())

        def count(mod: nn.Module, args: Any, out: Any) -> None:
            nonlocal act
            if isinstance(out, torch.Tensor) and not list(mod.children()):
                act += local_bytes(out)

        handles = [m.register_forward_hook(count) for m in meta.modules()]
        paths: dict[str, str] = {}
        # the plan as applied: with the sizes it leaves to the model read from it
        applied: Plan = meta.__dict__["_tpplan_plan"]
        handles += _record_paths(meta, applied, mesh.size(), paths)
        collectives: dict[str, dict[str, dict[str, int]]] = {}
        fwd = _Collectives()
        with fwd, torch.set_grad_enabled(backward):
            out = meta(**inputs)
        collectives["forward"] = fwd.seen
        cache = _cache_bytes(out)
        working = _working_bytes(meta)
        for h in handles:
            h.remove()
        if backward:
            bwd = _Collectives()
            with bwd:
                first = first_tensor(out)
                if first is None:
                    raise ValueError("the model returned no tensor to take a backward pass from.")
                first.float().sum().backward()
            collectives["backward"] = bwd.seen
    return Stats(
        tp_size=tp_size,
        param_bytes_total=total,
        param_bytes_per_rank=per_rank,
        tokens=tokens,
        activation_bytes_per_token=act / tokens,
        collectives=collectives,
        kv_cache_bytes_per_token=None if cache is None else cache / tokens,
        kv_cache_bytes_per_token_total=None if cache_total is None else cache_total / tokens,
        execution=_by_pattern(paths, [n for n, _ in meta.named_modules()]),
        working_bytes_per_rank=working,
    )


def _working_bytes(model: nn.Module) -> int:
    """Bytes of the working rows the forward copied out of fused layers' shards (one rank's)."""
    total = 0
    for m in model.modules():
        run = m.__dict__.get("_tpplan_local_run")
        own = getattr(run, "own", None)
        for kept in own.kept() if own is not None else ():
            total += local_bytes(kept)
    return total


def _record_paths(
    model: nn.Module, plan: Plan, tp: int, paths: dict[str, str]
) -> list[RemovableHandle]:
    """Hooks that note, for every split module, the path its forward takes: on its local
    shards (a layer given the local forward, handed a plain tensor) or on DTensors, why."""
    styles = plan_to_torch(plan, model)
    handles = []
    for name, module in model.named_modules():
        style = styles.get(name)
        if style is None or isinstance(style, _NOT_LAYERS):
            continue

        def note(mod: nn.Module, args: Any, name: str = name, style: Any = style) -> None:
            why = getattr(style, "local_run_reason", None)
            reason = why(mod, tp) if why else f"{type(style).__name__} runs on DTensors"
            if runs_locally(mod):
                reason = None  # an opener of a region run on local shards
            if reason is None and isinstance(first_tensor(args), DTensor):
                reason = "its input is a DTensor (inside a DTensor region)"
            paths[name] = "local shards" if reason is None else f"DTensor: {reason}"

        handles.append(module.register_forward_pre_hook(note))
    for name, module in model.named_modules():
        region = getattr(module, "_tpplan_region", None)
        if region is not None:
            # a region's own code: on local shards, or on DTensors and why (local_regions.py)
            paths[name] = f"region on {region}" if region == "local shards" else region
    return handles


def _by_pattern(paths: dict[str, str], names: list[str]) -> dict[str, str]:
    """The paths with layer indices collapsed where every layer took the same one."""
    by_path: dict[str, list[str]] = {}
    for name, path in paths.items():
        by_path.setdefault(path, []).append(name)
    out: dict[str, str] = {}
    for path, members in by_path.items():
        for pattern in collapse(members, names):
            out[pattern] = path
    return dict(sorted(out.items(), key=lambda kv: names.index(match_names(kv[0], names)[0])))


def _cache_bytes(out: Any) -> int | None:
    """This rank's bytes of the key/value cache a forward returned (`past_key_values`, a
    transformers Cache whose layers hold keys and values, or tuples of tensors)."""
    cache = getattr(out, "past_key_values", None)
    if cache is None:
        return None
    seen: set[int] = set()

    def walk(x: Any, depth: int) -> int:
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return 0
            seen.add(id(x))
            return local_bytes(x)
        if depth > 3:
            return 0
        if isinstance(x, (list, tuple)):
            return sum(walk(v, depth + 1) for v in x)
        if isinstance(x, dict):
            return sum(walk(v, depth + 1) for v in x.values())
        if hasattr(x, "__dict__") and not isinstance(x, nn.Module):
            return sum(walk(v, depth + 1) for v in vars(x).values())
        return 0

    return walk(cache, 0)
