"""Stage 2, inferring a plan from a model's traced data flow: column-parallel spans that close
at a row-parallel layer, vocab-parallel tables, experts, what stays whole and why. Start at
api.py (`infer_plan`)."""

from __future__ import annotations

from .api import infer_plan

__all__ = ["infer_plan"]
