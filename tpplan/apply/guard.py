"""The classic silent bug of tensor parallelism: tp ranks fed different inputs. Every rank
must see the same replicated inputs; when they do not, the sharded model computes garbage
without a word. This guard checks, at every forward, that they agree, and names the input
and the ranks that differ. Switched on by `apply_plan(..., check_inputs=True)` or the
environment variable TPPLAN_CHECK_INPUTS=1; it costs one small all-gather per forward.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from .._runtime.torch_compat import funcol_all_gather, funcol_wait_tensor
from ..errors import TpplanError

__all__ = ["ENV_VAR", "InputMismatchError", "check_same_inputs", "guard_inputs", "wants_guard"]

ENV_VAR = "TPPLAN_CHECK_INPUTS"


class InputMismatchError(TpplanError, RuntimeError):
    """Replicated inputs differ across tp ranks."""


def wants_guard(flag: bool | None) -> bool:
    """The keyword when given, else the environment variable."""
    if flag is not None:
        return flag
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def _summary(t: torch.Tensor) -> torch.Tensor:
    """A few numbers that differ when the tensors differ: size, sum, and a position-weighted
    sum (catches permuted rows)."""
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return torch.stack(
        [
            torch.tensor(float(t.numel()), dtype=torch.float64, device=flat.device),
            flat.sum(),
            (flat * weights).sum(),
        ]
    )


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    named = [(f"positional input {i}", a) for i, a in enumerate(args)]
    named += [(f"input '{k}'", v) for k, v in kwargs.items()]
    # DTensors carry their own placement; only plain tensors are assumed replicated.
    return [(n, v) for n, v in named if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)]


def guard_inputs(model: nn.Module, mesh: DeviceMesh) -> RemovableHandle:
    """Check the model's tensor inputs are identical on every rank of `mesh` at each forward."""

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        check_same_inputs(mesh, args, kwargs)

    return model.register_forward_pre_hook(check, with_kwargs=True)


def check_same_inputs(mesh: DeviceMesh, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise InputMismatchError when a tensor among `args` and `kwargs` differs across the
    ranks of `mesh` (one small all-gather)."""
    named = _inputs(args, kwargs)
    if not named:
        return
    local = torch.stack([_summary(t.to("cpu") if t.device.type == "meta" else t) for _, t in named])
    gathered = funcol_wait_tensor(funcol_all_gather(local, 0, mesh))
    per_rank = gathered.reshape(mesh.size(), len(named), 3).tolist()
    for i, (name, _) in enumerate(named):
        differ = [r for r in range(1, mesh.size()) if per_rank[r][i] != per_rank[0][i]]
        if differ:
            ranks = ", ".join(str(r) for r in differ)
            raise InputMismatchError(
                f"{name} differs across tp ranks: rank(s) {ranks} do not hold what rank 0 holds. "
                "Every rank of a tensor-parallel group must get the same batch: give tp ranks the "
                "same data-loader seed and shard data over the data-parallel axis only."
            )
