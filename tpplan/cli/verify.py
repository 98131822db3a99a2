"""`tpplan verify`: the sharded model against the unsharded one, module by module. Start at
`cmd_verify`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import PlanProblemsError

__all__ = ["cmd_verify"]


def _progress(text: str) -> None:
    """Progress on stderr for people; never into a pipe."""
    if sys.stderr.isatty():
        print(text, file=sys.stderr, flush=True)


def cmd_verify(args: argparse.Namespace) -> int:
    """Print the per-module errors and return 0 when all are within --tol, else 1."""
    from .._runtime.models import build_model, parse_overrides
    from ..apply.api import resolve_plan
    from ..diagnose.verify import verify_in_processes, verify_plan

    overrides = parse_overrides(args.overrides)
    if args.processes:
        from ..check import check_plan

        # The plan is resolved and checked here, on the meta device, so that a bad plan is
        # the same one message (and exit 1) as without --processes, not a failed rank.
        model = build_model(args.model, overrides)
        plan = resolve_plan(args.plan, model, tp_size=args.tp)
        problems = check_plan(plan, model, tp_size=args.tp)
        if problems:
            raise PlanProblemsError(problems, tp_size=args.tp)
        _progress(f"starting {args.tp} gloo processes, each building {args.model} ...")
        report = verify_in_processes(
            args.model, overrides, plan, tp_size=args.tp, backward=args.backward, tol=args.tol
        )
    else:
        _progress(f"building {args.model} with random weights ...")
        model = build_model(args.model, overrides, device="cpu")
        plan = resolve_plan(args.plan, model, tp_size=args.tp)
        _progress(f"running the unsharded model and {args.tp} simulated ranks ...")
        report = verify_plan(model, plan, tp_size=args.tp, backward=args.backward, tol=args.tol)
    _print_report(args, report)
    return 0 if report.ok else 1


def _print_report(args: argparse.Namespace, report: Any) -> None:
    width = max((len(name) for name, _ in report.rows), default=10)
    print(f"{'module':<{width}}  {'what':<6}  {'max abs error':>13}")
    for (name, what), err in report.rows.items():
        flag = "" if err <= args.tol else "  <-- over tolerance"
        print(f"{name:<{width}}  {what:<6}  {err:>13.3e}{flag}")
    verdict = "matches" if report.ok else "DIFFERS from"
    print(
        f"tp {args.tp}: the sharded model {verdict} the unsharded one (worst "
        f"{report.worst:.3e}, tol {args.tol:g})."
    )
