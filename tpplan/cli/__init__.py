"""The `tpplan` command line: infer, check, diff, verify, stats, show and schema.

Each command is a `_cmd_*` function here, or `cmd_*` in a module of its own (check.py,
verify.py) imported when it runs; `main` parses arguments and maps the errors a user can
cause to one-line messages through `_ERRORS` (exit 2 for bad input, 1 for a failed check).
torch is imported only by the commands that build a model, so `tpplan schema`, `--help`, a
usage error and a check answered from the cache (answers.py) start instantly.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..errors import MeshError, PlanFileError, PlanProblemsError, TpplanError

__all__ = ["main"]


class _UsageError(TpplanError, ValueError):
    """A command-line value that cannot work (an -o that is a folder), found by the CLI."""


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line like every other error (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(what: str) -> Callable[[str], int]:
    """An argparse type: a whole number of at least 1."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(
                f"takes a whole number of at least 1 ({what}), got '{text}'"
            )
        return n

    return parse


_EXAMPLES = {
    "infer": "example:\n  tpplan infer llama --tp 4 --set num_hidden_layers=2 -o llama.yaml",
    "check": "example:\n  tpplan check llama.yaml llama --tp 8 --set num_hidden_layers=2",
    "schema": "example:\n  tpplan schema > plans/schema.json",
    "diff": "example:\n  tpplan diff llama.yaml llama --tp 4 --set num_hidden_layers=2",
    "verify": "example:\n  tpplan verify llama --plan llama.yaml --tp 2 --backward --set num_hidden_layers=2 "
    "--set hidden_size=256 --set intermediate_size=512 --set vocab_size=1024",
    "stats": "example:\n  tpplan stats llama --tp 8 --backward --set num_hidden_layers=2",
    "show": "examples:\n  tpplan show llama --tp 2 --set num_hidden_layers=2 -o llama.svg\n"
    "  tpplan show plans/llama.yaml --tp 8 -o llama.html",
}


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """A command that lives in a module of its own, imported when the command runs."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(getattr(importlib.import_module(f".{module}", __name__), name)(args))

    return run


_TP = _positive("the number of tensor-parallel ranks")


def _parser() -> argparse.ArgumentParser:
    top = _Parser(
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

    def overrides(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field of a MODEL, e.g. --set num_hidden_layers=2 (repeatable)",
        )

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "model",
            metavar="MODEL",
            help="a transformers model type (llama, gpt2, ...), a local model folder or config.json, "
            "a model id in the local Hugging Face cache, or package.module:callable",
        )
        overrides(p)

    p = command("infer", "Print the plan inferred from a model's data flow.")
    model_args(p)
    p.add_argument("--tp", type=_TP, default=None, help="tensor-parallel size the plan must suit")
    p.add_argument("--format", choices=("yaml", "json"), default="yaml")
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan here instead of stdout")
    p.add_argument(
        "--loss-parallel",
        action="store_true",
        help="leave the logits of a vocab head split, for a loss under loss_parallel()",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="keep activations between split regions split over the sequence (dim 1)",
    )
    p.add_argument(
        "--experts",
        choices=("tensor", "expert"),
        default="tensor",
        help="mixture-of-experts layers: split every expert (tensor, default) or give each "
        "rank whole experts (expert)",
    )
    p.add_argument(
        "--no-fingerprint",
        action="store_true",
        help="write no model fingerprint, so the plan applies to every size of the family "
        "whose module names and widths it names match",
    )
    p.add_argument(
        "--family",
        action="store_true",
        help="write a plan for every size of the model's family: no fingerprint, none of "
        "the sizes check and apply read from each model's forward (head_dim, fused parts), "
        "and no heads split unevenly (an uneven split states its model's head sizes); "
        "the shipped plans are written so, e.g. `tpplan infer llama --family -o llama.yaml` "
        "serves Llama-3-8B (head_dim 128) and Llama-3.2-1B (64) alike",
    )
    p.add_argument(
        "--input",
        dest="inputs",
        action="append",
        default=[],
        metavar="[NAME=]SHAPE[:DTYPE[:HIGH]]",
        help="an input to trace the model on, instead of made-up ones: 2x3x224x224, or "
        "idx=2x16:int64:50257 (integers drawn below HIGH); by position in order, or all by "
        "name (repeatable)",
    )
    p.set_defaults(func=_cmd_infer)

    p = command("check", "Check a plan against a model and a tp size; exit 1 on problems.")
    p.add_argument("plan", metavar="PLAN", help="plan file (YAML or JSON)")
    model_args(p)
    p.add_argument("--tp", type=_TP, required=True, help="tensor-parallel size")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="check again instead of printing the stored answer of the same check (answers "
        "are kept in $TPPLAN_CACHE_DIR, else $XDG_CACHE_HOME/tpplan or ~/.cache/tpplan)",
    )
    p.set_defaults(func=_lazy("check", "cmd_check"))

    p = command("diff", "Show how two plans shard differently (exit 1 when they do).")
    p.add_argument("a", metavar="A", help="a plan file, or a MODEL (its inferred plan)")
    p.add_argument("b", metavar="B", help="a plan file, or a MODEL (its inferred plan)")
    p.add_argument("--tp", type=_TP, default=None, help="tp size for inferring a MODEL's plan")
    overrides(p)
    p.set_defaults(func=_cmd_diff)

    def measured(p: argparse.ArgumentParser, backward_help: str) -> None:
        """What verify and stats share: a model, an optional plan, a tp size."""
        model_args(p)
        p.add_argument("--plan", metavar="PLAN", help="plan file (default: the inferred plan)")
        p.add_argument("--tp", type=_TP, required=True, help="tensor-parallel size")
        p.add_argument("--backward", action="store_true", help=backward_help)

    p = command("verify", "Compare a sharded model with the unsharded one, module by module.")
    measured(p, "compare gradients too")
    p.add_argument(
        "--tol", type=float, default=1e-4, help="max abs error allowed (default 1e-4, fp32)"
    )
    p.add_argument(
        "--processes",
        action="store_true",
        help="run the ranks as real gloo processes (as torchrun would) instead of simulating "
        "them in this one",
    )
    p.set_defaults(func=_lazy("verify", "cmd_verify"))

    p = command("stats", "Per-rank parameter bytes and collectives of one forward (and backward).")
    measured(p, "count backward collectives too")
    p.add_argument(
        "--seq",
        type=_positive("tokens"),
        default=128,
        help="tokens in the example sequence (default 128)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(func=_cmd_stats)

    p = command(
        "show",
        "Draw how a plan splits a model: its blocks' layers coloured by style, the collectives "
        "of one forward, each rule's reason and the parameters per rank (SVG or HTML).",
    )
    p.add_argument(
        "target",
        metavar="MODEL|PLAN",
        help="a MODEL (as for infer; its inferred plan is drawn) or a plan file (drawn on the "
        "model its `model.command` names, or on MODEL)",
    )
    p.add_argument(
        "model", metavar="MODEL", nargs="?", help="with a plan file: the model to draw it on"
    )
    overrides(p)
    p.add_argument("--tp", type=_TP, required=True, help="tensor-parallel size")
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        required=True,
        help="the picture to write; its suffix picks the format: .svg, or .html (the SVG in a "
        "page of its own, nothing fetched)",
    )
    p.set_defaults(func=_lazy("show", "cmd_show"))

    p = command("schema", "Print the JSON Schema of plan files.")
    p.set_defaults(func=_cmd_schema)
    return top


def _build(args: argparse.Namespace, spec: str | None = None, *, device: str = "meta") -> Any:
    from .._runtime.models import build_model, parse_overrides

    return build_model(spec or args.model, parse_overrides(args.overrides), device=device)


def _plan_for(args: argparse.Namespace, model: Any, tp: int | None) -> Any:
    """The plan file given with --plan, else the plan inferred for the model."""
    from ..apply.api import resolve_plan

    return resolve_plan(getattr(args, "plan", None), model, tp_size=tp)


def _progress(args: argparse.Namespace, text: str) -> None:
    """Progress on stderr for people; never into JSON or a pipe."""
    if sys.stderr.isatty() and not getattr(args, "json", False):
        print(text, file=sys.stderr, flush=True)


def _infer_command(args: argparse.Namespace) -> str:
    """The `tpplan infer` command that gives this plan again, in a fixed order of flags
    (the output file and format are not part of the plan)."""
    words = ["tpplan", "infer", args.model]
    if args.tp is not None:
        words += ["--tp", str(args.tp)]
    for pair in args.overrides:
        words += ["--set", pair]
    words += ["--loss-parallel"] * args.loss_parallel
    words += ["--sequence-parallel"] * args.sequence_parallel
    if args.experts != "tensor":
        words += ["--experts", args.experts]
    words += ["--family"] * args.family
    words += ["--no-fingerprint"] * args.no_fingerprint
    for spec in args.inputs:
        words += ["--input", spec]
    return shlex.join(words)


def _cmd_infer(args: argparse.Namespace) -> int:
    from .._runtime.inputs import inputs_from_specs
    from .._runtime.torch_compat import tree_map
    from ..infer import infer_plan
    from ..plan.shipped import shipped_for_class, shipped_plans

    if args.output:
        _check_output(Path(args.output))  # before the model is built and traced
    given = inputs_from_specs(args.inputs)  # before the model is built: fails fast
    model = _build(args)
    where = next((p.device for p in model.parameters()), None)
    if given is not None and where is not None:  # a model built on the meta device
        given = tree_map(lambda t: t.to(where), given)
    plan = infer_plan(
        model,
        tp_size=args.tp,
        example_inputs=given,
        loss_parallel=args.loss_parallel,
        sequence_parallel=args.sequence_parallel,
        experts=args.experts,
        # an uneven split states its model's head size and count: no plan of a family
        split_unevenly=not args.family,
    )
    if args.family:
        from ..check.complete import leave_out_sizes

        # check and apply read these back from each model of the family
        plan = leave_out_sizes(plan, model, example_inputs=given)
    assert plan.model is not None  # infer_plan always describes the model
    info: dict[str, Any] = {"command": _infer_command(args)}
    if args.no_fingerprint or args.family:
        info |= {"fingerprint": None, "parameters": None}
    plan = plan.model_copy(update={"model": plan.model.model_copy(update=info)})
    text = plan.to_json() if args.format == "json" else plan.to_yaml()
    if args.output:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as e:
            raise _UsageError(f"-o {args.output}: cannot write it ({e.strerror}).") from None
        print(f"wrote {args.output} ({len(plan.rules)} rules)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    from ..plan.styles import ExpertsRule

    experts = [r for r in plan.rules if isinstance(r, ExpertsRule)]
    if args.experts == "expert" and not any(r.mode == "expert" for r in experts):
        split = [r.match for r in experts]
        why = (
            f"the experts it found ({', '.join(split)}) stay split by tensor (their rule's "
            "comment says why)"
            if split
            else f"{type(model).__name__} has no mixture-of-experts layers"
        )
        print(f"note: --experts expert had no effect: {why}.", file=sys.stderr)
    for name in shipped_for_class(type(model).__name__):
        print(
            f"note: tpplan ships a reviewed plan for {type(model).__name__}, '{name}' "
            f"({shipped_plans()[name]}): use it with --plan {name} or "
            f'apply_plan(model, mesh, plan="{name}")',
            file=sys.stderr,
        )
    return 0


def _check_output(path: Path) -> None:
    if path.is_dir():
        raise _UsageError(
            f"-o {path} is a folder; -o takes the file to write the plan to, "
            f"e.g. -o {path / 'plan.yaml'}."
        )
    if not path.parent.is_dir():
        raise _UsageError(
            f"-o {path}: the folder {path.parent} does not exist; create it first, or write "
            "the plan elsewhere."
        )


def _is_plan_file(spec: str) -> bool:
    """A MODEL|PLAN argument names a plan file (a model's config.json is a MODEL)."""
    return Path(spec).is_file() and not spec.endswith("config.json")


def _cmd_diff(args: argparse.Namespace) -> int:
    from ..plan.diff import diff_plans
    from ..plan.load import load_plan

    plans, names, model = [], None, None
    for spec in (args.a, args.b):
        if _is_plan_file(spec):
            plans.append(load_plan(spec))
        else:
            model = _build(args, spec)
            names = [n for n, _ in model.named_modules()]
            plans.append(_plan_for(args, model, args.tp))
    if model is not None:
        from ..check.complete import leave_out_sizes

        # a size one plan states and the other leaves to the model (a shipped plan's
        # head_dim) is no change where it is the model's own
        plans = [leave_out_sizes(p, model) for p in plans]
    changes = diff_plans(plans[0], plans[1], module_names=names)
    for c in changes:
        print(c)
    if not changes:
        print(f"{args.a} and {args.b} shard the same way.")
    return 1 if changes else 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from ..diagnose.stats import plan_stats

    model = _build(args)
    plan = _plan_for(args, model, args.tp)
    _progress(
        args,
        f"measuring one {'forward and backward' if args.backward else 'forward'} at tp {args.tp} ...",
    )
    stats = plan_stats(model, plan, tp_size=args.tp, backward=args.backward, seq=args.seq)
    if args.json:
        print(json.dumps(stats.to_dict(), indent=2))
        return 0
    mib = 1024 * 1024
    print(
        f"parameters per rank: {stats.param_bytes_per_rank / mib:,.1f} MiB of {stats.param_bytes_total / mib:,.1f} MiB "
        f"({stats.param_fraction:.1%}) at tp {args.tp}"
    )
    if stats.working_bytes_per_rank:
        print(
            f"working copies of fused layers' own rows per rank: "
            f"{stats.working_bytes_per_rank / mib:,.1f} MiB"
        )
    print(f"activations per token per rank: {stats.activation_bytes_per_token / 1024:,.1f} KiB")
    print(f"collectives for {stats.tokens} tokens:")
    print(f"  {'pass':<9} {'kind':<24} {'count':>6} {'MiB per rank':>13}")
    for phase, kinds in stats.collectives.items():
        for kind, v in sorted(kinds.items()):
            print(f"  {phase:<9} {kind:<24} {v['count']:>6} {v['bytes'] / mib:>13.2f}")
    local = [m for m, how in stats.execution.items() if how == "local shards"]
    print(f"split layers on local shards: {', '.join(local) or 'none'}")
    regions = [m for m, how in stats.execution.items() if how == "region on local shards"]
    if regions:
        print(f"regions on local shards: {', '.join(regions)}")
    for pattern, how in stats.execution.items():
        if how.startswith("DTensor: "):
            print(f"  on DTensors: {pattern}: {how.removeprefix('DTensor: ')}")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from ..plan.schema import plan_json_schema

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
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse has printed
        return e.code if isinstance(e.code, int) else 2
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
