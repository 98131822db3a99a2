"""Stage 8, what a plan costs and whether it is right: `plan_stats` (bytes per rank, collectives)
and `verify_plan` (per-module error against the unsharded model)."""

from __future__ import annotations

from .stats import plan_stats
from .verify import verify_plan

__all__ = ["plan_stats", "verify_plan"]
