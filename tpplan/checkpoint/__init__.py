"""Stage 7, checkpoints of a sharded model: saved whole (safetensors) or sharded (DCP), loaded
at any tp size, each rank reading its own slices. Start at api.py."""

from __future__ import annotations

from .api import full_state_dict, load_checkpoint, save_checkpoint
from .safetensors_io import CheckpointError

__all__ = ["CheckpointError", "full_state_dict", "load_checkpoint", "save_checkpoint"]
