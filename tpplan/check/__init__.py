"""Stage 4, checking a plan against a model and a tp size: every problem at once, first the
static ones (rules, sizes, regions by data flow), then a dry run of the sharded forward and
backward on fake ranks. Start at static.py (`check_plan`)."""

from __future__ import annotations

from .static import check_plan

__all__ = ["check_plan"]
