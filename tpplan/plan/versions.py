"""Schema versions: which versions this tpplan reads, and what each one added.

A plan file names its schema version on its first line (`tpplan: 7`). Every version is a
subset of the next, so older files are read as they are; a file that uses a field or a style
newer than its version is told which version it needs. Start at `check_fields_fit_version`.
No torch here.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

__all__ = [
    "READABLE_VERSIONS",
    "SCHEMA_VERSION",
    "check_fields_fit_version",
    "version_problem",
]

# A new version is added here, to READABLE_VERSIONS and to Plan.tpplan's Literal (schema.py),
# with its schema hash in plans/schema_versions.json (tests/test_plan.py checks it).
SCHEMA_VERSION = 18
# Older versions whose files this tpplan still reads unchanged (each is a subset of the next).
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18)
# What each version added outside the rules (a rule's own are on its style's class,
# styles/: `since`, `field_since`, `style_field_since`, `omissions`): a file naming any of
# these needs at least that version.
_ADDED_MODEL_FIELDS = {4: ("command",)}
_ADDED_TOP_LEVEL = {8: ("regions",)}
# fields of `attributes` entries, by the version that added them
_ADDED_ATTRIBUTE_FIELDS = {11: ("by", "of"), 17: ("uneven",)}


def version_problem(data: dict[str, Any]) -> str | None:
    """What is wrong with a plan's `tpplan:` key (missing, or a version this tpplan does not
    read), or None when it is one this tpplan reads."""
    if "tpplan" not in data:
        return (
            f"not a tpplan plan: the top-level key 'tpplan: {SCHEMA_VERSION}' (the schema "
            "version) is missing."
        )
    version = data["tpplan"]
    if version not in READABLE_VERSIONS:
        return (
            f"schema version {version!r} is not one this tpplan reads (it reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}). Upgrade tpplan (pip install -U tpplan) "
            "if the file is newer, or regenerate it with `tpplan infer`."
        )
    return None


def check_fields_fit_version(
    version: int,
    *,
    model_fields: Collection[str],
    rules: Sequence[Sequence[tuple[int, int, str]]],
    regions: bool = False,
    attributes: Sequence[Collection[str]] = (),
) -> None:
    """Raise ValueError naming everything newer than `version` that the newest version it
    needs added: `rules` is what each rule needs (`Rule.newer_than`: the version, the
    kind's place in the message, the words); `regions`, whether the plan has regions."""
    needs = [v for newer in rules for v, _, _ in newer]
    needs += [v for v, names in _ADDED_TOP_LEVEL.items() if regions and names]
    needs += [
        v for v, names in _ADDED_ATTRIBUTE_FIELDS.items() for a in attributes if set(names) & set(a)
    ]
    needs += [v for v, names in _ADDED_MODEL_FIELDS.items() if set(names) & set(model_fields)]
    needed = max((v for v in needs if v > version), default=None)
    if needed is None:
        return
    newer = [f for f in _ADDED_TOP_LEVEL.get(needed, ()) if regions]
    newer += [
        f"attributes[{i}].{f}"
        for i, fields in enumerate(attributes)
        for f in _ADDED_ATTRIBUTE_FIELDS.get(needed, ())
        if f in fields
    ]
    newer += [f"model.{f}" for f in _ADDED_MODEL_FIELDS.get(needed, ()) if f in model_fields]
    # a rule's: its fields, the fields its style took later, omissions, its style; each kind
    # over every rule before the next kind
    found = [(kind, i, words) for i, r in enumerate(rules) for v, kind, words in r if v == needed]
    newer += [f"rules[{i}].{words}" for _, i, words in sorted(found, key=lambda x: x[:2])]
    raise ValueError(
        f"{', '.join(newer)} need schema version {needed}; change the first line to "
        f"'tpplan: {needed}'."
    )
