"""The generator of code styles (issue 35): tiny attention and MLP blocks written many ways,
each held to parity and judged split the Megatron way or not.

Run: `python benchmarks/code_styles.py` (60 cases at tp 2 and 4, about 10 s a case and tp
size on 2 busy cores: 20 minutes; `--n 20 --tp 2` for fewer, `--seed 1` for other cases,
`--depart 0.7` for cases further from the common forms, `--only qkv=split,kv=gqa` to fix
choices, `--single` for the common form and each other value of a choice on its own (29
cases, results in code_styles_single.json), `--render` to re-print
benchmarks/results/code_styles.json without running, `--render --full` with every table, as a
run writes them to results/code_styles.md).

The cases are tests/support/code_styles.py's: a `Spec` of independent choices (projection
kind, how a fused q|k|v is cut, head reshapes, where sizes come from, ...), each choice left
at its common form (a Linear, separate q/k/v, `view`, attributes, ...) or, with probability
`--depart`, one of its other values, drawn from `--seed`. For each case at each tp size,
`infer_plan(model, tp_size=tp, example_inputs=ids)` is applied on simulated ranks (real
numbers, one process) and measured:

- parity: forward output and every gradient within 1e-4 of the unsharded model's on both
  execution paths (tests/support/parity.py's `assert_parity`); "error" when something raised;
- Megatron: each attention and MLP block's forward runs no all-gather (counted by
  tests/model_zoo/measure.py on a second call: a fused layer of unequal pieces copies its own
  rows of the weight once per change of the weight, counted apart as `weight_gathers`) and its most loaded rank holds at most a Megatron split's
  elements (10% slack; kv heads fewer than tp shared whole) and fewer than the whole block's.
  A case gets it when every block does. `megatron_exists` is the case's own ground truth:
  no split exists for a single head or for talking heads.

Prints a table per choice value, the two headline numbers (parity failures; the share of
cases with a Megatron split that get it, target 95%), and the misses by structure, with
issue 35's letters and the plan's reasons for the modules kept whole or gathered. Start
reading at `main`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the cases and the measures are the tests' own (tests/support, tests/model_zoo), which
# import no pytest: the benchmark puts tests/ on the path, as zoo.py does
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import _common
import torch
from support.code_styles import AXES, Spec, measure_case

HERE = Path(__file__).resolve().parent

NAME = "code_styles"
TARGET = 0.95

# issue 35's structures a case can hold: letter -> (what, whether a spec holds it)
STRUCTURES: dict[str, tuple[str, Callable[[Spec], bool]]] = {
    "a": ("fused q|k|v, pieces of unequal size", lambda s: s.qkv != "separate" and s.n_kv != s.n_head),
    "b": (
        "heads in the batch dim, an inner width apart from the model's, einops, conv q|k|v",
        lambda s: s.layout == "batch" or s.inner == "wider" or s.reshape == "einops" or s.proj == "conv",
    ),
    "c": ("MoE beside attention", lambda s: s.mlp == "moe"),
    "d": ("a norm over all heads' features", lambda s: s.norm == "over_heads"),
    "e": ("attention weights averaged over heads", lambda s: s.reduce != "none"),
    "f": ("weights that are not nn.Linear", lambda s: s.proj in ("matmul", "einsum") or s.mlp_proj == "param"),
    "g": ("convolutions wider than 1x1, a GroupNorm between", lambda s: s.mlp_proj == "conv3" and s.mlp != "moe"),
    "j": ("one kv head from its own projection", lambda s: s.kv == "mqa" and s.qkv == "separate" and s.n_head > 1),
}  # fmt: skip


# ---- running --------------------------------------------------------------------------------
def draw(n: int, seed: int, depart: float, only: dict[str, str]) -> list[Spec]:
    """`n` distinct specs drawn from `seed`: each choice leaves its common form (the
    default, the first value) with probability `depart`, for one of the others drawn
    uniformly; the choices of `only` are fixed."""
    rng, out, seen = random.Random(seed), list[Spec](), set[Spec]()
    for _ in range(50 * n):
        if len(out) == n:
            break
        picks = {a: v[0] if rng.random() >= depart else rng.choice(v[1:]) for a, v in AXES.items()}
        spec = Spec.of({**picks, **only})
        if spec not in seen:
            seen.add(spec)
            out.append(spec)
    return out


def single() -> list[Spec]:
    """The common form, then every other value of every choice on its own."""
    return [Spec()] + [Spec.of({a: v}) for a, values in AXES.items() for v in values[1:]]


def run(specs: list[Spec], tps: list[int]) -> list[dict[str, Any]]:
    rows = []
    for i, spec in enumerate(specs):
        for tp in tps:
            got = measure_case(spec, tp)
            rows.append(got.as_json())
            mark = {"ok": "ok", "wrong": "WRONG", "error": "ERROR"}[got.parity]
            megatron = "megatron" if got.got else ("-" if not got.exists else "missed")
            print(
                f"[{i + 1}/{len(specs)}] tp {tp} {mark:5} {megatron:8} {got.seconds:5.1f}s  {spec.label()}",
                file=sys.stderr,
                flush=True,
            )
    return rows


# ---- the report -------------------------------------------------------------------------------
def _spec(r: dict[str, Any]) -> Spec:
    return Spec.of(r["spec"])


def _failed(r: dict[str, Any]) -> bool:
    return bool(r["parity"] != "ok")


def _blocks(rows: list[dict[str, Any]], kind: str) -> str:
    """ "k of n": blocks of `kind` split the Megatron way, over the runs where a split exists
    and parity held."""
    oks = [ok for r in rows if r["exists"] and not _failed(r) for b, ok in r["megatron"].items() if b.endswith(kind)]  # fmt: skip
    return f"{sum(oks)} of {len(oks)}" if oks else "-"


HEADERS = ["runs", "parity failures", "Megatron exists", "Megatron got", "share", "attention blocks", "MLP blocks"]  # fmt: skip


def _counts(rows: list[dict[str, Any]]) -> list[Any]:
    exists = [r for r in rows if r["exists"]]
    got = sum(r["got"] for r in exists)
    share = f"{got / len(exists):.0%}" if exists else "-"
    failed = sum(map(_failed, rows))
    return [len(rows), failed, len(exists), got, share, _blocks(rows, "attn"), _blocks(rows, "mlp")]


def axis_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for axis, values in AXES.items():
        for value in values:
            sub = [r for r in rows if r["spec"][axis] == value]
            lines.append([f"{axis}={value}", *_counts(sub)])
    return _common.markdown(["choice", *HEADERS], lines)


def _reason(why: str) -> str:
    """A reason with the case's numbers and the fallback every gathered layer states
    taken out, so alike ones group."""
    why = re.sub(r"\); so its \d+ output features are split and gathered right after.*", ")", why)
    return re.sub(r"\b\d+\b", "N", why)[:300]


def _causes(r: dict[str, Any]) -> list[str]:
    """Why each block of a run missed the Megatron split: the first of its modules' reasons
    in the order they run (q/k/v before o_proj, whose own reason is then mostly that its
    input came gathered), or, where no module was kept whole or gathered, what was measured."""
    out = []
    for block, ok in r["megatron"].items():
        if ok:
            continue
        kind = block.rsplit(".", 1)[-1]
        first = next((w for w in r["whys"] if w.startswith((kind + " ", kind + ".", kind + ":"))), None)  # fmt: skip
        measured = f"{kind}: {r['gathers'][block]} all-gathers, {r['fraction'][block]}x a Megatron split's elements per rank"  # fmt: skip
        out.append(first or measured)
    return out


def structures(rows: list[dict[str, Any]], top: int = 4) -> str:
    """Per structure of issue 35 (and the runs of none): how many get the Megatron split
    where one exists, and the top causes of the misses (`_causes`, one per missed block)."""
    groups = dict(STRUCTURES)
    groups["-"] = ("none of a-j", lambda s: not any(t(s) for _, t in STRUCTURES.values()))
    parts = []
    for letter, (what, holds) in groups.items():
        sub = [r for r in rows if r["exists"] and holds(_spec(r))]
        got = sum(r["got"] for r in sub)
        attn, mlp = _blocks(sub, "attn"), _blocks(sub, "mlp")
        parts.append(
            f"- **{letter}. {what}**: {got} of {len(sub)} runs get it (attention blocks {attn}, MLP blocks {mlp})"
        )  # fmt: skip
        missed = [r for r in sub if not r["got"] and not _failed(r)]
        reasons = Counter(_reason(w) for r in missed for w in _causes(r))
        for reason, n in reasons.most_common(top):
            parts.append(f"    - {n}x {reason}")
    return "\n".join(parts)


def failures(rows: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"- tp {r['tp']} {r['parity']}: {_spec(r).label()}: {r['detail'][:600]}"
        for r in rows
        if _failed(r)
    )


def headline(rows: list[dict[str, Any]]) -> str:
    wrong = sum(r["parity"] == "wrong" for r in rows)
    raised = sum(r["parity"] == "error" for r in rows)
    exists = [r for r in rows if r["exists"]]
    got = sum(r["got"] for r in exists)
    share = got / len(exists) if exists else 0.0
    return (
        f"- parity failures: {wrong + raised} of {len(rows)} runs ({wrong} wrong numbers, {raised} raised; target 0)\n"
        f"- Megatron split got: {got} of {len(exists)} runs where one exists ({share:.0%}; target {TARGET:.0%}); "
        f"attention blocks {_blocks(rows, 'attn')}, MLP blocks {_blocks(rows, 'mlp')}"
    )  # fmt: skip


def single_table(rows: list[dict[str, Any]]) -> str:
    """One line per case of `single`: its blocks at each tp size, and why one missed."""
    tps = sorted({r["tp"] for r in rows})
    lines = []
    for spec in single():
        runs = [r for r in rows if _spec(r) == spec]
        if not runs:  # a value added to the generator after these results were saved
            lines.append([spec.label(), "", *["not run"] * 2 * len(tps), "not in these results"])
            continue
        marks = []
        for tp in tps:
            r = next(r for r in runs if r["tp"] == tp)
            marks += (
                [r["parity"]] * 2
                if _failed(r)
                else ["yes" if ok else "no" for b, ok in sorted(r["megatron"].items())]
            )
        exists = "yes" if runs[0]["exists"] else "no"
        causes = [_reason(c) for r in runs if not _failed(r) for c in _causes(r)]
        why = _spec(runs[0]).label()
        lines.append([why, exists, *marks, causes[0] if causes else ""])
    heads = [f"{kind}, tp {tp}" for tp in tps for kind in ("attention", "MLP")]
    return _common.markdown(["case", "Megatron exists", *heads, "first reason of a miss"], lines)


def render(data: dict[str, Any]) -> str:
    """The headline; the tables folded (results/NAME.md holds them); any parity failure."""
    rows, meta = data["rows"], data["meta"]
    parts = [f"{meta['command']}\n{meta['date']}; {meta['provenance']}", headline(rows)]
    if meta.get("single"):
        table = single_table(rows).splitlines()
        parts.append("\n".join(_common.fold(f"Every case ({len(table) - 2} rows)", table)))
        return "\n\n".join(parts)
    table = axis_table(rows).splitlines()
    by_structure = structures(rows).splitlines()
    caption = "Runs with a Megatron split, by structure (issue 35's letters; a case may hold several):"  # fmt: skip
    folded = [*table, "", caption, "", *by_structure]
    summary = f"Every choice ({len(table) - 2} rows), and the misses by structure"
    parts.append("\n".join(_common.fold(summary, folded)))
    if any(map(_failed, rows)):
        parts += ["Parity failures:", failures(rows)]
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=60, help="how many cases (default 60)")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="tp sizes (default 2 4)")
    parser.add_argument("--seed", type=int, default=0, help="draws the cases (default 0)")
    parser.add_argument(
        "--depart",
        type=float,
        default=0.4,
        help="how often a choice leaves its common form (default 0.4; 1: never the common form)",
    )
    parser.add_argument("--only", default="", help="fixed choices, e.g. qkv=split,kv=gqa")
    parser.add_argument(
        "--single",
        action="store_true",
        help="instead of drawn cases, the common form and each other value on its own",
    )
    _common.render_flags(parser)
    args = parser.parse_args()
    name = NAME + ("_single" if args.single else "")
    if args.render:
        print(_common.rendered(render(_common.load(name)), name, full=args.full))
        return
    only = dict(kv.partition("=")[::2] for kv in args.only.split(",") if kv)
    try:
        Spec.of(only)
    except ValueError as e:
        parser.error(f"--only {e}")
    specs = single() if args.single else draw(args.n, args.seed, args.depart, only)
    rows = run(specs, args.tp)
    meta = {
        "command": "python benchmarks/code_styles.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "provenance": f"tpplan {_common.revision()}; torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs",
        "n": len(specs),
        "tp": args.tp,
        "seed": args.seed,
        "depart": args.depart,
        "only": only,
        "single": args.single,
    }
    data = {"meta": meta, "rows": rows}
    path = _common.save(name, data)
    tables = _common.save_tables(render(data), name)
    print(_common.rendered(render(data), name))
    print(f"\nsaved {path.relative_to(HERE.parent)} and {tables.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
