"""Stage 1, the plan file: pydantic models, YAML/JSON with why-comments, module-name patterns,
the shipped plans, and the diff of two plans. Imports no torch: reading, printing and
validating a plan file is instant. Start at schema.py (`Plan`, `Rule`)."""

from __future__ import annotations

from .schema import (
    SCHEMA_VERSION,
    STYLES,
    AttributeRule,
    ModelInfo,
    Options,
    Plan,
    Rule,
    load_plan,
    parse_layout,
    plan_json_schema,
)

__all__ = [
    "SCHEMA_VERSION",
    "STYLES",
    "AttributeRule",
    "ModelInfo",
    "Options",
    "Plan",
    "Rule",
    "load_plan",
    "parse_layout",
    "plan_json_schema",
]
