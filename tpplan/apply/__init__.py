"""Stage 6, applying a plan: check it, then shard the model over a DeviceMesh with torch's
parallelize_module (api.py: `apply_plan`), FSDP2 beside it (parallelize.py), and the check
that every tp rank got the same inputs (guard.py), the named error of a forward before
the weights of a meta-device model exist (meta_weights.py), gradient clipping over its meshes
(grads.py), and torch.compile without the guards local-shard layers do not need
(compiled.py)."""

from __future__ import annotations

from .api import apply_plan
from .compiled import compile_model
from .grads import clip_grad_norm_
from .guard import InputMismatchError
from .parallelize import parallelize

__all__ = ["InputMismatchError", "apply_plan", "clip_grad_norm_", "compile_model", "parallelize"]
