"""Mixture-of-experts table: tpplan's experts against transformers' hand-written plans.

Run: `python benchmarks/moe_bar.py` (about 15 minutes on 2 cores; `--only qwen3_moe,gpt_oss`
for a subset, `--render` to re-print benchmarks/results/moe_bar.json without running;
`--render --full` adds the table of every model, which a run writes to results/moe_bar.md).

For every model type of the installed transformers whose default config has experts (the
same small configs as `infer_bar.py`: hidden 64, 2 layers, 4 experts, 2 per token), at tp 2:

- ours, mode tensor and mode expert: `infer_plan(model, tp_size=2, experts=MODE)` applied on
  two simulated ranks; forward parity against the unsharded model (max abs difference, fp32,
  target <= 1e-4), parameter bytes on the most loaded rank as a fraction of the model, and
  the collectives one forward issues (torch's CommDebugMode); how many expert modules the
  plan splits in that mode;
- theirs: the same model saved with `save_pretrained` and loaded by transformers itself with
  `from_pretrained(folder, tp_plan="auto")` on two gloo processes under torchrun: the same
  three figures.

Targets (issue "Mixture-of-experts"): parity in both modes on at least 90% of the models, and
at most the hand-written plan's parameters per rank. Each model runs in its own subprocess
(this file with `--worker`), so a crash or a hang costs one row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common  # noqa: E402
import infer_bar  # noqa: E402  (the small configs and helpers are shared)

NAME = "moe_bar"
RESULTS = HERE / "results" / f"{NAME}.json"
MARK = "MOE_BAR_RESULT "
TOL = 1e-4
TP = 2
MODES = ("tensor", "expert")


def moe_archs() -> list[str]:
    """Model types whose default config has more than one expert."""
    from transformers import CONFIG_MAPPING

    out = []
    for model_type in sorted(set(infer_bar.plan_archs()) | set(infer_bar.NOPLAN)):
        try:
            default = CONFIG_MAPPING[model_type]()
        except Exception:
            continue
        if infer_bar._has_experts(default):
            out.append(model_type)
    return out


def _collectives(run: Any) -> tuple[Any, int]:
    """run() and the number of collectives it issued (waits not counted). torch's
    CommDebugMode counts the same, but its module tracker fails on some models."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.overloadpacket.__name__
            if func.namespace in ("_c10d_functional", "c10d_functional", "c10d") and name not in (
                "wait_tensor",
                "_wrap_tensor_autograd",
                "barrier",
            ):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        out = run()
    return out, Count.n


def _ours(
    model: Any, inputs: dict[str, Any], given: Any, want: Any, mode: str, total: int
) -> dict[str, Any]:
    import copy

    import torch

    import tpplan
    from tpplan._runtime.local import simulated_ranks
    from tpplan._runtime.tree import first_tensor

    row: dict[str, Any] = {}
    try:
        plan = tpplan.infer_plan(model, tp_size=TP, experts=mode, example_inputs=given)
    except Exception as e:
        return {"error": infer_bar._reason(e)["reason"]}
    rules = [r for r in plan.rules if r.style == "experts"]
    names = [n for n, _ in model.named_modules() if n]
    from tpplan.plan.patterns import match_names

    row["experts_split"] = sum(len(match_names(r.match, names)) for r in rules)
    row["experts_in_mode"] = sum(
        len(match_names(r.match, names)) for r in rules if (r.mode or "tensor") == mode
    )
    row["experts_modules"] = sum(
        1 for _, m in model.named_modules() if any(p.dim() == 3 for p in m.parameters(False))
    )
    kept = [r.why for r in plan.rules if r.style == "replicate" and "expert" in r.why]
    if kept and not rules:
        row["kept"] = kept[0][:200]
    with simulated_ranks(TP) as mesh:
        try:
            sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
            with torch.no_grad():
                got, row["collectives"] = _collectives(lambda: first_tensor(sharded(**inputs)))
            row["fwd_diff"] = infer_bar._max_diff(got, want)
            row["fraction"] = infer_bar._bytes_per_rank(sharded) / total
        except Exception as e:
            row["error"] = infer_bar._reason(e)["reason"]
    return row


def _theirs(model: Any, inputs: dict[str, Any], want: Any, total: int) -> dict[str, Any]:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        try:
            model.save_pretrained(folder / "model")
        except Exception as e:
            return {"error": f"save_pretrained: {infer_bar._reason(e)['reason']}"}
        torch.save({"inputs": inputs, "want": want, "total": total}, folder / "io.pt")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={TP}", __file__, "--theirs", str(folder)]
        cmd += ["--class", type(model).__name__]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        except subprocess.TimeoutExpired:
            return {"error": "no result within 120 s"}
        for line in run.stdout.splitlines():
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        tail = [ln for ln in run.stderr.splitlines() if "Error" in ln][-1:] or ["?"]
        return {"error": tail[0][:300]}


def _theirs_rank(folder: Path, cls_name: str) -> None:
    """One torchrun rank: transformers applies its own plan while loading."""
    import torch
    import torch.distributed as dist
    import transformers
    from transformers.utils import logging as hf_logging

    from tpplan._runtime.tree import first_tensor

    hf_logging.set_verbosity_error()
    dist.init_process_group("gloo")
    io = torch.load(folder / "io.pt", weights_only=False)
    result: dict[str, Any] = {}
    try:
        cls = getattr(transformers, cls_name)
        model = cls.from_pretrained(folder / "model", tp_plan="auto", dtype=torch.float32).eval()
        with torch.no_grad():
            got, result["collectives"] = _collectives(lambda: first_tensor(model(**io["inputs"])))
        if isinstance(got, torch.distributed.tensor.DTensor):
            got = got.full_tensor()
        result["fwd_diff"] = float((got.double() - io["want"].double()).abs().max())
        held = 0
        for p in model.parameters():
            local = p.to_local() if isinstance(p, torch.distributed.tensor.DTensor) else p
            held += local.numel() * local.element_size()
        result["fraction"] = held / io["total"]
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    if dist.get_rank() == 0:
        print(MARK + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 on gloo aborts now and then in interpreter teardown


def _run_one(model_type: str) -> dict[str, Any]:
    import copy

    import torch
    from transformers.utils import logging as hf_logging

    from tpplan._runtime.tree import first_tensor

    hf_logging.set_verbosity_error()
    res: dict[str, Any] = {"arch": model_type, "source": infer_bar._source_hash()}
    start = time.perf_counter()
    try:
        config = infer_bar.small_config(model_type)
        cls = infer_bar.model_class(model_type, config)
        res["class"] = cls.__name__
        torch.manual_seed(0)
        model = cls(config).float().eval()
    except Exception as e:
        return {**res, "status": "build failed", **infer_bar._reason(e)}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    try:
        # infer_bar's inputs, so a forward that needs more than token ids runs here too
        inputs, given = infer_bar.model_inputs(model_type, model)
        with torch.no_grad():
            want = first_tensor(copy.deepcopy(model)(**inputs)).detach()
    except Exception as e:
        return {**res, "status": "reference failed", **infer_bar._reason(e)}
    for mode in MODES:
        res[mode] = _ours(model, inputs, given, want, mode, total)
    if getattr(type(config), "base_model_tp_plan", None):
        res["theirs"] = _theirs(model, inputs, want, total)
    res["status"] = "ok"
    res["seconds"] = round(time.perf_counter() - start, 1)
    return res


def _spawn(arch: str, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", arch]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"arch": arch, "status": "timeout", "reason": f"no result within {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
    return {"arch": arch, "status": "crashed", "reason": tail[0][:300]}


# ---- the table ------------------------------------------------------------------------------
def _ok(side: dict[str, Any] | None) -> bool:
    return bool(side) and side.get("fwd_diff", math.inf) <= TOL  # type: ignore[union-attr]


def _cell(side: dict[str, Any] | None) -> str:
    if not side:
        return "| | | "
    if "error" in side:
        return f"| ✗ {side['error'][:70]} | | "
    diff = side.get("fwd_diff", math.inf)
    mark = "" if diff <= TOL else " ✗"
    return f"| {diff:.1e}{mark} | {side.get('fraction', math.nan):.3f} | {side.get('collectives', '')} "


def render(results: dict[str, Any]) -> str:
    rows = results.get("rows", [])
    ran = [r for r in rows if r.get("status") == "ok"]
    lines = [
        f"transformers {results.get('transformers')}, torch {results.get('torch')}, tp {TP}; "
        f"tpplan sources {', '.join(sorted({r.get('source', '?') for r in ran}))}.",
        "",
    ]
    summary = ["| bar | target | result |", "|---|---|---|"]
    for mode in MODES:
        good = [r for r in ran if _ok(r.get(mode))]
        split = [r for r in ran if r.get(mode, {}).get("experts_in_mode")]
        summary.append(
            f"| parity, mode {mode} | ≥ 90% of {len(ran)} that build | {len(good)} "
            f"({100 * len(good) / max(len(ran), 1):.0f}%); experts split in this mode in {len(split)} |"
        )
    with_theirs = [r for r in ran if _ok(r.get("theirs")) and _ok(r.get("tensor"))]
    le = [r for r in with_theirs if r["tensor"]["fraction"] <= r["theirs"]["fraction"] + 1e-3]
    summary.append(
        f"| params per rank ≤ transformers' (mode tensor) | each | {len(le)} of {len(with_theirs)} "
        "where both run at parity |"
    )
    theirs_ok = [r for r in ran if _ok(r.get("theirs"))]
    has_theirs = [r for r in ran if "theirs" in r]
    summary.append(
        f"| transformers' own plan, parity | (reference) | {len(theirs_ok)} of {len(has_theirs)} |"
    )
    lines += [*summary, ""]
    head = "| arch | experts split (tensor / expert / modules) "
    for side in ("ours tensor", "ours expert", "transformers"):
        head += f"| {side}: fwd Δ | params/rank | collectives "
    table = [head + "| note |", "|---" * 12 + "|"]
    for r in rows:
        if r.get("status") != "ok":
            table.append(
                f"| {r['arch']} | {r.get('status')} "
                + "| " * 9
                + f"| {r.get('reason', '')[:120]} |"
            )
            continue
        t, e = r.get("tensor", {}), r.get("expert", {})
        split = f"{t.get('experts_in_mode', '?')} / {e.get('experts_in_mode', '?')} / {t.get('experts_modules', '?')}"
        note = t.get("kept", "") or e.get("kept", "")
        table.append(
            f"| {r['arch']} | {split} {_cell(t)}{_cell(e)}{_cell(r.get('theirs'))}| {note[:160]} |"
        )
    lines += _common.fold(f"Every model ({len(rows)} rows)", table)
    return "\n".join(lines)


def _revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0)
    _common.render_flags(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--theirs", help=argparse.SUPPRESS)
    parser.add_argument("--class", dest="cls", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.theirs:
        _theirs_rank(Path(args.theirs), args.cls)
        return
    if args.worker:
        print(MARK + json.dumps(_run_one(args.worker)), flush=True)
        return
    if args.render:
        print(_common.rendered(render(json.loads(RESULTS.read_text())), NAME, full=args.full))
        return
    import torch
    import transformers

    archs = moe_archs()
    if args.only:
        archs = [a for a in archs if a in set(args.only.split(","))]
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    old = {r["arch"]: r for r in results.get("rows", [])} if args.only else {}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for r in pool.map(lambda a: _spawn(a, args.timeout), archs):
            old[r["arch"]] = r
            print(
                f"[{time.perf_counter() - t0:6.0f}s] {r['arch']:28} {r.get('status')}",
                file=sys.stderr,
                flush=True,
            )
    results.update(
        transformers=transformers.__version__,
        torch=torch.__version__,
        tpplan=_revision(),
        rows=[old[a] for a in sorted(old)],
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    _common.save_tables(render(results), NAME)
    print(_common.rendered(render(results), NAME))


if __name__ == "__main__":
    main()
