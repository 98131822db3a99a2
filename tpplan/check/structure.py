"""Regions checked by module structure, for a model the tracer cannot run (its inputs cannot
be made up): the layer that closes a region must sit under the same parent module as the one
that opens it (q_proj and o_proj under one attention module). Start at
`check_by_structure`; flow.py calls it when the trace fails.
"""

from __future__ import annotations

from torch import nn

from ..errors import Problem
from ..plan.patterns import match_names, wildcard
from ..plan.schema import Plan
from .shared import Match, rule_label

__all__ = ["check_by_structure"]


def check_by_structure(
    plan: Plan, openers: list[Match], closers: list[Match], model: nn.Module
) -> list[Problem]:
    """Without a trace: the closing layer must sit under the same parent module as the
    opening one (q_proj and o_proj under one attention module). A parent that holds the
    layer and nothing else (`q_proj.linear` inside a `q_proj` wrapper) is no parent of
    its own: the one above it is. Inside a DTensor region (`Plan.regions`) the region is
    the parent: its layers open and close the split wherever they sit in it (Flux's
    single-stream attention, closed by its block's proj_out)."""
    owned = {n: {id(p) for p in m.parameters()} for n, m in model.named_modules()}
    names = [n for n in owned if n]
    regions = sorted(
        {m for r in plan.regions for m in match_names(r.match, names)}, key=len, reverse=True
    )

    def parent(name: str) -> str:
        region = next((r for r in regions if name.startswith(f"{r}.")), None)
        if region is not None:
            return region
        up = name.rpartition(".")[0]
        while up and owned.get(up) == owned.get(name):
            name, up = up, up.rpartition(".")[0]
        return up

    def under(root: str, name: str) -> bool:
        # At the top level only a top-level sibling counts: an output head is not closed by
        # the rowwise layers deep inside the blocks it follows.
        return "." not in name if root == "" else name.startswith(root + ".")

    out: list[Problem] = []
    for i, name in openers:
        p = parent(name)
        if plan.options.loss_parallel and p == "":
            continue  # a top-level head kept sharded for loss_parallel: the loss closes it
        if not any(under(p, c) for _, c in closers):
            rule = plan.rules[i]
            out.append(
                Problem(
                    "unclosed_region",
                    rule_label(i, rule),
                    name,
                    f"its output stays sharded ({rule.output_layout()}) but no rowwise "
                    f"module under {wildcard(p) or 'the model (top level)'} takes it back to a full tensor.",
                    "add a rowwise rule for the layer that consumes it, or gather the output "
                    "with `output: replicate`.",
                )
            )
    for i, name in closers:
        p = parent(name)
        if not any(under(p, o) for _, o in openers):
            rule = plan.rules[i]
            out.append(
                Problem(
                    "unopened_region",
                    rule_label(i, rule),
                    name,
                    f"it expects a sharded input ({rule.input_layout()}) but no colwise module "
                    f"under {wildcard(p) or 'the model (top level)'} produces one.",
                    "add colwise rules for the layers that feed it, or declare `input: replicate`.",
                )
            )
    return out
