"""Stage 3, plan rules to torch's ParallelStyles: the styles torch lacks (fused layers, tables
whose forward does more than look up, experts, per-head parameters), the strided layout of
fused layers and its checkpoint chunks, and `shard_model`, which applies a plan's styles
module by module. Start at styles.py (`plan_to_torch`)."""

from __future__ import annotations

from .shard import shard_model
from .styles import plan_to_torch, rule_to_style

__all__ = ["plan_to_torch", "rule_to_style", "shard_model"]
