"""The `tpplan` command line: infer, check and schema.

Each command is a `_cmd_*` function; `main` parses arguments and maps the errors a user can
cause to one-line messages through `_ERRORS` (exit 2 for bad input, 1 for a failed check).
torch is imported only by the commands that build a model, so `tpplan schema` and `--help`
start instantly.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .errors import MeshError, PlanFileError, PlanProblemsError, TpplanError

__all__ = ["main"]

_EXAMPLES = {
    "infer": "example:\n  tpplan infer llama --tp 4 --set num_hidden_layers=2 -o llama.yaml",
    "check": "example:\n  tpplan check llama.yaml llama --tp 8 --set num_hidden_layers=2",
    "schema": "example:\n  tpplan schema > plans/schema.json",
}


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="tpplan",
        description="Infer, check and apply tensor-parallel plans for PyTorch models.",
        epilog="example:\n  tpplan infer gpt2 --tp 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=_EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        # SUPPRESS: an unset sub-command flag must not undo `tpplan --debug COMMAND`.
        p.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show tracebacks of errors",
        )
        return p

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "model",
            metavar="MODEL",
            help="a transformers model type (llama, gpt2, ...), a local model folder or config.json, "
            "a model id in the local Hugging Face cache, or package.module:callable",
        )
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. --set num_hidden_layers=2 (repeatable)",
        )

    p = command("infer", "Print the plan inferred from a model's data flow.")
    model_args(p)
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size the plan must suit")
    p.add_argument("--format", choices=("yaml", "json"), default="yaml")
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan here instead of stdout")
    p.set_defaults(func=_cmd_infer)

    p = command("check", "Check a plan against a model and a tp size; exit 1 on problems.")
    p.add_argument("plan", metavar="PLAN", help="plan file (YAML or JSON)")
    model_args(p)
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    p.set_defaults(func=_cmd_check)

    p = command("schema", "Print the JSON Schema of plan files.")
    p.set_defaults(func=_cmd_schema)
    return top


def _build(args: argparse.Namespace) -> Any:
    from ._models import build_model, parse_overrides

    return build_model(args.model, parse_overrides(args.overrides))


def _cmd_infer(args: argparse.Namespace) -> int:
    from ._infer import infer_plan

    plan = infer_plan(_build(args), tp_size=args.tp)
    text = plan.to_json() if args.format == "json" else plan.to_yaml()
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output} ({len(plan.rules)} rules)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from ._check import check_plan
    from .plan import load_plan

    plan = load_plan(args.plan)
    problems = check_plan(plan, _build(args), tp_size=args.tp)
    errors = [p for p in problems if p.kind != "fingerprint"]
    for p in problems:
        label = "warning" if p.kind == "fingerprint" else "problem"
        print(f"{label}: {p}")
    if errors:
        print(f"{args.plan}: {len(errors)} problem(s) at tp {args.tp}.")
        return 1
    print(f"{args.plan}: sound at tp {args.tp} ({len(plan.rules)} rules).")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from .plan import plan_json_schema

    sys.stdout.write(json.dumps(plan_json_schema(), indent=2) + "\n")
    return 0


# exception type -> exit code; the message printed is the exception's own text, written
# for people. Anything not listed is a bug in tpplan and keeps its traceback.
_ERRORS: list[tuple[type[BaseException], int]] = [
    (PlanProblemsError, 1),
    (PlanFileError, 2),
    (MeshError, 2),
    (TpplanError, 2),
    (FileNotFoundError, 2),
    (NotImplementedError, 2),
]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        code = next((c for t, c in _ERRORS if isinstance(e, t)), None)
        if code is None or args.debug:
            raise
        print(f"tpplan: error: {e}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
