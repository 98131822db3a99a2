"""`tpplan verify`: says what it will run and what memory it expects before it builds the
model with real weights, warns when that is large, and tells each stage as it starts (on
stderr, flushed). Start at `cmd_verify`; the estimate is tpplan/diagnose/cost.py."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..errors import PlanProblemsError, TpplanError

__all__ = ["LARGE_BYTES", "cmd_verify"]

# above this expected peak, verify suggests shrinking the model (a test lowers it)
LARGE_BYTES = 8 * 2**30


def _stage(text: str) -> None:
    print(f"verify: {text} ...", file=sys.stderr, flush=True)


def cmd_verify(args: argparse.Namespace) -> int:
    """Print the per-module errors and return 0 when all are within --tol, else 1."""
    from .._runtime.models import build_model, parse_overrides
    from ..diagnose.cost import verify_cost
    from ..diagnose.verify import verify_in_processes, verify_plan

    overrides = parse_overrides(args.overrides)
    # on the meta device first: the estimate, and a plan (read or inferred), cost no memory
    meta = build_model(args.model, overrides) if args.processes else _on_meta(args, overrides)
    if meta is not None:
        processes = args.tp if args.processes else 0
        _announce(
            args,
            type(meta).__name__,
            verify_cost(meta, backward=args.backward, processes=processes),
        )
        plan = _resolve(args, meta)
    if args.processes:
        from ..check import check_plan

        # The plan is checked here, on the meta device, so that a bad plan is the same one
        # message (and exit 1) as without --processes, not a failed rank.
        _stage("checking the plan")
        problems = check_plan(plan, meta, tp_size=args.tp)
        if problems:
            raise PlanProblemsError(problems, tp_size=args.tp)
        _stage(f"starting {args.tp} gloo processes, each building {args.model} with random weights")
        report = verify_in_processes(
            args.model, overrides, plan, tp_size=args.tp, backward=args.backward, tol=args.tol
        )
    else:
        _stage(f"building {args.model} with random weights")
        model = build_model(args.model, overrides, device="cpu")
        if meta is None:
            plan = _resolve(args, model)
        del meta
        report = verify_plan(
            model, plan, tp_size=args.tp, backward=args.backward, tol=args.tol, on_stage=_stage
        )
    _print_report(args, report)
    return 0 if report.ok else 1


def _on_meta(args: argparse.Namespace, overrides: dict[str, Any]) -> Any:
    """The model on the meta device; None for one that cannot be built there (user code
    that loads weights as it builds, say): verify then runs without an estimate."""
    from .._runtime.models import build_model

    try:
        return build_model(args.model, overrides)
    except TpplanError:
        raise  # a MODEL or --set that is wrong anywhere: its own message
    except Exception as e:
        print(
            f"verify: {args.model} cannot be built on the meta device ({type(e).__name__}), so "
            "its memory is not estimated",
            file=sys.stderr,
            flush=True,
        )
        return None


def _resolve(args: argparse.Namespace, model: Any) -> Any:
    """The plan given with --plan, or the one inferred for the model."""
    from ..apply.api import resolve_plan

    _stage("inferring the plan" if args.plan is None else f"reading the plan {args.plan}")
    return resolve_plan(args.plan, model, tp_size=args.tp)


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _announce(args: argparse.Namespace, cls: str, cost: Any) -> None:
    """What verify will run and the memory it expects; a warning when that is large."""
    layers = f", {cost.layers} layers ({cost.depth_key})" if cost.layers is not None else ""
    where = f"{args.tp} gloo processes" if args.processes else f"{args.tp} simulated ranks"
    passes = "forward and backward" if args.backward else "forward"
    print(
        f"verify: {args.model} ({cls}){layers}, {cost.parameters / 1e6:,.1f}M parameters, "
        f"tp {args.tp} on {where}, {passes}",
        file=sys.stderr,
    )
    acts = (
        "activations not estimated (the model does not run on the meta device)"
        if cost.activation_bytes is None
        else f"activations {_size(cost.activation_bytes)} (every module's output, kept "
        "by both runs, x2 for autograd)"
    )
    print(
        f"verify: expected peak memory about {_size(cost.peak_bytes)}: parameters "
        f"{_size(cost.param_bytes)} x {cost.copies} copies held at once, {acts}",
        file=sys.stderr,
        flush=True,
    )
    if cost.peak_bytes > LARGE_BYTES:
        depth = cost.depth_key or "the config field that counts its layers"
        ram = _memory()
        more = f", more than this machine's {_size(ram)}" if ram and cost.peak_bytes > ram else ""
        print(
            f"warning: this is a large model for verify (about {_size(cost.peak_bytes)}{more}, "
            f"and minutes of CPU time). Verify a smaller one of the same family: --set "
            f"{depth}=2, and smaller widths (e.g. --set hidden_size=256 --set "
            "intermediate_size=512); the plan's rules are the same at any size.",
            file=sys.stderr,
            flush=True,
        )


def _memory() -> int | None:
    """This machine's memory in bytes, where the system tells it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


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
