"""verify_plan: apply a plan to a copy of a model and compare it with the original, module by
module, forward and (optionally) backward, with every rank simulated in this process.

Start at `verify_plan`; the comparison of one sharded output with its unsharded twin is
`_error`, which also understands outputs still split over one dim (a colwise layer's).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._runtime.inputs import example_inputs
from .._runtime.local import rank_values, simulated_ranks
from .._runtime.tree import first_tensor
from ..apply.api import apply_plan
from ..compile.experts import EXPERTS_MARK
from ..compile.own_rows import own_order
from ..compile.region_pieces import held_in_pieces
from ..compile.uneven_heads import uneven_rows
from ..errors import TpplanError
from ..plan.patterns import match_names, wildcard
from ..plan.schema import Plan
from ..plan.styles import ColwiseRule

__all__ = ["Verification", "verify_in_processes", "verify_plan"]


@dataclass
class Verification:
    """Max absolute error per module output (and per parameter gradient), over all ranks."""

    tp_size: int
    tol: float
    rows: dict[tuple[str, str], float] = field(default_factory=dict)
    """(module or parameter pattern, 'output' or 'grad') -> max abs error."""

    @property
    def ok(self) -> bool:
        return all(err <= self.tol for err in self.rows.values())

    @property
    def worst(self) -> float:
        return max(self.rows.values(), default=0.0)

    def add(self, name: str, what: str, err: float) -> None:
        key = (wildcard(name) or "(model)", what)
        self.rows[key] = max(self.rows.get(key, 0.0), err)


def _error(
    got: torch.Tensor,
    want: torch.Tensor,
    rank: int,
    tp: int,
    parts: tuple[int, ...] | None = None,
    unit: int | None = None,
    order: list[list[int]] | None = None,
) -> float:
    """Max abs difference; a rank's piece of an output split over one dim is compared with
    that rank's chunk of the whole (of each of the whole's `parts`, for a fused layer: its
    own rows, with the heads of parts shared past their count whole, `unit` their size; of
    heads split unevenly, `order`: each rank's rows)."""
    if (order is not None or parts is not None) and got.dim() == want.dim() and want.shape[-1] > 1:
        rows = order[rank] if order is not None else own_order(parts or (), tp, unit)[rank]
        if got.shape[-1] == len(rows) != want.shape[-1]:
            want = want.index_select(-1, torch.tensor(rows, device=want.device))
    if got.shape != want.shape:
        dims = [d for d in range(want.dim()) if got.shape[d] * tp == want.shape[d]]
        if got.dim() == want.dim() and not dims:
            return _shared_error(got, want, rank, tp)
        if got.dim() != want.dim() or len(dims) != 1:
            return float("inf")
        if parts is not None and dims[0] == want.dim() - 1 and sum(parts) == want.shape[-1]:
            pieces = want.split(list(parts), dim=-1)
            want = torch.cat([p.chunk(tp, dim=-1)[rank] for p in pieces], dim=-1)
        else:
            want = want.chunk(tp, dim=dims[0])[rank]
    if got.numel() == 0:
        return 0.0
    return (got.detach().double() - want.detach().double()).abs().max().item()


def _own(t: Any) -> Any:
    """A fused output held in its unequal pieces in a DTensor region (its DTensor label is
    no layout of them): the rank's own rows, compared as a fused layer's."""
    return t.to_local() if held_in_pieces(t) is not None else t


def _shared_error(got: torch.Tensor, want: torch.Tensor, rank: int, tp: int) -> float:
    """A rank's piece of an output split into k < tp pieces along one dim, each shared by
    tp/k consecutive ranks (key/value heads fewer than tp, compile/shared_heads.py): rank r
    holds piece r // (tp/k)."""
    dims = [d for d in range(want.dim()) if got.shape[d] != want.shape[d]]
    if len(dims) != 1 or got.shape[dims[0]] == 0 or want.shape[dims[0]] % got.shape[dims[0]]:
        return float("inf")
    k = want.shape[dims[0]] // got.shape[dims[0]]
    if tp % k:
        return float("inf")
    return _error(got, want.chunk(k, dim=dims[0])[rank // (tp // k)], 0, 1)


def _fused_outputs(
    sharded: nn.Module, tp: int
) -> dict[str, tuple[tuple[int, ...] | None, int | None, list[list[int]] | None]]:
    """{module name: (parts, the head size of parts shared past their head count, each
    rank's rows of heads split unevenly)} for the fused colwise layers, and those of uneven
    heads, of the plan `sharded` was given."""
    plan = sharded.__dict__.get("_tpplan_plan")
    names = [n for n, _ in sharded.named_modules() if n]
    out: dict[str, tuple[tuple[int, ...] | None, int | None, list[list[int]] | None]] = {}
    for rule in plan.rules if plan is not None else []:
        if not isinstance(rule, ColwiseRule):
            continue
        if rule.parts:
            unit = rule.head_dim if rule.replicate_heads else None
            out.update((n, (tuple(rule.parts), unit, None)) for n in match_names(rule.match, names))
        group = rule.uneven_group()
        if group is not None and rule.head_dim:
            for n in match_names(rule.match, names):
                weight = sharded.get_submodule(n).get_parameter("weight")
                pieces = rule.parts or [int(weight.shape[1 if rule.transposed else 0])]
                out[n] = (None, None, uneven_rows(pieces, rule.head_dim, group, tp))
    return out


def _record(model: nn.Module, store: dict[str, Any]) -> list[Any]:
    def hook(name: str) -> Any:
        def fn(mod: nn.Module, args: Any, out: Any) -> None:
            store.setdefault(name, first_tensor(out))

        return fn

    return [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]


def _loss(out: Any) -> torch.Tensor:
    first = first_tensor(out)
    if first is None:
        raise ValueError("the model returned no tensor; verify needs one to compare.")
    return first.float().square().mean()


def verify_plan(
    model: nn.Module,
    plan: Plan,
    *,
    tp_size: int,
    backward: bool = False,
    inputs: dict[str, Any] | None = None,
    tol: float = 1e-4,
    on_stage: Callable[[str], None] | None = None,
) -> Verification:
    """Compare `model` with a copy sharded by `plan` over `tp_size` simulated ranks.

    `model` must hold real weights (not meta); it is left unsharded. Inputs default to
    `example_inputs(model)`, identical on every rank. `on_stage` is told each step as it
    starts (a line for people: the command line prints it).
    """
    stage = on_stage or (lambda text: None)
    inputs = inputs if inputs is not None else example_inputs(model)
    report = Verification(tp_size=tp_size, tol=tol)
    stage("running the unsharded model" + (" forward and backward" if backward else ""))
    want, want_grads = _reference(model, inputs, backward)
    with simulated_ranks(tp_size) as mesh:
        stage(f"applying the plan to a copy over {tp_size} simulated ranks")
        sharded = apply_plan(copy.deepcopy(model), mesh, plan)
        stage("running the sharded copy and comparing every module's output")
        try:
            _compare(
                report,
                sharded,
                inputs,
                want,
                want_grads,
                backward,
                lambda t: enumerate(rank_values(_own(t))),
            )
        except (RuntimeError, AssertionError, AttributeError) as e:
            if not any(r.uneven_group() is not None for r in plan.rules):
                raise
            # one process deciding a view, or a branch, for ranks whose sizes differ (or
            # slicing a dim whose size differs: LocalTensor's SymInt lacks what it needs)
            raise TpplanError(
                f"simulated ranks could not run this plan's heads split unevenly ({e}): one "
                "process runs every rank, and where the model's code branches on a head "
                "count that differs rank by rank, or views a tensor laid out by one, it cannot "
                "take each rank's own way. Verify it on real ranks: tpplan verify --processes."
            ) from e
    return report


def _reference(
    model: nn.Module, inputs: dict[str, Any], backward: bool
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The unsharded model's module outputs (and parameter gradients); its grads are cleared
    after, so the sharded copy starts without them."""
    want: dict[str, Any] = {}
    handles = _record(model, want)
    try:
        model.zero_grad(set_to_none=True)
        out = model(**inputs)
        if backward:
            _loss(out).backward()
    finally:
        for h in handles:
            h.remove()
    want_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return want, want_grads


def _compare(
    report: Verification,
    sharded: nn.Module,
    inputs: dict[str, Any],
    want: dict[str, Any],
    want_grads: dict[str, torch.Tensor],
    backward: bool,
    values: Callable[[torch.Tensor], Iterable[tuple[int, torch.Tensor]]],
) -> None:
    """Run the sharded model and add every module output's (and gradient's) error to the
    report; `values` gives each (rank, value) of a tensor this process can see. A fused
    layer's output is a rank's slice of each of its parts (parameters and gradients are in the
    unsharded layout)."""
    fused = _fused_outputs(sharded, report.tp_size)
    got: dict[str, Any] = {}
    handles = _record(sharded, got)
    out = sharded(**inputs)
    for h in handles:
        h.remove()
    tp = report.tp_size
    # inside a split experts module each rank computes its own share of the work (its
    # experts, or its slice of every expert): only the module's output compares
    experts = [n for n, m in sharded.named_modules() if EXPERTS_MARK in m.__dict__]
    for name, value in got.items():
        ref = want.get(name)
        if value is None or ref is None or any(name.startswith(e + ".") for e in experts):
            continue
        for rank, v in values(value):
            report.add(
                name, "output", _error(v, ref, rank, tp, *fused.get(name, (None, None, None)))
            )
    if not backward:
        return
    _loss(out).backward()
    for name, p in sharded.named_parameters():
        if name not in want_grads:
            continue
        if p.grad is None:
            report.add(name, "grad", float("inf"))
            continue
        for rank, g in values(p.grad):
            report.add(name, "grad", _error(g, want_grads[name], rank, tp))


# ---- the same comparison on real gloo processes (`tpplan verify --processes`) -----------
# Each rank rebuilds the model from its spec rather than receiving it pickled: a model built
# on every rank is what a training script does, and it keeps big models out of the pipes.


def verify_in_processes(
    spec: str,
    overrides: dict[str, Any],
    plan: Plan,
    *,
    tp_size: int,
    backward: bool = False,
    tol: float = 1e-4,
    seed: int = 0,
) -> Verification:
    """verify_plan on `tp_size` real gloo processes (tpplan.launch, torch's elastic launcher).

    Every rank builds the model named by `spec` (a MODEL of the command line) with `overrides`
    on the CPU, takes rank 0's weights, applies `plan` on a mesh of all ranks and compares
    its module outputs (and gradients) with its own unsharded copy; the result is the worst
    error of every row over all ranks.
    """
    from .._runtime.launch import launch

    per_rank = launch(
        _verify_rank,
        nprocs=tp_size,
        args=(spec, overrides, plan.to_json(), backward, tol, seed),
        backend="gloo",
    )
    report = Verification(tp_size=tp_size, tol=tol)
    for rows in per_rank:
        for key, err in rows.items():
            report.rows[key] = max(report.rows.get(key, 0.0), err)
    return report


def _verify_rank(
    spec: str, overrides: dict[str, Any], plan_json: str, backward: bool, tol: float, seed: int
) -> dict[tuple[str, str], float]:
    """One rank of verify_in_processes: its own rows, errors of its local values."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from .._runtime.models import build_model

    rank, tp_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = build_model(spec, overrides, device="cpu")
    # Seeding makes the ranks' random weights equal only if the model's init is
    # deterministic; rank 0's weights everywhere makes it so whatever the init does.
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)
    inputs = example_inputs(model)
    report = Verification(tp_size=tp_size, tol=tol)
    want, want_grads = _reference(model, inputs, backward)

    def local(t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        # A DTensor is made whole (a collective: every rank reaches it in the same order);
        # a plain tensor is this rank's own value, whole or its piece of a split output.
        t = _own(t)
        return [(rank, t.full_tensor() if isinstance(t, DTensor) else t)]

    mesh = init_device_mesh("cpu", (tp_size,))
    sharded = apply_plan(copy.deepcopy(model), mesh, Plan.from_json(plan_json))
    _compare(report, sharded, inputs, want, want_grads, backward, local)
    return report.rows
