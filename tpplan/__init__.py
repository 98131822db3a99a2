"""tpplan: infer, check and apply tensor-parallel plans for PyTorch models.

Start with `apply_plan(model, mesh)`; plans are `Plan` objects (tpplan/plan.py), checked by
`check_plan` (tpplan/_check.py), applied through torch's parallelize_module
(tpplan/_apply.py). Importing tpplan does not import torch: the names that need it load it
on first use, so reading and validating plan files stays instant.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    MeshError,
    ModelError,
    PlanFileError,
    PlanProblemsError,
    Problem,
    TpplanError,
)
from .plan import SCHEMA_VERSION, Plan, Rule, load_plan

if TYPE_CHECKING:
    from ._apply import apply_plan
    from ._check import check_plan
    from ._checkpoint import CheckpointError, full_state_dict, load_checkpoint, save_checkpoint
    from ._guard import InputMismatchError
    from ._infer import infer_plan
    from ._launch import LaunchError, launch
    from ._parallelize import parallelize
    from ._stats import plan_stats
    from ._verify import verify_plan

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointError",
    "InputMismatchError",
    "LaunchError",
    "MeshError",
    "ModelError",
    "Plan",
    "PlanFileError",
    "PlanProblemsError",
    "Problem",
    "Rule",
    "TpplanError",
    "apply_plan",
    "check_plan",
    "full_state_dict",
    "infer_plan",
    "launch",
    "load_checkpoint",
    "load_plan",
    "parallelize",
    "plan_stats",
    "save_checkpoint",
    "verify_plan",
]

__version__ = "0.1.0"

# name -> module; these import torch, so they load on first use
_LAZY = {
    "apply_plan": "._apply",
    "check_plan": "._check",
    "infer_plan": "._infer",
    "CheckpointError": "._checkpoint",
    "full_state_dict": "._checkpoint",
    "load_checkpoint": "._checkpoint",
    "save_checkpoint": "._checkpoint",
    "InputMismatchError": "._guard",
    "launch": "._launch",
    "LaunchError": "._launch",
    "parallelize": "._parallelize",
    "plan_stats": "._stats",
    "verify_plan": "._verify",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tpplan' has no attribute {name!r}")
