"""The one parity check of the tests: a plan applied to a copy of a model on simulated ranks
computes what the unsharded model computes, forward and backward. Start at `assert_parity`.

Every parity test runs both execution paths: layers on their local shards (apply_plan's
default) and every layer on DTensors (`local_shards=False`). `reference_run`, `sharded_run`
and `assert_matches` are its steps, for a test that builds or applies the model itself
(test_pretrained)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import tpplan
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan.checkpoint import full_state_dict
from tpplan.compile.local_run import runs_locally
from tpplan.plan import Plan

__all__ = [
    "TOL",
    "ShardedRun",
    "assert_matches",
    "assert_parity",
    "assert_the_original_state",
    "forward_collectives",
    "one_counted_forward",
    "reference_run",
    "sharded_run",
]

# fp32 forward and backward of a model of a few layers: a sharded run sums the same products
# in another order, which moves the last bits only (~1e-6); 1e-4 leaves room, and a real
# mistake (a wrong shard, a missing reduction, heads mixed up) is off by O(0.1).
TOL = 1e-4


def _output(out: object) -> torch.Tensor:
    """The tensor a model's output holds: its logits, a diffusers model's sample, or the
    first entry of a tuple (`return_dict=False`)."""
    if isinstance(out, tuple):
        return _output(out[0])
    for field in ("logits", "sample"):
        if hasattr(out, field):
            return getattr(out, field)  # type: ignore[no-any-return]
    return out  # type: ignore[return-value]


def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _layout(stored: torch.Tensor, original: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a parameter's gathered value maps back to the original's order.

    Usually the identity. A fused layer (q|k|v, gate|up) is stored with each rank's slice of
    every part side by side, so its gathered weight (and gradient) is the original permuted
    along one dim. The permutation is found from the values themselves (the weights are exact
    copies), so this check does not depend on how the plan chose to store them.
    """
    if stored.shape == original.shape and torch.equal(stored, original):
        return lambda t: t
    for d in range(original.dim()):
        if stored.shape != original.shape:
            break
        rows = stored.movedim(d, 0).reshape(stored.shape[d], -1).tolist()
        where = {tuple(r): i for i, r in enumerate(rows)}
        wanted = original.movedim(d, 0).reshape(original.shape[d], -1).tolist()
        found = [where.get(tuple(r)) for r in wanted]  # row i of the original is row found[i]
        if None not in found and len(set(found)) == len(found):
            index = torch.tensor(found)
            return lambda t, d=d, index=index: t.index_select(d, index)
    raise AssertionError(
        f"a sharded parameter of shape {tuple(stored.shape)} holds other values than the "
        f"original of shape {tuple(original.shape)}, not just in another order"
    )


def _run(model: nn.Module, x: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
    return _output(model(**x) if isinstance(x, dict) else model(x))


def assert_parity(
    ref: nn.Module,
    plan: Plan,
    tp: int,
    x: torch.Tensor | dict[str, torch.Tensor],
    *,
    tol: float = TOL,
) -> None:
    """Forward output and every parameter's gradient equal the unsharded model's, on each
    simulated rank, on both execution paths: layers on their local shards (apply_plan's
    default) and every layer on DTensors (`local_shards=False`; skipped where the plan gave
    no layer the local path, the two then being the same run). `x` (one input, or keyword
    inputs) is made before the ranks exist, so every rank gets the same input."""
    ref = copy.deepcopy(ref)
    want, params = reference_run(ref, x)
    local = _assert_path_parity(ref, plan, tp, x, want, params, tol, local_shards=True)
    if local:
        _assert_path_parity(ref, plan, tp, x, want, params, tol, local_shards=False)


def _assert_path_parity(
    ref: nn.Module,
    plan: Plan,
    tp: int,
    x: torch.Tensor | dict[str, torch.Tensor],
    want: torch.Tensor,
    params: dict[str, nn.Parameter],
    tol: float,
    *,
    local_shards: bool,
) -> bool:
    """assert_parity on one execution path; whether any layer ran on its local shards."""
    with simulated_ranks(tp) as mesh:
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        tpplan.apply_plan(model, mesh, plan, local_shards=local_shards)
        local = any(runs_locally(m) for m in model.modules())
        run = sharded_run(model, x)
    path = "local shards" if local_shards else "DTensor path"
    assert_matches(run, want, params, tol=tol, what=f"tp {tp}, {path}")
    return local


def reference_run(
    ref: nn.Module, x: torch.Tensor | dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, nn.Parameter]]:
    """The unsharded model's output for `x` and its parameters, their gradients filled by
    the backward of the loss `sharded_run` uses."""
    want = _run(ref, x)
    want.float().pow(2).mean().backward()
    return want, dict(ref.named_parameters())


def sharded_run(model: nn.Module, x: torch.Tensor | dict[str, torch.Tensor]) -> ShardedRun:
    """Forward and backward of a model sharded under `simulated_ranks` (call it inside):
    each rank's output, each parameter's whole value, and each rank's whole gradient."""
    got = _run(model, x)
    outputs = rank_values(got)
    got.float().pow(2).mean().backward()
    stored = {n: rank_values(_whole(p.detach()))[0] for n, p in model.named_parameters()}
    grads = {
        n: None if p.grad is None else rank_values(_whole(p.grad))
        for n, p in model.named_parameters()
    }
    return ShardedRun(outputs, stored, grads)


@dataclass
class ShardedRun:
    """What sharded_run read: per-rank outputs, whole parameters, per-rank gradients."""

    outputs: list[torch.Tensor]
    stored: dict[str, torch.Tensor]
    grads: dict[str, list[torch.Tensor] | None]


def assert_matches(
    run: ShardedRun,
    want: torch.Tensor,
    params: dict[str, nn.Parameter],
    *,
    tol: float = TOL,
    what: str,
) -> None:
    """A sharded run's outputs and gradients equal the unsharded model's (reference_run)."""
    for rank, value in enumerate(run.outputs):
        err = (value - want).abs().max().item()
        assert err <= tol, f"{what}: rank {rank}'s output is off by {err:.3g}"
    assert set(run.grads) == set(params), "sharding changed the model's parameters"
    for name, p in params.items():
        got_grads = run.grads[name]
        if p.grad is None:
            assert got_grads is None, f"{what}: {name} got a gradient the unsharded model has not"
            continue
        assert got_grads is not None, f"{what}: {name} got no gradient"
        back = _layout(run.stored[name], p.detach())
        for rank, value in enumerate(got_grads):
            err = (back(value) - p.grad).abs().max().item()
            assert err <= tol, f"{what}: rank {rank}'s gradient of {name} is off by {err:.3g}"


def forward_collectives(comms: object, module: str) -> dict[str, int]:
    """{collective: how many} that `module` (CommDebugMode's name, `_Model.attn`) ran in
    its forward under the CommDebugMode `comms`, named as torch's ops end (`all_reduce`)."""
    ops = comms.comm_module_counts[module]["forward"]  # type: ignore[attr-defined]
    return {str(op).split(".")[-1]: n for op, n in ops.items()}


@contextmanager
def one_counted_forward(
    model: nn.Module, plan: Plan, tp: int, x: torch.Tensor | dict[str, torch.Tensor]
) -> Iterator[tuple[nn.Module, CommDebugMode]]:
    """`plan` applied to a copy of `model` on `tp` simulated ranks and run once on `x` (one
    input, or keyword inputs) under CommDebugMode: (the sharded copy, its counts), while the
    ranks exist (`forward_collectives` reads the counts)."""
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        with CommDebugMode() as comms:
            _run(sharded, x)
        yield sharded, comms


def every_call_collectives(
    model: nn.Module, plan: Plan, tp: int, x: torch.Tensor, module: str
) -> dict[str, int]:
    """`forward_collectives` of `module` on the second call of `plan` applied to a copy of
    `model` on `tp` simulated ranks: every call's (the first may copy a fused layer's own
    rows of its weight, once)."""
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        _run(sharded, x)
        with CommDebugMode() as comms:
            _run(sharded, x)
        return forward_collectives(comms, module)


def assert_the_original_state(sharded: nn.Module, model: nn.Module) -> None:
    """The sharded copy's full state dict (gathered: call it while its ranks exist) holds
    every tensor of `model`'s, unchanged."""
    whole = full_state_dict(sharded)
    for name, t in model.state_dict().items():
        assert torch.equal(whole[name], t), name
