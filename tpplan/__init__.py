"""tpplan: infer, check and apply tensor-parallel plans for PyTorch models.

Start with `apply_plan(model, mesh)`. The package is the pipeline, one subpackage per stage,
each importing only those before it: plan/ (the plan file, no torch) -> _runtime/ (ranks,
inputs, model facts) -> trace/ -> compile/ (rules to torch styles) -> check/ -> infer/ ->
apply/ -> checkpoint/ -> diagnose/ -> cli/; docs/concepts/codebase.md is the map.
Importing tpplan does not import torch: the names that need it load it on first use, so
reading and validating plan files stays instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_getattr
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
    from ._runtime.launch import LaunchError, launch
    from .apply import InputMismatchError, apply_plan, clip_grad_norm_, compile_model, parallelize
    from .check import check_plan
    from .checkpoint import (
        CheckpointError,
        PretrainedError,
        from_pretrained,
        full_state_dict,
        load_checkpoint,
        save_checkpoint,
    )
    from .diagnose import plan_stats, verify_plan
    from .infer import infer_plan

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
    "PretrainedError",
    "Problem",
    "Rule",
    "TpplanError",
    "apply_plan",
    "check_plan",
    "clip_grad_norm_",
    "compile_model",
    "from_pretrained",
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
    "apply_plan": ".apply",
    "check_plan": ".check",
    "clip_grad_norm_": ".apply",
    "compile_model": ".apply",
    "infer_plan": ".infer",
    "CheckpointError": ".checkpoint",
    "full_state_dict": ".checkpoint",
    "from_pretrained": ".checkpoint",
    "PretrainedError": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "save_checkpoint": ".checkpoint",
    "InputMismatchError": ".apply",
    "launch": "._runtime.launch",
    "LaunchError": "._runtime.launch",
    "parallelize": ".apply",
    "plan_stats": ".diagnose",
    "verify_plan": ".diagnose",
}


__getattr__ = lazy_getattr(__name__, _LAZY)
