"""infer and check agree: a plan `infer` writes is never refused by `check` (issue 33).

Run: `python benchmarks/check_bar.py` (every architecture of the tracer bar; `--only
diffllama,mamba` for a subset, `--jobs`, `--timeout`).

For every architecture `infer_bar.py` covers (those with a hand-written plan, and the popular
ones without), the model is built as the CLI builds it, on the meta device from the bar's
small config (`infer_bar.small_config`), `infer_plan` at tp 2, then `check_plan` at tp 2 of
that plan: what `tpplan infer` then `tpplan check` do. Each row says "sound", "sound, with a
note" (the dry run met what fake tensors cannot run: a `DryRunSkipped` note, never a
problem), "refused" (with the first problem: the bar is zero of these), or where it stopped
before check (build or infer: not a refusal, reported for completeness). Each architecture
runs in a subprocess of its own, so a crash costs one row. Results go to
benchmarks/results/check_bar.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "check_bar.json"
MARK = "CHECK_BAR_RESULT "
TP = 2


def _run_one(arch: str) -> dict[str, Any]:
    import torch
    from transformers.utils import logging as hf_logging

    import tpplan
    from tpplan.errors import DryRunSkipped

    sys.path.insert(0, str(HERE))
    from infer_bar import model_class, small_config

    hf_logging.set_verbosity_error()
    row: dict[str, Any] = {"arch": arch}
    try:
        config = small_config(arch)
        with torch.device("meta"):
            model = model_class(arch, config)(config).float().eval()
    except Exception as e:
        return {**row, "status": "build failed", "reason": _said(e)}
    try:
        plan = tpplan.infer_plan(model, tp_size=TP)
    except Exception as e:
        return {**row, "status": "infer failed", "reason": _said(e)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DryRunSkipped)
        try:
            problems = tpplan.check_plan(plan, model, tp_size=TP)
        except Exception as e:
            return {**row, "status": "check crashed", "reason": _said(e)}
    notes = [str(w.message) for w in caught if issubclass(w.category, DryRunSkipped)]
    if problems:
        return {**row, "status": "refused", "reason": str(problems[0]), "problems": len(problems)}
    return {**row, "status": "sound, with a note" if notes else "sound", "reason": " ".join(notes)}


def _said(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]


def _spawn(arch: str, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", arch]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"arch": arch, "status": "timeout", "reason": f"no result within {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [""]
    return {"arch": arch, "status": "crashed", "reason": f"exit {proc.returncode}: {tail[0][:300]}"}


def _save(rows: dict[str, dict[str, Any]]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": [rows[a] for a in sorted(rows)]}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types (e.g. diffllama,mamba)")
    parser.add_argument("--jobs", type=int, default=2, help="workers at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(MARK + json.dumps(_run_one(args.worker)), flush=True)
        return
    sys.path.insert(0, str(HERE))
    from infer_bar import NOPLAN, plan_archs

    archs = sorted(set(plan_archs()) | set(NOPLAN))
    if args.only:
        archs = [a for a in args.only.split(",") if a]
    rows: dict[str, dict[str, Any]] = (
        {r["arch"]: r for r in json.loads(RESULTS.read_text())["rows"]} if RESULTS.exists() else {}
    )
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for r in pool.map(lambda a: _spawn(a, args.timeout), archs):
            rows[r["arch"]] = r
            _save(rows)  # after each row: a run stopped early keeps what it found
            print(f"[{time.perf_counter() - t0:6.0f}s] {r['arch']:32} {r['status']:20} "
                  f"{r.get('reason', '')[:110]}", file=sys.stderr, flush=True)  # fmt: skip
    counts = Counter(r["status"] for r in rows.values())
    print(", ".join(f"{n} {s}" for s, n in counts.most_common()))
    for r in sorted(rows.values(), key=lambda r: r["arch"]):
        if r["status"] != "sound":
            print(f"- {r['arch']}: {r['status']}: {r.get('reason', '')[:200]}")


if __name__ == "__main__":
    main()
