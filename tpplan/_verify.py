"""verify_plan: apply a plan to a copy of a model and compare it with the original, module by
module, forward and (optionally) backward, with every rank simulated in this process.

Start at `verify_plan`; the comparison of one sharded output with its unsharded twin is
`_error`, which also understands outputs still split over one dim (a colwise layer's).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._apply import apply_plan
from ._inputs import example_inputs
from ._local import rank_values, simulated_ranks
from ._patterns import wildcard
from ._tree import first_tensor
from .plan import Plan

__all__ = ["Verification", "verify_plan"]


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


def _error(got: torch.Tensor, want: torch.Tensor, rank: int, tp: int) -> float:
    """Max abs difference; a rank's piece of an output split over one dim is compared with
    that rank's chunk of the whole."""
    if got.shape != want.shape:
        dims = [d for d in range(want.dim()) if got.shape[d] * tp == want.shape[d]]
        if got.dim() != want.dim() or len(dims) != 1:
            return float("inf")
        want = want.chunk(tp, dim=dims[0])[rank]
    if got.numel() == 0:
        return 0.0
    return (got.detach().double() - want.detach().double()).abs().max().item()


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
) -> Verification:
    """Compare `model` with a copy sharded by `plan` over `tp_size` simulated ranks.

    `model` must hold real weights (not meta); it is left unsharded. Inputs default to
    `example_inputs(model)`, identical on every rank.
    """
    inputs = inputs if inputs is not None else example_inputs(model)
    report = Verification(tp_size=tp_size, tol=tol)
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

    with simulated_ranks(tp_size) as mesh:
        sharded = apply_plan(copy.deepcopy(model), mesh, plan)
        got: dict[str, Any] = {}
        handles = _record(sharded, got)
        out = sharded(**inputs)
        for h in handles:
            h.remove()
        for name, value in got.items():
            ref = want.get(name)
            if value is None or ref is None:
                continue
            for rank, v in enumerate(rank_values(value)):
                report.add(name, "output", _error(v, ref, rank, tp_size))
        if backward:
            _loss(out).backward()
            for name, p in sharded.named_parameters():
                if name in want_grads:
                    g = p.grad
                    errs = (
                        [float("inf")]
                        if g is None
                        else [
                            _error(v, want_grads[name], r, tp_size)
                            for r, v in enumerate(rank_values(g))
                        ]
                    )
                    report.add(name, "grad", max(errs))
    return report
