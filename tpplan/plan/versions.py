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
SCHEMA_VERSION = 12
# Older versions whose files this tpplan still reads unchanged (each is a subset of the next).
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)
# What each version added: a file naming any of these needs at least that version.
_ADDED_FIELDS = {
    2: ("parts", "transposed"),
    3: ("mode", "shard", "fused", "after_sum"),
    5: ("added_whole",),
    6: ("sum_at",),
    7: ("written",),
    11: ("replicate_heads",),
}
_ADDED_STYLES = {3: ("experts",), 4: ("split_params",), 10: ("heads",)}
_ADDED_MODEL_FIELDS = {4: ("command",)}
_ADDED_TOP_LEVEL = {8: ("regions",)}
# fields of `attributes` entries, by the version that added them
_ADDED_ATTRIBUTE_FIELDS = {11: ("by", "of")}
# fields a style took later than the field itself: (style, field)
_ADDED_STYLE_FIELDS = {9: (("rowwise", "parts"),)}
# a field given without one it needed before: (field, the one left out). Version 12 reads the
# sizes a rule leaves out (head_dim, parts, fused) from the model (check/complete.py); its
# files are refused by a tpplan that would shard a fused layer without its parts
_ADDED_OMISSIONS = {12: (("replicate_heads", "head_dim"),)}


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
    rules: Sequence[tuple[str, Collection[str]]],
    regions: bool = False,
    attributes: Sequence[Collection[str]] = (),
) -> None:
    """Raise ValueError naming every field and style newer than `version`, with the newest
    version they need: `rules` is each rule's (style, fields given); `regions`, whether the
    plan has DTensor regions."""
    added = {
        *_ADDED_FIELDS,
        *_ADDED_STYLES,
        *_ADDED_MODEL_FIELDS,
        *_ADDED_TOP_LEVEL,
        *_ADDED_STYLE_FIELDS,
        *_ADDED_ATTRIBUTE_FIELDS,
        *_ADDED_OMISSIONS,
    }
    for needed in sorted(added, reverse=True):
        if version >= needed:
            break
        newer = [f for f in _ADDED_TOP_LEVEL.get(needed, ()) if regions]
        newer += [
            f"attributes[{i}].{f}"
            for i, fields in enumerate(attributes)
            for f in _ADDED_ATTRIBUTE_FIELDS.get(needed, ())
            if f in fields
        ]
        newer += [f"model.{f}" for f in _ADDED_MODEL_FIELDS.get(needed, ()) if f in model_fields]
        newer += [
            f"rules[{i}].{f}"
            for i, (_, fields) in enumerate(rules)
            for f in _ADDED_FIELDS.get(needed, ())
            if f in fields
        ]
        newer += [
            f"rules[{i}].{f} (style {style})"
            for i, (style, fields) in enumerate(rules)
            for st, f in _ADDED_STYLE_FIELDS.get(needed, ())
            if style == st and f in fields
        ]
        newer += [
            f"rules[{i}].{f} without {left_out}"
            for i, (_, fields) in enumerate(rules)
            for f, left_out in _ADDED_OMISSIONS.get(needed, ())
            if f in fields and left_out not in fields
        ]
        newer += [
            f"rules[{i}].style {style}"
            for i, (style, _) in enumerate(rules)
            if style in _ADDED_STYLES.get(needed, ())
        ]
        if newer:
            raise ValueError(
                f"{', '.join(newer)} need schema version {needed}; change the first line "
                f"to 'tpplan: {needed}'."
            )
