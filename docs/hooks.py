"""The docs' reference pages, generated from the code when the site builds (an mkdocs hook).

A page asks for a generated part with a marker line; `on_page_markdown` replaces it:
- `<!-- tpplan:plan-fields -->`: the plan file's top-level sections, from the pydantic models;
- `<!-- tpplan:styles -->`: one section per style (tpplan/plan/styles/), its fields with their
  docstrings and the schema version each came in, and a YAML example: the first rule of that
  style in a shipped plan (plans/), else the one docs/reference/style_examples.yaml holds;
- `<!-- tpplan:cli -->`: every command's usage and options, from the argparse parser;
- `<!-- tpplan:errors -->`: every error class a user can meet, with its docstring (read from
  the source: the build imports tpplan's plan and CLI modules only, never torch).
Nothing here is written by hand twice: a field, style, option or error added to the code shows
up in the docs at the next build (and tests/test_docs.py checks the build names each one).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- tpplan:([a-z-]+) -->$", flags=re.M)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)


# ---- the plan file ---------------------------------------------------------------------------
def _type_name(t: Any) -> str:
    """A field's type as a plan's reader writes it: `str | null`, `list[int]`, `'tp' | 'replicas'`."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return "null" if t is type(None) else getattr(t, "__name__", str(t))


def _field_rows(model: Any, since: dict[str, int] | None = None) -> list[str]:
    rows = ["| field | type | default | since | what it says |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in ("match", "style", "why") and since is not None:
            continue  # every rule's three, described once above the styles
        default = (
            "required"
            if field.is_required()
            else f"`{field.get_default(call_default_factory=True)!r}`"
        )
        text = " ".join((field.description or "").split()).replace("|", "\\|")
        version = (since or {}).get(name, "")
        rows.append(
            f"| `{field.alias or name}` | `{_type_name(field.annotation)}` | {default} | {version} | {text} |"
        )
    return rows


def plan_fields() -> str:
    from tpplan.plan.rule import Rule
    from tpplan.plan.schema import AttributeRule, ModelInfo, Options, Plan, RegionRule

    out: list[str] = []
    for title, model in [
        ("The plan", Plan),
        ("`model:`", ModelInfo),
        ("`options:`", Options),
        ("`attributes:` (one entry each)", AttributeRule),
        ("`regions:` (one entry each)", RegionRule),
        ("Every rule (`rules:`, one entry each)", Rule),
    ]:
        out += [
            f"### {title}",
            "",
            inspect.cleandoc(model.__doc__ or ""),
            "",
            *_field_rows(model),
            "",
        ]
    return "\n".join(out)


def _shipped_example(style: str) -> str | None:
    """The first rule of `style` in a shipped plan, with the comment above it (its why)."""
    for path in sorted((ROOT / "plans").rglob("*.yaml")):
        lines = path.read_text().splitlines()
        if "rules:" not in lines:
            continue
        items: list[list[str]] = [[]]
        for line in lines[lines.index("rules:") + 1 :]:
            if not line.startswith("  "):
                break  # the next top-level section
            begins = line.startswith(("  #", "  - "))
            if begins and items[-1] and not items[-1][-1].startswith("  #"):
                items.append([])
            items[-1].append(line)
        for item in items:
            if f"    style: {style}" in item:
                body = textwrap.dedent("\n".join(item))
                return f"# from plans/{path.relative_to(ROOT / 'plans')}\n{body}"
    return None


def _own_examples() -> dict[str, str]:
    text = (ROOT / "docs" / "reference" / "style_examples.yaml").read_text()
    parts = re.split(r"^# style: (\w+)\n", text, flags=re.M)[1:]
    return {parts[i]: parts[i + 1].strip() for i in range(0, len(parts), 2)}


def styles() -> str:
    from tpplan.plan.rule import STYLE_CLASSES

    own = _own_examples()
    out: list[str] = []
    for name, cls in STYLE_CLASSES.items():
        example = _shipped_example(name) or own.get(name)
        if example is None:
            raise RuntimeError(
                f"style {name} has no example: add one to docs/reference/style_examples.yaml"
            )
        came = f" (schema {cls.since})" if cls.since > 1 else ""
        out += [
            f"### `{name}`{came}",
            "",
            inspect.cleandoc(cls.__doc__ or ""),
            "",
            *_field_rows(cls, cls.field_since),
            "",
            "```yaml",
            example,
            "```",
            "",
        ]
    return "\n".join(out)


# ---- the command line ------------------------------------------------------------------------
def cli() -> str:
    from tpplan.cli import _parser

    os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal: one width for every build
    top = _parser()
    [sub] = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    out = ["```text", top.format_help().rstrip(), "```", ""]
    for name, parser in sub.choices.items():
        parser.prog = f"tpplan {name}"
        out += [f"### `tpplan {name}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(out)


# ---- errors ----------------------------------------------------------------------------------
def _error_classes() -> dict[str, tuple[str, list[str], str]]:
    """Every class under tpplan/ that derives from TpplanError, read from the source (so the
    build imports no torch): name -> (module, bases, docstring)."""
    found: dict[str, tuple[str, list[str], str]] = {}
    for path in sorted((ROOT / "tpplan").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
                found[node.name] = (module, bases, ast.get_docstring(node) or "")
    errors = {"TpplanError": found["TpplanError"]}
    grew = True
    while grew:
        grew = False
        for name, (module, bases, doc) in found.items():
            if name not in errors and any(b in errors for b in bases):
                errors[name] = (module, bases, doc)
                grew = True
    return {n: v for n, v in errors.items() if not n.startswith("_")}


def errors() -> str:
    import tpplan

    out = []
    classes = _error_classes()
    for name in sorted(classes, key=lambda n: (n != "TpplanError", n)):
        module, bases, doc = classes[name]
        where = f"`tpplan.{name}`" if name in tpplan.__all__ else f"`{module}.{name}`"
        out += [f"### {name}", "", f"{where} ({', '.join(bases)})", "", doc, ""]
    return "\n".join(out)


GENERATORS = {"plan-fields": plan_fields, "styles": styles, "cli": cli, "errors": errors}
