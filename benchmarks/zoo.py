"""The model zoo's report card: what `infer_plan` makes of models from packages tpplan never
saw (torchtitan 0.2.2's Llama 3, Llama 4 (mixture of experts), Qwen3 and DeepSeek-V3,
transformers' DeepSeek-V3, timm 1.0.31's ViT, Swin and ConvNeXt, diffusers 0.42.1's Flux
and SD3 transformers and UNet2DConditionModel, nanoGPT's model.py).

Run: `python benchmarks/zoo.py` (2 to 3 minutes on a 2-core CPU; needs the `zoo` extra:
`pip install -e '.[zoo]'`; `--only timm.vit,nanogpt` for a subset, `--render` to re-print
the last results from benchmarks/results/zoo.json without running anything, `--render
--full` with the table of every model, which a run writes to results/zoo.md).

The models are tests/model_zoo's: each built tiny from its own package's classes, random
weights, no download (tests/test_zoo.py holds the same models to parity). For each, at tp 2
and 4, with and without sequence parallel, `infer_plan(model, tp_size=N, example_inputs=x,
sequence_parallel=sp)` is applied to a copy on N simulated ranks (real numbers, one process)
and measured:

- parameters per rank: bytes the most loaded rank holds over the model's (0.5 at tp 2 when
  everything splits evenly);
- parity: the forward output's max abs difference from the unsharded model's, and "ok" when
  the forward and every parameter's gradient are within 1e-4 (tests/support/parity.py's
  `assert_parity`; fp32, two blocks per stack);
- blocks (without sequence parallel): the attention and MLP blocks are listed per model by
  module path in tests/model_zoo/models.py (`Entry.blocks`, read off each package's source,
  never off tpplan's plan: the oracle). A block is split the Megatron way when its forward,
  counted by torch's CommDebugMode, runs no all-gather and at least one of its Linear
  weights is sharded. "forward collectives per block" lists what one block of each kind
  runs at tp 2.

Targets, printed PASS or FAIL below the table (reported, not asserted): (a) at least 90% of
all zoo blocks split the Megatron way, and all of torchtitan's, both DeepSeek-V3s', timm
ViT's and ConvNeXt's, Flux's, the UNet's and the CLIP's; (b) every transformer holds at
most 0.55 of its parameters per rank at tp 2 (the CLIP too), and ConvNeXt (whose 7x7
depthwise convolutions stay whole) and the UNet at most 0.6, in the zoo's shape and at
published shapes built on the meta device (convnext_tiny; Stable Diffusion 1.5's UNet;
open_clip's ViT-B-32 where open_clip_torch is installed); (c) parity in
every run, or a loud failure where an entry says sequence parallel does not fit.

Each model runs in a subprocess of its own (this file with `--worker`), so a crash or a hang
costs one row. Start reading at `main`; one model's runs are `_run_model`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

HERE = Path(__file__).resolve().parent
# the zoo's models and the parity check are the tests' own (tests/model_zoo,
# tests/support/parity.py), which import no pytest: the benchmark puts tests/ on the path
TESTS = HERE.parent / "tests"
MARK = "ZOO_RESULT "
TPS = (2, 4)
RUNS = [(tp, sp) for tp in TPS for sp in (False, True)]
MEGATRON_SHARE = 0.9
PARAMS_TARGET = 0.55
PARAMS_TARGETS = {"timm.convnext": 0.6, "timm.convnext_conv": 0.6, "diffusers.unet": 0.6}
# (the rest: PARAMS_TARGET)
UNET_SD15 = "diffusers UNet2DConditionModel (SD 1.5)"
# published shapes measured on the meta device for target (b): {name: its target}; timm's
# convnext_tiny, and open_clip's ViT-B-32 where open_clip_torch is installed (not in the zoo
# extra: its torchvision requirement would move the pinned CPU torch)
SHAPES = {"convnext_tiny": 0.6, "open_clip ViT-B-32": 0.55, UNET_SD15: 0.6}
OPTIONAL_SHAPES = {"open_clip ViT-B-32"}
# models whose every block must be split the Megatron way (target a)
ALL_MEGATRON = [
    "torchtitan.llama3",
    "torchtitan.llama4",
    "torchtitan.qwen3",
    "torchtitan.deepseek_v3",
    "transformers.deepseek_v3",
    "timm.vit",
    "timm.convnext",
    "timm.convnext_conv",
    "diffusers.flux",
    "diffusers.unet",
    "torch.clip",
]
PACKAGES = ["torch", "transformers", "timm", "diffusers", "torchtitan"]


def _key(tp: int, sp: bool) -> str:
    return f"tp {tp}" + (" + SP" if sp else "")


# ---- one model, in a worker process ---------------------------------------------------------
def _reason(stage: str, e: BaseException) -> str:
    first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
    return f"{stage}: {type(e).__name__}: {first}"[:300]


def _run_one(name: str, tp: int, sp: bool) -> dict[str, Any]:
    """Infer, measure and hold to parity one plan of one model."""
    from model_zoo import ZOO, build, measure
    from support.parity import assert_parity

    import tpplan

    model, x = build(name)
    run: dict[str, Any] = {}
    t0 = time.perf_counter()
    refused = sp and ZOO[name].no_sp  # fails loudly, as the entry says it must
    try:
        plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x, sequence_parallel=sp)
    except Exception as e:
        if refused and isinstance(e, tpplan.TpplanError):
            return {"ok": True, "refused": ZOO[name].no_sp}
        return {"ok": False, "reason": _reason("infer_plan", e)}
    run["infer_s"] = round(time.perf_counter() - t0, 2)
    try:
        got = measure(model, plan, tp, x, ZOO[name].blocks, ZOO[name].apart)
    except Exception as e:
        if refused and isinstance(e, RuntimeError):
            return {**run, "ok": True, "refused": ZOO[name].no_sp}
        return {**run, "ok": False, "reason": _reason("sharded forward", e)}
    run.update(
        param_fraction=got.param_fraction,
        forward_error=got.forward_error,
        # [path, kind] pairs in module order: a list keeps its order through the JSON
        blocks=[[b, kind] for b, kind in got.blocks.items()],
        collectives=got.collectives,
        megatron=[b for b in got.blocks if got.megatron(b)],
    )
    try:
        assert_parity(model, plan, tp, x)
    except Exception as e:
        return {**run, "ok": False, "reason": _reason("parity", e)}
    return {**run, "ok": True}


def _source_hash() -> str:
    """A hash of tpplan's sources as this worker imported them: others may edit tpplan while
    a run goes on, and rows made from different sources should say so."""
    import hashlib

    import tpplan

    digest = hashlib.sha1()
    for path in sorted(Path(tpplan.__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


def _run_model(name: str) -> dict[str, Any]:
    from model_zoo import ZOO, build

    model, _ = build(name)
    row: dict[str, Any] = {
        "model": name,
        "package": ZOO[name].package,
        "class": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "source": _source_hash(),
        "runs": {},
    }
    for tp, sp in RUNS:
        try:
            row["runs"][_key(tp, sp)] = _run_one(name, tp, sp)
        except Exception as e:  # a failure outside the stages above: the build, say
            row["runs"][_key(tp, sp)] = {"ok": False, "reason": _reason("run", e)}
    return row


def _worker(name: str) -> None:
    sys.path.insert(0, str(TESTS))
    try:
        result = _run_model(name)
    except Exception as e:
        traceback.print_exc()
        result = {"model": name, "error": _reason("build", e)}
    print(MARK + json.dumps(result), flush=True)


# ---- the driver -----------------------------------------------------------------------------
def _spawn(name: str, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name]
    # two workers share two cores: one thread each, or they fight over both
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model": name, "error": f"no result within {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [""]
    return {"model": name, "error": f"exit {proc.returncode}: {tail[0][:300]}"}


def _shape_fraction(name: str) -> float | str:
    """Parameters per rank at tp 2 of a published model at its own shape, built on the meta
    device: the plan inferred at tp 2, counted by `tpplan.plan_stats` on a fake group (with
    its own inputs where tpplan cannot make them up). A string says why not."""
    sys.path.insert(0, str(TESTS))
    from model_zoo.torchvision_stub import use_if_broken

    import tpplan

    use_if_broken()
    import torch

    try:
        inputs = None
        if name == UNET_SD15:
            from diffusers import UNet2DConditionModel

            with torch.device("meta"):
                # the class's defaults are Stable Diffusion 1.x's UNet (860M parameters)
                model = UNet2DConditionModel(cross_attention_dim=768)
            inputs = {
                "sample": torch.zeros(1, 4, 64, 64, device="meta"),
                "timestep": torch.tensor([10], device="meta"),
                "encoder_hidden_states": torch.zeros(1, 77, 768, device="meta"),
                "return_dict": False,
            }
        elif name.startswith("open_clip "):
            try:
                import open_clip
            except ImportError:
                return "not measured (needs open_clip_torch)"
            model = open_clip.create_model(name.partition(" ")[2], device="meta")
            inputs = {
                "image": torch.zeros(1, 3, 224, 224, device="meta"),
                "text": torch.zeros(1, 77, dtype=torch.long, device="meta"),
            }
        else:
            import timm

            with torch.device("meta"):
                model = timm.create_model(name, pretrained=False)
        plan = tpplan.infer_plan(model, tp_size=2, example_inputs=inputs)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        stats = tpplan.plan_stats(model, plan, tp_size=2) if inputs is None else None
    except Exception as e:
        return _reason(name, e)
    if stats is not None:
        return round(stats.param_bytes_per_rank / stats.param_bytes_total, 3)
    return round(_held_at_tp_2(model, plan) / total, 3)


def _held_at_tp_2(model: Any, plan: Any) -> int:
    """Parameter bytes one rank holds once `plan` is applied to a meta copy on 2 fake ranks
    (for a model whose inputs plan_stats cannot make up)."""
    import copy

    import tpplan
    from tpplan._runtime.local import fake_ranks

    with fake_ranks(2) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
        return sum(
            getattr(p, "_local_tensor", p).numel() * p.element_size() for p in sharded.parameters()
        )


def _versions() -> dict[str, str]:
    return {
        "tpplan": _common.revision(),
        **{p: metadata.version(p) for p in PACKAGES},
        "python": platform.python_version(),
        "cpus": str(os.cpu_count()),
    }


# ---- the table ------------------------------------------------------------------------------
_SHORT = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


def _kinds(counts: dict[str, int]) -> str:
    return " + ".join(f"{n} {_SHORT.get(k, k)}" for k, n in sorted(counts.items())) or "none"


def _per_block(run: dict[str, Any]) -> str:
    """What one block of each kind runs in forward ("attention: 1 all_reduce"); kinds whose
    blocks differ list each variant."""
    seen: dict[str, list[str]] = {}
    for block, kind in run["blocks"]:
        cell = _kinds(run["collectives"][block])
        if cell not in seen.setdefault(kind, []):
            seen[kind].append(cell)
    return "; ".join(f"{kind}: {' or '.join(cells)}" for kind, cells in seen.items())


def _megatron(run: dict[str, Any]) -> tuple[int, int]:
    return len(run["megatron"]), len(run["blocks"])


def _parity(run: dict[str, Any]) -> str:
    if "refused" in run:
        return "fails loudly"
    err = run.get("forward_error")
    text = "" if err is None else f"{err:.1e} "
    return text + ("ok" if run["ok"] else "FAIL")


def _frac(run: dict[str, Any]) -> str:
    return f"{run['param_fraction']:.3f}" if "param_fraction" in run else "-"


def _row(r: dict[str, Any]) -> list[str]:
    runs = r["runs"]
    plain = [runs[_key(tp, False)] for tp in TPS]
    blocks = [f"{k} of {n}" for k, n in (_megatron(run) for run in plain if "blocks" in run)]
    return [
        f"{r['model']}",
        f"{r['class']} ({r['package']})",
        f"{r['params'] / 1e3:.0f} K",
        *(_frac(run) for run in plain),
        *(_parity(runs[_key(tp, sp)]) for tp, sp in RUNS),
        _per_block(plain[0]) if "blocks" in plain[0] else "-",
        *(blocks + ["-"] * (len(TPS) - len(blocks))),
    ]


def _targets(rows: list[dict[str, Any]], shapes: dict[str, Any]) -> list[str]:
    """(a), (b) and (c), one PASS or FAIL line each."""

    def line(ok: bool, text: str) -> str:
        return f"- {'PASS' if ok else 'FAIL'} {text}"

    out = []
    for tp in TPS:
        plain = {r["model"]: r["runs"][_key(tp, False)] for r in rows}
        counts = {m: _megatron(run) for m, run in plain.items() if "blocks" in run}
        k = sum(c[0] for c in counts.values())
        n = sum(len(r["blocks"]) for r in plain.values() if "blocks" in r) or 1
        missing = [m for m in plain if m not in counts]
        out.append(
            line(
                k / n >= MEGATRON_SHARE and not missing,
                f"(a) tp {tp}: {k} of {n} zoo blocks split the Megatron way ({k / n:.0%}; "
                f"target {MEGATRON_SHARE:.0%})"
                + (f"; not measured: {', '.join(missing)}" if missing else ""),
            )
        )
        short = [
            f"{m} {counts[m][0]} of {counts[m][1]}" if m in counts else f"{m} not measured"
            for m in ALL_MEGATRON
            if m not in counts or counts[m][0] < counts[m][1]
        ]
        out.append(
            line(
                not short,
                f"(a) tp {tp}: every block of {', '.join(ALL_MEGATRON)}"
                + (f"; short: {', '.join(short)}" if short else ""),
            )
        )
    over = [
        f"{r['model']} {_frac(r['runs'][_key(2, False)])}"
        for r in rows
        if r["runs"][_key(2, False)].get("param_fraction", 1.0)
        > PARAMS_TARGETS.get(r["model"], PARAMS_TARGET)
    ]
    over += [
        f"{name} {shapes.get(name, 'not measured')}"
        for name, target in SHAPES.items()
        if (isinstance(shapes.get(name), float) and shapes[name] > target)
        or (not isinstance(shapes.get(name), float) and name not in OPTIONAL_SHAPES)
    ]
    out.append(
        line(
            not over,
            f"(b) every transformer holds at most {PARAMS_TARGET} of its parameters per rank at "
            "tp 2 (CLIP too), ConvNeXt and the UNet at most 0.6; at published shapes: "
            + ", ".join(f"{n} {shapes.get(n, '-')}" for n in SHAPES)
            + (f"; above: {', '.join(over)}" if over else ""),
        )
    )
    failed = [
        f"{r['model']} {key}" for r in rows for key, run in r["runs"].items() if not run["ok"]
    ]
    refused = {
        r["model"]: run["refused"] for r in rows for run in r["runs"].values() if "refused" in run
    }
    total = sum(len(r["runs"]) for r in rows) - sum(
        "refused" in run for r in rows for run in r["runs"].values()
    )
    out.append(
        line(
            not failed,
            f"(c) parity in every run: {total - len(failed)} of {total} ok"
            + (f"; failing: {', '.join(failed)}" if failed else "")
            + "".join(
                f"; {m} fails loudly with sequence parallel ({why})" for m, why in refused.items()
            ),
        )
    )
    return out


def render(results: dict[str, Any]) -> str:
    meta = results["meta"]
    rows = [r for r in results["rows"] if "error" not in r]
    headers = [
        "model",
        "class (package)",
        "params",
        *(f"params per rank, tp {tp}" for tp in TPS),
        *(f"parity, {_key(tp, sp)}" for tp, sp in RUNS),
        "forward collectives per block, tp 2",
        *(f"Megatron blocks, tp {tp}" for tp in TPS),
    ]
    lines = [
        "Simulated ranks, fp32, a batch of 2 (tests/model_zoo's inputs); parity = forward max "
        f"abs error, ok when it and every gradient are within 1e-4. tpplan {meta['tpplan']}; "
        + ", ".join(f"{p} {meta[p]}" for p in PACKAGES)
        + f", Python {meta['python']}, {meta['cpus']} CPUs.",
        "",
        *_common.fold(
            f"Every model ({len(rows)} rows)",
            _common.markdown(headers, [_row(r) for r in rows]).splitlines(),
        ),
        "",
    ]
    sources = sorted({r.get("source", "?") for r in rows})
    if len(sources) > 1:
        lines += [
            f"Rows come from {len(sources)} states of tpplan's sources (edited during the run): "
            + ", ".join(f"{h} ({', '.join(r['model'] for r in rows if r.get('source') == h)})"
                        for h in sources),
            "",
        ]  # fmt: skip
    lines += [
        "Targets:",
        "",
        *_targets(rows, results.get("shapes", {})),
    ]
    failures = [
        f"- {r['model']}, {key}: {run['reason']}"
        for r in rows
        for key, run in r["runs"].items()
        if not run["ok"]
    ] + [f"- {r['model']}: {r['error']}" for r in results["rows"] if "error" in r]
    if failures:
        lines += ["", "Failures (the stage, then the first line of the error):", "", *failures]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated zoo names (e.g. timm.vit,nanogpt)")
    parser.add_argument("--jobs", type=int, default=2, help="workers at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model")
    _common.render_flags(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    if args.render:
        print(_common.rendered(render(_common.load("zoo")), "zoo", full=args.full))
        return

    sys.path.insert(0, str(TESTS))
    from model_zoo import ZOO

    names = args.only.split(",") if args.only else list(ZOO)
    t0 = time.perf_counter()
    done: dict[str, dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for r in pool.map(lambda n: _spawn(n, args.timeout), names):
            done[r["model"]] = r
            print(f"[{time.perf_counter() - t0:5.0f}s] {r['model']}", file=sys.stderr, flush=True)
    # a subset run updates its rows only; rows stay in the zoo's order
    saved = _common.RESULTS / "zoo.json"
    old = (
        {r["model"]: r for r in _common.load("zoo")["rows"]} if args.only and saved.exists() else {}
    )
    rows = {**old, **done}
    results = {"meta": _versions(), "rows": [rows[n] for n in ZOO if n in rows]}
    shapes = _common.load("zoo").get("shapes", {}) if args.only and saved.exists() else {}
    if not args.only or any("convnext" in n for n in names):
        shapes.update({n: _shape_fraction(n) for n in SHAPES})
    results["shapes"] = shapes
    _common.save("zoo", results)
    _common.save_tables(render(results), "zoo")
    print(_common.rendered(render(results), "zoo"))


if __name__ == "__main__":
    main()
