"""`tpplan show`: the picture of a plan, from a MODEL (its inferred plan) or a plan file drawn
on the model its `tpplan infer` command names. Start at `cmd_show`; the picture is made in
tpplan/show/."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

__all__ = ["cmd_show"]


def cmd_show(args: argparse.Namespace) -> int:
    """Write the picture of a plan (inferred from MODEL, or a plan file drawn on its model)."""
    from ..show import picture_format
    from . import _is_plan_file, _progress, _UsageError

    picture_format(args.output)  # a wrong -o is told before torch is imported
    from .._runtime.models import build_model, parse_overrides
    from ..plan.load import load_plan

    plan, spec, pairs = None, args.target, list(args.overrides)
    if _is_plan_file(args.target):
        plan = load_plan(args.target)
        if args.model is None:
            spec, named = _model_of_plan(args.target, plan, args.tp, args.output)
            pairs = named + pairs  # the user's --set after the plan's own
        else:
            spec = args.model
    elif args.model is not None:
        raise _UsageError(
            f"{args.target} is not a plan file, so show takes no second MODEL ({args.model}); "
            f"give a plan file first: tpplan show PLAN {args.model} --tp {args.tp} -o {args.output}."
        )
    model = build_model(spec, parse_overrides(pairs))
    if plan is None:
        from ..infer import infer_plan

        _progress(args, f"inferring the plan of {spec} at tp {args.tp} ...")
        plan = infer_plan(model, tp_size=args.tp)
    from ..show import picture_of, write_picture

    _progress(args, f"measuring the plan at tp {args.tp} ...")
    picture = picture_of(model, plan, tp_size=args.tp)
    write_picture(picture, args.output)
    print(
        f"wrote {args.output} ({picture.model} at tp {args.tp}: {len(picture.groups)} groups, "
        f"parameters per rank {picture.fraction:.1%} of the unsharded model)",
        file=sys.stderr,
    )
    return 0


def _model_of_plan(path: str, plan: Any, tp: int, output: str) -> tuple[str, list[str]]:
    """The MODEL and --set pairs of the `tpplan infer` command a plan records."""
    from . import _parser, _UsageError

    command = plan.model.command if plan.model is not None else None
    words = shlex.split(command) if command else []
    if words[:2] == ["tpplan", "infer"] and len(words) > 2:
        recorded = _parser().parse_known_args(words[1:])[0]
        return recorded.model, list(recorded.overrides)
    raise _UsageError(
        f"{path} records no `tpplan infer` command (model.command) naming its model; name the "
        f"model after the plan: tpplan show {path} MODEL --tp {tp} -o {output}."
    )
