"""How long `tpplan.infer_plan` takes against model size, on the meta device.

Run: `python benchmarks/infer_time.py` (about 1 minute on 2 cores; `--repeats 5`,
`--render` re-prints benchmarks/results/infer_time.json and redraws the plot).

Models: the shapes of Llama-3-8B, Llama-3-70B and Llama-3.1-405B at their full depth, and a
depth sweep of the 405B shape (2 to 126 layers), built on the meta device (no memory, no
weights). Each point runs in a fresh process, so the first call pays what the command line
pays (imports inside tpplan, first trace); the later calls of the same process are the
steady state, reported as their median. Timing is wall clock on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

MARK = "INFER_TIME_RESULT "
TP = 8
SIZES = ["Llama-3-8B", "Llama-3-70B", "Llama-3.1-405B"]
DEPTHS = [2, 8, 32, 64, 126]
SWEEP = "Llama-3.1-405B"


def measure(name: str, layers: int | None, repeats: int) -> dict[str, Any]:
    """One point, in this (fresh) process."""
    import tpplan

    _common.build_meta(name, num_hidden_layers=1)  # imports transformers' model code, untimed
    t0 = time.perf_counter()
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    model = _common.build_meta(name, **overrides)
    build = time.perf_counter() - t0
    times = []
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        plan = tpplan.infer_plan(model, tp_size=TP)
        times.append(time.perf_counter() - t0)
    return {
        "model": name,
        "layers": model.config.num_hidden_layers,
        "params": sum(p.numel() for p in model.parameters()),
        "build_s": build,
        "first_s": times[0],
        "median_s": _common.median(times[1:]),
        "min_s": min(times[1:]),
        "max_s": max(times[1:]),
        "repeats": repeats,
        "sharded_rules": sum(r.style != "replicate" for r in plan.rules),
    }


def _spawn(name: str, layers: int | None, repeats: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", name, "--repeats", str(repeats)]
    if layers is not None:
        cmd += ["--layers", str(layers)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    for line in run.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = (run.stderr.strip().splitlines() or ["?"])[-1]
    return {"model": name, "layers": layers, "error": tail[:300]}


def render(results: dict[str, Any], plot: bool) -> str:
    rows = []
    for r in results["rows"]:
        if "error" in r:
            rows.append([r["model"], r["layers"], "", "", "", "", f"failed: {r['error']}"])
            continue
        rows.append(
            [
                r["model"],
                r["layers"],
                f"{r['params'] / 1e9:.1f} B",
                f"{r['build_s']:.2f}",
                f"{r['first_s']:.2f}",
                f"{r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f})",
                r["sharded_rules"],
            ]
        )
    headers = [
        "shape",
        "layers",
        "params",
        "build s",
        "infer s, 1st call",
        f"infer s, median of {results['repeats']} more (min-max)",
        "sharded rules",
    ]
    text = "\n".join(
        [
            f"`infer_plan(model, tp_size={TP})` on the meta device; "
            + _common.provenance_line(results["meta"]),
            "",
            _common.markdown(headers, rows),
        ]
    )
    if plot:
        _plot(results)
    return text


def _plot(results: dict[str, Any]) -> None:
    plt = _common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ok = [r for r in results["rows"] if "error" not in r]
    sweep = sorted((r for r in ok if r["model"] == SWEEP), key=lambda r: r["params"])
    full = [r for r in ok if r["layers"] == _common.SHAPES[r["model"]][1]["num_hidden_layers"]]
    full.sort(key=lambda r: r["params"])
    for i, (series, label, marker) in enumerate(
        (
            (sweep, f"{SWEEP} shape, depth sweep", "o"),
            (full, "Llama-3 8B / 70B / 405B, full depth", "s"),
        )
    ):
        x = [r["params"] / 1e9 for r in series]
        style = {"marker": marker, "color": f"C{i}"}
        ax.plot(x, [r["median_s"] for r in series], **style, label=f"{label}: median")
        ax.plot(x, [r["first_s"] for r in series], **style, linestyle=":",
                label=f"{label}: 1st call")  # fmt: skip
    for r in full:
        ax.annotate(r["model"], (r["params"] / 1e9, r["median_s"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -10))  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("parameters (billions, log scale)")
    ax.set_ylabel("infer_plan wall time (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"tpplan.infer_plan on the meta device, tp {TP}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    _common.save_plot(fig, "infer_time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="calls after the first (median)")
    parser.add_argument("--render", action="store_true", help="re-print the saved results")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(MARK + json.dumps(measure(args.worker, args.layers, args.repeats)), flush=True)
        return
    if args.render:
        print(render(_common.load("infer_time"), plot=not args.no_plot))
        return
    points: list[tuple[str, int | None]] = [(name, None) for name in SIZES]
    full_depth = _common.SHAPES[SWEEP][1]["num_hidden_layers"]
    points += [(SWEEP, d) for d in DEPTHS if d != full_depth]
    rows = []
    for name, layers in points:  # one at a time: the timings are the point
        rows.append(_spawn(name, layers, args.repeats))
        r = rows[-1]
        print(f"{name} {r.get('layers')}: {r.get('median_s', r.get('error'))}", file=sys.stderr)
    results = {"meta": _common.versions(), "repeats": args.repeats, "tp": TP, "rows": rows}
    _common.save("infer_time", results)
    print(render(results, plot=not args.no_plot))


if __name__ == "__main__":
    main()
