"""What applying a shipped plan costs at tp 1 (issue 33's target: every shipped plan's decode
step within 1.05x of the plain model's): at tp 1 nothing is communicated, so any difference
is tpplan's own host work (split layers' local forwards, regions, hooks).

Run: `python benchmarks/tp1_overhead.py` (about 4 minutes on 2 cores; `--rounds 40`,
`--plans llama t5`, `--render` re-prints benchmarks/results/tp1_overhead.json, `--render
--full` with the table of every plan, which a run writes to results/tp1_overhead.md). One
process, one thread, a gloo process group of one rank.

Each plan's model is the small one of its family the tests run (tests/support/shipped.py:
SMALL, the plan's own widths kept where it names them, 1-2 layers, vocab 512), random
weights from one seed, fp32. The case is a decode step: one token through a 32-token KV
cache under no_grad, the cache cropped back after each step (T5: a decoder step over 32
encoder tokens; BERT, an encoder: a no_grad forward of 32 tokens). The plain model and the
plan applied (`apply_plan(model, mesh, plan=<shipped plan>)`) take turns, the order
alternating; reported: the median over the rounds after warm-up, min-max, the median of the
round-by-round ratios with their quartiles (the two times of a round taken back to back, so
that the machine's drift cancels) and the largest difference of the logits.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from _common import (  # noqa: E402
    fold,
    load,
    markdown,
    median,
    provenance_line,
    render_flags,
    rendered,
    save,
    save_tables,
    versions,
)
from region_decode import decode_step  # noqa: E402

TARGET = 1.05


def _step(model: Any, stem: str) -> tuple[Any, Any]:
    """(one decode step, its logits) of `model`, as the module docstring describes: region
    decode's step (region_decode.py), or for BERT, an encoder, a no-grad forward."""
    if stem != "bert":
        return decode_step(stem, model)
    import torch

    ids = torch.randint(
        3, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1)
    )

    @torch.no_grad()
    def step() -> Any:
        return model(input_ids=ids)

    out = step()
    logits = getattr(out, "logits", None)
    return step, out.last_hidden_state if logits is None else logits


def run(plans: list[str], rounds: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from support.shipped import PLANS, SMALL, plan_spec
    from torch.distributed.device_mesh import init_device_mesh

    import tpplan
    from tpplan._runtime.models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    table: dict[str, Any] = {}
    for path in PLANS:
        if plans and path.stem not in plans:
            continue
        spec, overrides = plan_spec(path)
        models = {}
        for method in ("plain", "tpplan"):
            torch.manual_seed(0)
            model = build_model(spec, {**overrides, **SMALL[path.stem]}, device="cpu").eval()
            if method == "tpplan":
                tpplan.apply_plan(model, mesh, plan=str(path))
            models[method] = _step(model, path.stem)
        times: dict[str, list[float]] = {m: [] for m in models}
        order = list(models)
        for i in range(warmup + rounds):
            for method in order if i % 2 else order[::-1]:
                t0 = time.perf_counter()
                models[method][0]()
                if i >= warmup:
                    times[method].append(time.perf_counter() - t0)
        diff = (models["tpplan"][1].float() - models["plain"][1].float()).abs().max().item()
        table[path.stem] = {"times": times, "max_diff": diff}
        print(f"{path.stem}: {median(times['tpplan']) / median(times['plain']):.3f}x", flush=True)
    dist.destroy_process_group()
    meta = {**versions(), "rounds": str(rounds), "warmup": str(warmup)}
    return {"meta": meta, "plans": table}


def render(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"{provenance_line(meta)} One gloo rank, one thread; {meta['rounds']} rounds after "
        f"{meta['warmup']} warm-up; median (min-max) ms.",
        "",
    ]
    rows, medians = [], []
    for stem, entry in results["plans"].items():
        cells = []
        for method in ("plain", "tpplan"):
            ms = [1000 * t for t in entry["times"][method]]
            cells.append(f"{median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f})")
        pairs = zip(entry["times"]["tpplan"], entry["times"]["plain"], strict=True)
        ratios = sorted(a / b for a, b in pairs)
        ratio, q = median(ratios), len(ratios) // 4
        verdict = "met" if ratio <= TARGET else "MISSED"
        medians.append(ratio)
        spread = f"({ratios[q]:.2f}-{ratios[-1 - q]:.2f})"
        rows.append([stem, *cells, f"{ratio:.3f}x {spread} {verdict}", f"{entry['max_diff']:.1e}"])
    met = sum(r <= TARGET for r in medians)
    diff = max(e["max_diff"] for e in results["plans"].values())
    lines += [
        f"{met} of {len(rows)} plans meet the target of {TARGET}x (tpplan / plain from "
        f"{min(medians):.3f}x to {max(medians):.3f}x); the largest logits difference is {diff:.1e}.",
        "",
    ]
    headers = ["plan", "plain ms", "tpplan ms", f"tpplan / plain (target <= {TARGET})", "diff"]
    table = markdown(headers, rows).splitlines()
    lines += fold(f"Every plan ({len(rows)} rows)", table)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--plans", nargs="*", default=[], help="plan stems (default: all)")
    render_flags(parser)
    parser.add_argument("--out", default="tp1_overhead", help="results name (benchmarks/results/)")
    args = parser.parse_args()
    if not args.render:
        save(args.out, run(args.plans, args.rounds, args.warmup))
        save_tables(render(load(args.out)), args.out)
    print(rendered(render(load(args.out)), args.out, full=args.full))


if __name__ == "__main__":
    main()
