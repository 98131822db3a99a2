"""What a DTensor region costs at run time: the same attention split the Megatron way on local
tensors, and on DTensors (`regions:`), at tp 2 on two real CPU processes (gloo).

Run: `python benchmarks/region_cost.py` (about 3 minutes on 2 cores; `--iters 15`,
`--render` re-prints benchmarks/results/region_cost.json). Needs the zoo's packages
(`pip install -e '.[zoo]'`): the model is torchtitan's own Llama 3 (0.2.2), random fp32
weights, 4 layers of width 512, 8 query and 4 key/value heads, SwiGLU 1536.

torchtitan views its heads with -1, so `tpplan infer` splits its attention on local tensors
(`local`): each rank runs its own heads as plain tensors, one all-reduce per attention. The
`region` plan is the same plan with every attention made a DTensor region by hand, as infer
writes one where local shapes cannot be proven (nanoGPT's `C // n_head`): q, k and v hand
DTensors on (`local_output: false`), and the attention's own code runs on them, DTensor's
dispatch computing each op on the local shards. The split, the weights per rank and the
collectives are the same; the difference is DTensor's per-op dispatch. `plain` is the
unsharded model on each rank (one thread each).

Each round times a no-grad forward and a forward plus backward of the summed logits for
each plan in turn (rotating the order), starting at a barrier; a round's time is the slower
rank's. Reported: the median over the timed rounds after warm-up, and the largest logits
difference from `plain`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

MARK = "REGION_COST_RESULT "
TP = 2
METHODS = ("plain", "local", "region")
PASSES = ("no_grad", "train")
SHAPE = dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8000, max_seq_len=512)


def build() -> Any:
    """torchtitan's Llama 3 at SHAPE, seeded: every rank builds the same weights."""
    import torch
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    torch.manual_seed(0)
    model = Transformer(TransformerModelArgs(**SHAPE))
    with torch.no_grad():
        model.init_weights()
    return model.eval()


def region_plan(plan: Any) -> Any:
    """`plan` with each attention a DTensor region: its colwise layers hand DTensors on."""
    from tpplan.plan.schema import RegionRule

    attention = "layers.*.attention"
    rules = [
        r.model_copy(update={"local_output": False})
        if r.match.startswith(f"{attention}.") and r.style == "colwise"
        else r
        for r in plan.rules
    ]
    region = RegionRule(match=attention, why="benchmark: the attention on DTensors")
    return plan.model_copy(update={"rules": rules, "regions": [region]})


# --- one torchrun rank ---------------------------------------------------------------------
def worker(batch: int, seq: int, warmup: int, iters: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import tpplan

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ids = torch.randint(0, SHAPE["vocab_size"], (batch, seq), generator=torch.Generator())
    plan = tpplan.infer_plan(build(), tp_size=TP, example_inputs=ids)
    plans = {"local": plan, "region": region_plan(plan)}
    models = {"plain": build()}
    for name, p in plans.items():
        models[name] = tpplan.apply_plan(build(), mesh, p)

    result: dict[str, Any] = {"diff": {}, "times": {p: {m: [] for m in models} for p in PASSES}}
    with torch.no_grad():
        want = models["plain"](ids)
        for name in plans:
            result["diff"][name] = float((_common.whole(models[name](ids)) - want).abs().max())

    _common.time_passes(models, lambda m: m(ids), result, PASSES, METHODS, warmup, iters)
    _common.report_rounds(result, PASSES, METHODS, MARK)


# --- driver ---------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, Any]:
    return _common.timed_worker(__file__, [], args, TP, MARK, 1800)


def render(results: dict[str, Any]) -> str:
    if "error" in results:
        return f"failed: {results['error']}"
    rows = []
    for name in METHODS:
        cells = []
        for phase in PASSES:
            times = results["times"][phase][name]
            med = _common.median(times)
            local = _common.median(results["times"][phase]["local"])
            cells += [_common.spread_ms(times), f"{med / local:.2f}×"]
        diff = f"{results['diff'][name]:.1e}" if name in results["diff"] else "(reference)"
        rows.append([name, *cells, diff])
    headers = [
        "plan",
        "no-grad forward ms, median (min-max)",
        "time / local",
        "forward + backward ms",
        "time / local",
        "logits Δ vs plain",
    ]
    shape = ", ".join(f"{k} {v}" for k, v in SHAPE.items())
    return "\n".join(
        [
            f"torchtitan Llama 3 ({shape}), tp {TP} on gloo, 2 processes × 1 thread; batch "
            f"{results['batch']} × {results['seq']} tokens, fp32; median of "
            f"{results['iters']} rounds after {results['warmup']} warm-up. "
            + _common.provenance_line(results["meta"]),
            "",
            _common.markdown(headers, rows),
        ]
    )


def command_line() -> argparse.ArgumentParser:
    """The command line; a test reads benchmarks/README.md's command back through it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--render", action="store_true", help="re-print the saved results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = command_line().parse_args()
    if args.worker:
        worker(args.batch, args.seq, args.warmup, args.iters)
        return
    if args.render:
        results = _common.load("region_cost")
    else:
        results = {"meta": _common.versions(), **measure(args)}
        results.update({k: getattr(args, k) for k in ("batch", "seq", "warmup", "iters")})
        _common.save("region_cost", results)
    print(render(results))


if __name__ == "__main__":
    main()
