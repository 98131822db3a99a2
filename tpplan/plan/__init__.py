"""Stage 3, the plan file. Imports no torch: reading, printing and validating a plan file is
instant. Start at schema.py (`Plan`), then styles/ (one class per style, on rule.py's
`Rule`); then, by concern:

- load.py: `load_plan`, from a file or a shipped plan's name; shipped.py finds those;
- comments.py: the YAML text, each rule's `why` the comment above it;
- layouts.py, versions.py: layout strings, and what each schema version added;
- messages.py: pydantic's errors as one sentence per problem, with its line;
- patterns.py: module-name patterns, matched as parallelize_module matches;
- diff.py: what changes between two plans.
"""

from __future__ import annotations

from .layouts import parse_layout
from .load import load_plan
from .schema import AttributeRule, ModelInfo, Options, Plan, Rule, plan_json_schema
from .styles import STYLES
from .versions import SCHEMA_VERSION

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
