"""Parameter memory per rank against the tp size, tpplan's plan next to transformers' own.

Run: `python benchmarks/memory_tp.py` (about 2 minutes on 2 cores; `--models Llama-3-8B`,
`--tp 1 2 4 8`, `--render` re-prints benchmarks/results/memory_tp.json and redraws the plot;
`--render --full` adds every model's table per tp size, which a run writes to
results/memory_tp.md).

Each model is built at its published shape in bf16 on the meta device and sharded on a fake
process group of each tp size (one process, no memory, no numbers: shapes only):

- tpplan: `infer_plan(model, tp_size=N)` applied with `apply_plan`. Where N does not divide a
  split dim (heads, KV heads, experts), the inferred plan keeps that region whole and says why;
  the table names what was kept whole. Separately, the plan inferred without a tp size (the
  one `tpplan infer` writes) is checked at N with `check_plan`: "refused" means `apply_plan`
  would refuse it, listing the problems.
- transformers: its hand-written `base_model_tp_plan` applied by transformers' own
  `apply_tensor_parallelism` (what `from_pretrained(..., tp_plan="auto")` runs); at tp 1
  transformers applies no plan.

"per rank" is the parameter bytes rank 0 holds (torch gives the first ranks the larger pieces
of an uneven split, so rank 0 is the most loaded). "fwd" says whether one forward pass runs on
the sharded model: it is run on a 2-layer copy of the same widths (shapes are all the fake
group can check), so a plan that cuts a head in half fails here as it would on GPUs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

MODELS = ["Llama-3-8B", "Llama-3-70B", "Qwen3-30B-A3B", "Qwen3-30B-A3B:expert"]
TPS = [1, 2, 4, 8, 16, 32, 64]
GIB = 2**30


def _model(spec: str, **overrides: Any) -> Any:
    import torch

    return _common.build_meta(spec.split(":")[0], dtype=torch.bfloat16, **overrides)


def _forward_runs(spec: str, tp: int, shard: Any) -> str:
    """'ok', or the error one forward of a 2-layer copy raises once sharded."""
    import torch

    from tpplan._runtime.inputs import example_inputs
    from tpplan._runtime.local import fake_ranks

    model = _model(spec, num_hidden_layers=2)
    try:
        with fake_ranks(tp) as mesh, _common.collective_counter(), torch.no_grad():
            shard(model, mesh)
            model(**example_inputs(model, batch=1, seq=16, device="meta"))
    except Exception as e:
        return f"{type(e).__name__}: {' '.join(str(e).split())}"[:200]
    return "ok"


def _kept_whole(plan: Any, tp: int) -> list[str]:
    """Reasons of the rules that keep a region whole because of this tp size."""
    out = []
    for rule in plan.rules:
        if rule.style == "replicate" and f"tp {tp} " in f"{rule.why} ":
            out.append(f"{rule.match}: {rule.why}")
    return out


def measure(spec: str, tp: int) -> dict[str, Any]:
    import tpplan
    from tpplan._runtime.local import fake_ranks

    experts = spec.split(":")[1] if ":" in spec else "tensor"
    row: dict[str, Any] = {"model": spec, "tp": tp}
    model = _model(spec)
    row["total"] = _common.local_param_bytes(model)

    # tpplan, inferred for this tp size
    plan = tpplan.infer_plan(model, tp_size=tp, experts=experts)
    row["kept"] = _kept_whole(plan, tp)
    with fake_ranks(tp) as mesh:
        try:
            tpplan.apply_plan(model, mesh, plan)
        except tpplan.PlanProblemsError as e:
            # apply_plan's dry run refuses what would crash in torch: no bytes per rank then,
            # and the forward is recorded as refused with apply's own message
            row["ours"], row["ours_fwd"] = None, f"refused by apply_plan: {e.problems[0]}"[:200]
            model = None
        if model is not None:
            row["ours"] = _common.local_param_bytes(model)

    def ours(m: Any, mesh: Any) -> None:
        tpplan.apply_plan(m, mesh, tpplan.infer_plan(m, tp_size=tp, experts=experts))

    if row["ours"] is not None:
        row["ours_fwd"] = _forward_runs(spec, tp, ours)

    # the tp-free plan, checked at this tp size
    problems = tpplan.check_plan(
        tpplan.infer_plan(_model(spec), experts=experts), _model(spec), tp_size=tp
    )
    row["check"] = [str(p) for p in problems]

    # transformers' hand-written plan, applied by transformers
    if tp == 1:
        row["theirs"] = row["total"]
        row["theirs_fwd"] = "ok"
    elif experts == "tensor":
        # transformers' expert parallelism is a separate ep_plan over an ep mesh axis, not
        # a mode of its tp plan: the expert rows compare with tpplan's tensor mode only
        model = _model(spec)
        with fake_ranks(tp) as mesh:
            _common.apply_transformers_plan(model, mesh)
            row["theirs"] = _common.local_param_bytes(model)
        row["theirs_fwd"] = _forward_runs(spec, tp, _common.apply_transformers_plan)
    return row


def _kept_summary(kept: list[str]) -> str:
    """'q_proj, k_proj, ...: reason' for the kept-whole rules, grouped by their reason."""
    by_reason: dict[str, list[str]] = {}
    for line in kept:
        match, _, why = line.partition(": ")
        why = why.removeprefix("kept whole: ")
        by_reason.setdefault(why, []).append(match.rsplit(".", 1)[-1])
    return "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())


def _fwd_cell(status: str | None) -> str:
    if status is None:
        return ""
    return "runs" if status == "ok" else f"fails: {status[:90]}"


def _at(rows: list[dict[str, Any]], holds: Any) -> str:
    """The tp sizes of `rows` where `holds(row)`, as "1, 2, 4" ("none" where none)."""
    return ", ".join(str(r["tp"]) for r in rows if holds(r)) or "none"


def _summary(results: dict[str, Any]) -> list[str]:
    """One row per model: tpplan's bytes per rank against the ideal, and the tp sizes where
    each plan's forward runs and where the tp-free plan is accepted."""
    table = []
    for spec in results["models"]:
        rows = [r for r in results["rows"] if r["model"] == spec]
        if not rows:
            continue
        over = max(r["ours"] * r["tp"] / r["total"] for r in rows if r["ours"] is not None)
        theirs = (
            _at(rows, lambda r: r.get("theirs_fwd") == "ok")
            if all("theirs" in r for r in rows)
            else "(its tp plan: see the tensor row)"
        )
        table.append(
            [
                spec,
                f"{rows[0]['total'] / GIB:.1f}",
                f"{over:.3f}",
                _at(rows, lambda r: r["ours_fwd"] == "ok"),
                theirs,
                _at(rows, lambda r: not r["check"]),
            ]
        )
    headers = ["model", "GiB (bf16)", "tpplan / ideal, at most", "tpplan's forward runs at tp"]
    headers += ["transformers' forward runs at tp", "tp-free plan accepted at tp"]
    return _common.markdown(headers, table).splitlines()


def _model_table(spec: str, rows: list[dict[str, Any]]) -> list[str]:
    """A model's row per tp size, and the first problem `check_plan` reports."""
    out = [f"**{spec}** ({rows[0]['total'] / GIB:.1f} GiB in bf16)", ""]
    table = []
    for r in rows:
        kept = _kept_summary(r["kept"])
        check = "accepted" if not r["check"] else f"refused ({len(r['check'])} problems)"
        theirs = f"{r['theirs'] / GIB:.2f}" if "theirs" in r else "(its tp plan: see tensor row)"
        table.append(
            [
                r["tp"],
                f"{r['total'] / r['tp'] / GIB:.2f}",
                f"{r['ours'] / GIB:.2f}" if r["ours"] is not None else "refused",
                _fwd_cell(r["ours_fwd"]),
                theirs,
                _fwd_cell(r.get("theirs_fwd")),
                check,
                kept,
            ]
        )
    headers = ["tp", "ideal", "tpplan", "tpplan fwd", "transformers", "transformers fwd"]
    headers += ["tp-free plan at this tp", "tpplan keeps whole (its reason)"]
    out.append(_common.markdown(headers, table))
    refused = next((r for r in rows if r["check"]), None)
    if refused:
        out += ["", f"First problem `check_plan` reports at tp {refused['tp']}: "
                f"{refused['check'][0][:300]}"]  # fmt: skip
    return out


def render(results: dict[str, Any], plot: bool) -> str:
    """The summary per model; each model's table per tp size folded (results/memory_tp.md)."""
    out = [
        "Parameter GiB per rank (bf16), rank 0; ideal = model / tp. "
        + _common.provenance_line(results["meta"]),
        "",
        *_summary(results),
        "",
    ]
    tables = []
    for spec in results["models"]:
        rows = [r for r in results["rows"] if r["model"] == spec]
        if rows:
            tables += [*_model_table(spec, rows), ""]
    out += _common.fold(
        f"Every model at every tp size ({len(results['models'])} tables)", tables[:-1]
    )
    if plot:
        _plot(results)
    return "\n".join(out)


def _plot(results: dict[str, Any]) -> None:
    plt = _common.pyplot()
    models = [m for m in results["models"] if any(r["model"] == m for r in results["rows"])]
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models), 3.8), squeeze=False)
    for ax, spec in zip(axes[0], models, strict=True):
        rows = sorted((r for r in results["rows"] if r["model"] == spec), key=lambda r: r["tp"])
        tps = [r["tp"] for r in rows]
        ax.plot(tps, [r["total"] / r["tp"] / GIB for r in rows], "k:", label="ideal (model / tp)")
        ours = [r for r in rows if r["ours"] is not None]
        ax.plot([r["tp"] for r in ours], [r["ours"] / GIB for r in ours], "o-", label="tpplan")
        theirs = [r for r in rows if "theirs" in r]
        if theirs:
            ax.plot([r["tp"] for r in theirs], [r["theirs"] / GIB for r in theirs], "s--",
                    label="transformers' plan", alpha=0.8)  # fmt: skip
        bad = [(r["tp"], r[side] / GIB) for r in rows for side in ("ours", "theirs")
               if r.get(f"{side}_fwd", "ok") != "ok" and r.get(side) is not None]  # fmt: skip
        if bad:
            ax.plot(*zip(*bad, strict=True), "rx", markersize=10, label="its forward fails")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(tps, [str(t) for t in tps])
        ax.set_xlabel("tp size")
        ax.set_title(spec, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("parameter GiB per rank (bf16)")
    axes[0][0].legend(fontsize=7)
    _common.save_plot(fig, "memory_tp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS, help="NAME or NAME:expert")
    parser.add_argument("--tp", type=int, nargs="+", default=TPS)
    _common.render_flags(parser)
    parser.add_argument("--no-plot", action="store_true", help="print the tables only")
    args = parser.parse_args()
    if args.render:
        text = render(_common.load("memory_tp"), plot=not args.no_plot)
        print(_common.rendered(text, "memory_tp", full=args.full))
        return
    rows = []
    for spec in args.models:
        for tp in args.tp:
            rows.append(measure(spec, tp))
            ours = rows[-1]["ours"]
            shown = f"{ours / GIB:.2f} GiB" if ours is not None else rows[-1]["ours_fwd"]
            print(f"{spec} tp {tp}: {shown}", file=sys.stderr)
    results = {"meta": _common.versions(), "models": args.models, "rows": rows}
    _common.save("memory_tp", results)
    text = render(results, plot=not args.no_plot)
    _common.save_tables(text, "memory_tp")
    print(_common.rendered(text, "memory_tp"))


if __name__ == "__main__":
    main()
