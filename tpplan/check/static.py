"""The import path of check_plan and splits_nothing before check/ was split by concern;
they live in api.py now. Kept for code that imports them from here."""

from __future__ import annotations

from .api import check_plan, splits_nothing

__all__ = ["check_plan", "splits_nothing"]
