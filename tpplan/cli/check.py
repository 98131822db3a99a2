"""`tpplan check`: every problem of a plan for a model at a tp size, answered from the
cache (answers.py) when the same check was made before. Start at `cmd_check`."""

from __future__ import annotations

import argparse
import sys
import warnings

from ..errors import DryRunSkipped
from .answers import Answer, answer_key, load_answer, save_answer

__all__ = ["cmd_check"]


def cmd_check(args: argparse.Namespace) -> int:
    """Print the check's answer and return its exit code: 0 sound, 1 problems."""

    def key() -> str | None:
        if args.no_cache:
            return None
        return answer_key("check", args.plan, args.model, args.overrides, args.tp)

    before = key()
    cached = load_answer(before) if before else None
    if cached is not None:  # torch is never imported: the answer is the one computed before
        sys.stdout.write(cached.out)
        print("(a cached result of the same check; --no-cache checks again)", file=sys.stderr)
        return cached.code
    answer = _check(args)
    sys.stdout.write(answer.out)
    # stored only if nothing it depends on changed while it was computed
    if before is not None and key() == before:
        save_answer(before, answer)
    return answer.code


def _check(args: argparse.Namespace) -> Answer:
    """The check computed: its text and exit code."""
    from .._runtime.models import parse_overrides
    from ..plan.load import load_plan

    # the plan file and --set are read before torch is imported: their mistakes are instant
    plan = load_plan(args.plan)
    overrides = parse_overrides(args.overrides)
    from .._runtime.models import build_model
    from ..check import check_plan, splits_nothing

    # every problem apply_plan would refuse, a fingerprint of another model included: a
    # plan that passes check in CI must apply
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DryRunSkipped)
        problems = check_plan(plan, build_model(args.model, overrides), tp_size=args.tp)
    # a dry run that fake tensors could not finish is a note beside the verdict, not a problem
    notes = [f"note: {w.message}" for w in caught if issubclass(w.category, DryRunSkipped)]
    for w in caught:
        if not issubclass(w.category, DryRunSkipped):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    lines = notes + [f"problem: {p}" for p in problems]
    if problems:
        lines.append(f"{args.plan}: {len(problems)} problem(s) at tp {args.tp}.")
    elif splits_nothing(plan):
        # sound, but most likely not what was meant: say so, and still pass
        lines.append(
            f"{args.plan}: sound at tp {args.tp}, but it splits nothing ({len(plan.rules)} "
            "rules, none splitting a module): every rank would hold and run the whole model."
        )
    else:
        n = len(plan.rules)
        lines.append(f"{args.plan}: sound at tp {args.tp} ({n} rule{'' if n == 1 else 's'}).")
    return Answer(1 if problems else 0, "".join(f"{line}\n" for line in lines))
