"""Stage 6, applying a plan: check it, then shard the model over a DeviceMesh with torch's
parallelize_module (api.py: `apply_plan`), FSDP2 beside it (parallelize.py), and the check
that every tp rank got the same inputs (guard.py), and gradient clipping over its meshes
(grads.py)."""

from __future__ import annotations

from .api import apply_plan
from .grads import clip_grad_norm_
from .guard import InputMismatchError
from .parallelize import parallelize

__all__ = ["InputMismatchError", "apply_plan", "clip_grad_norm_", "parallelize"]
