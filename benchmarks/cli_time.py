"""How long the `tpplan` command takes to answer (issue 22), wall time of a fresh process.

Times, each run 3 times in a subprocess (best and all three, round by round): `tpplan schema`, a usage
error, `tpplan check plans/llama.yaml llama --tp 2 --set num_hidden_layers=1` with a cold
answer cache (a fresh cache folder per run) and with a warm one (the same check made once
before), and the same check of the full-depth model with --no-cache. Prints a markdown
table with the machine (CPU count, load average before and after) and the tpplan commit.

    python benchmarks/cli_time.py

The command runs as `python -m tpplan.cli` from this checkout (PYTHONPATH is set to it),
so an installed tpplan elsewhere is not what is timed.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from _common import markdown, revision

ROOT = Path(__file__).resolve().parents[1]
RUNS = 3
CHECK = ["check", "plans/llama.yaml", "llama", "--tp", "2", "--set", "num_hidden_layers=1"]


def _time(argv: list[str], cache: Path, want: int) -> float:
    """Seconds one `tpplan ARGV` took, start to exit; its exit code must be `want`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TPPLAN_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tpplan.cli", *argv], cwd=ROOT, env=env, capture_output=True
    )
    took = time.perf_counter() - start
    if done.returncode != want:
        raise SystemExit(f"tpplan {' '.join(argv)} exited {done.returncode}: {done.stderr!r}")
    return took


def main() -> None:
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fresh = iter(Path(tmp, f"cold{i}") for i in range(RUNS))
        warm = Path(tmp, "warm")
        _time(CHECK, warm, 0)  # the answer the warm runs find
        cases = [
            ("`tpplan schema`", lambda: _time(["schema"], warm, 0), "0.5"),
            ("usage error (`tpplan check`)", lambda: _time(["check"], warm, 2), "0.5"),
            ("check, 1 layer, cold cache", lambda: _time(CHECK, next(fresh), 0), "-"),
            ("check, 1 layer, warm cache", lambda: _time(CHECK, warm, 0), "2"),
            (
                "check, 32 layers, --no-cache",
                lambda: _time([*CHECK[:5], "--no-cache"], warm, 0),
                "-",
            ),
        ]
        # round by round, each case once per round: a machine that gets busier part way
        # slows every case alike instead of the last ones
        times: list[list[float]] = [[] for _ in cases]
        for _ in range(RUNS):
            for i, (_, run, _) in enumerate(cases):
                times[i].append(run())
        for (name, _, target), took in zip(cases, times, strict=True):
            all3 = ", ".join(f"{t:.2f}" for t in took)
            rows.append([name, f"{min(took):.2f}", all3, target])
    load_after = os.getloadavg()
    print(
        f"tpplan {revision()}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {load_before[0]:.2f} before and "
        f"{load_after[0]:.2f} after; Python {platform.python_version()}, torch "
        f"{metadata.version('torch')}, transformers {metadata.version('transformers')}\n"
    )
    print(markdown(["command", "best of 3 (s)", "all 3 (s)", "target (s)"], rows))


if __name__ == "__main__":
    main()
