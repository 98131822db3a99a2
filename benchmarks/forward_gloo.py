"""Forward time at tp 2 on two real CPU processes (gloo): tpplan's plan next to transformers'.

Run: `python benchmarks/forward_gloo.py` (about 4 minutes on 2 cores; `--models llama`,
`--iters 15`, `--render` re-prints benchmarks/results/forward_gloo.json and redraws the plot).
Needs `pip install accelerate` for transformers' `tp_plan="auto"` loading.

For each small model (random fp32 weights, saved once with `save_pretrained`), torchrun starts
2 ranks on gloo (one thread each: the machine has 2 cores). Every rank loads, in the same
process:

- tpplan: `from_pretrained(folder)` then `tpplan.apply_plan(model, mesh)` (the plan inferred);
- transformers: `from_pretrained(folder, tp_plan="auto")`, its own hand-written plan;
- plain: the unsharded model, which each rank runs whole on its one thread (the time tp 2
  would halve if it cost nothing).

Then, on the same token ids, each is timed in turn, round after round (so drifts of the shared
machine hit all three alike): a forward under `torch.no_grad()` (inference), and a forward plus
backward of the summed logits (training; gradients zeroed between rounds). A round starts at a
barrier; its time is the slower rank's. Reported: the median over the timed rounds, after
warm-up rounds, and the largest logits difference from the plain model.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

MARK = "FORWARD_GLOO_RESULT "
TP = 2
METHODS = ("plain", "tpplan", "transformers")
PASSES = ("no_grad", "train")

# Small enough for a few minutes on 2 cores, wide enough that matmuls, not Python, dominate.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict(
        hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=2816, vocab_size=16000, max_position_embeddings=512,
        tie_word_embeddings=False,
    )),
    "qwen3_moe": ("qwen3_moe", dict(
        hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1024, moe_intermediate_size=512, num_experts=8,
        num_experts_per_tok=2, vocab_size=16000, max_position_embeddings=512,
        tie_word_embeddings=False,
    )),
}  # fmt: skip


def _config(name: str) -> Any:
    from transformers import CONFIG_MAPPING

    model_type, fields = CONFIGS[name]
    return CONFIG_MAPPING[model_type](**fields)


# --- one torchrun rank ---------------------------------------------------------------------
def worker(folder: Path, batch: int, seq: int, warmup: int, iters: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import tpplan

    hf_logging.set_verbosity_error()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    load = lambda **kw: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        folder, dtype=torch.float32, **kw
    )
    models = {
        "plain": load(),
        "tpplan": tpplan.apply_plan(load(), mesh),
        "transformers": load(tp_plan="auto"),
    }
    for m in models.values():
        m.eval()  # no dropout; autograd is decided per pass below
    vocab = models["plain"].config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))

    result: dict[str, Any] = {"diff": {}, "times": {p: {m: [] for m in models} for p in PASSES}}
    with torch.no_grad():
        want = models["plain"](input_ids=ids, use_cache=False).logits
        for name in ("tpplan", "transformers"):
            got = _common.whole(models[name](input_ids=ids, use_cache=False).logits)
            result["diff"][name] = float((got - want).abs().max())

    def logits(model: Any) -> Any:
        return model(input_ids=ids, use_cache=False).logits

    _common.time_passes(models, logits, result, PASSES, METHODS, warmup, iters)
    _common.report_rounds(result, PASSES, METHODS, MARK)


# --- driver ---------------------------------------------------------------------------------
def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    folder = Path(tempfile.mkdtemp(prefix="tpplan-fwd-bench-"))
    try:
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(_config(name), dtype=torch.float32)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        found = _common.timed_worker(__file__, [str(folder)], args, TP, MARK, 1200)
        return {"model": name, "params": params, **found}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def render(results: dict[str, Any]) -> str:
    rows = []
    for r in results["rows"]:
        if "error" in r:
            rows.append([r["model"], "", f"failed: {r['error']}", "", "", "", ""])
            continue
        for name in METHODS:
            cells = []
            for phase in PASSES:
                times = r["times"][phase][name]
                med = _common.median(times)
                base = _common.median(r["times"][phase]["plain"])
                cells += [_common.spread_ms(times), f"{base / med:.2f}×"]
            diff = f"{r['diff'][name]:.1e}" if name in r["diff"] else "(reference)"
            rows.append([r["model"], f"{r['params'] / 1e6:.0f} M", name, *cells, diff])
    headers = [
        "model",
        "params",
        "method",
        "no-grad forward ms, median (min-max)",
        "speed-up over plain",
        "forward + backward ms",
        "speed-up over plain",
        "logits Δ vs plain",
    ]
    return "\n".join(
        [
            f"tp {TP} on gloo, 2 processes × 1 thread; batch {results['batch']} × "
            f"{results['seq']} tokens, fp32; median of {results['iters']} rounds after "
            f"{results['warmup']} warm-up. " + _common.provenance_line(results["meta"]),
            "",
            _common.markdown(headers, rows),
        ]
    )


def _plot(results: dict[str, Any]) -> None:
    plt = _common.pyplot()
    ok = [r for r in results["rows"] if "error" not in r]
    fig, axes = plt.subplots(1, len(ok), figsize=(4.5 * len(ok), 3.6), squeeze=False)
    for ax, r in zip(axes[0], ok, strict=True):
        width = 0.27
        for i, name in enumerate(METHODS):
            meds = [1000 * _common.median(r["times"][p][name]) for p in PASSES]
            lows = [m - 1000 * min(r["times"][p][name]) for m, p in zip(meds, PASSES, strict=True)]
            highs = [1000 * max(r["times"][p][name]) - m for m, p in zip(meds, PASSES, strict=True)]
            xs = [j + (i - 1) * width for j in range(len(PASSES))]
            ax.bar(xs, meds, width, yerr=[lows, highs], capsize=3, label=name)
        ax.set_xticks(range(len(PASSES)), ["no-grad forward", "forward + backward"])
        ax.set_ylabel("ms (median; bars: min-max)")
        ax.set_title(f"{r['model']} ({r['params'] / 1e6:.0f} M params), tp {TP} gloo", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=8)
    _common.save_plot(fig, "forward_gloo")


def command_line() -> argparse.ArgumentParser:
    """The command line; a test reads benchmarks/README.md's command back through it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--render", action="store_true", help="re-print the saved results")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = command_line().parse_args()
    if args.worker:
        worker(Path(args.worker), args.batch, args.seq, args.warmup, args.iters)
        return
    if args.render:
        results = _common.load("forward_gloo")
    else:
        rows = []
        for name in args.models:
            rows.append(measure(name, args))
            print(f"{name}: {'failed' if 'error' in rows[-1] else 'done'}", file=sys.stderr)
        results = {"meta": _common.versions(), "rows": rows}
        results.update({k: getattr(args, k) for k in ("batch", "seq", "warmup", "iters")})
        _common.save("forward_gloo", results)
    print(render(results))
    if not args.no_plot:
        _plot(results)


if __name__ == "__main__":
    main()
