"""What a DTensor region costs at run time: the same attention split the Megatron way on local
tensors, and on DTensors (`regions:`), at tp 2 on two real CPU processes (gloo).

Run: `python benchmarks/region_cost.py` (`--iters 15`; `--render` re-prints
benchmarks/results/region_cost.json, `--no-save` leaves it as it is). Needs the zoo's packages
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

`local compiled` and `region compiled` are `torch.compile` of the applied models (the default
inductor backend, on CPU): what the README offers to remove a region's dispatch cost. Their
backend is inductor's own `compile_fx` behind a counter, so each method's graphs are counted:
those made before the timed rounds (the logits check and the warm-up) and those made during
them, which would be recompiles and make the times meaningless. Each pass starts from a fresh
dynamo (`torch._dynamo.reset()`) and compiles fresh `torch.compile` wrappers, so the training
graphs are never traced by a dynamo that holds the no-grad ones (runtime.py saw AOT autograd
fail with a RecursionError tracing a training graph after the same compiled module had
compiled a no-grad one).

Each pass (a no-grad forward; a forward plus backward of the summed logits) starts with each
method's logits against `plain` (which also compiles the compiled methods), then times every
method in turn round after round (rotating the order), starting at a barrier; a round's time
is the slower rank's. Reported: the median over the timed rounds after warm-up, and the
largest logits difference from `plain` (the no-grad pass's; the training pass's in the
notes). A plan that cannot be applied, or a method that fails to compile, is a note that says
why, and the rest still run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

MARK = "REGION_COST_RESULT "
TP = 2
METHODS = ("plain", "local", "region", "local compiled", "region compiled")
# each row's ratio is to the local split run the same way
BASELINE = {"plain": "local", "local": "local", "region": "local"} | {
    "local compiled": "local compiled",
    "region compiled": "local compiled",
}
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
    """`plan` with each attention a DTensor region: its colwise layers hand DTensors on.

    Their `replicate_heads` is dropped: tp 2 divides the 4 key/value heads, so it changes no
    split, and with it (tpplan at 0325833) wk and wv hand plain local tensors on whatever
    `local_output` says; q a DTensor and k, v plain tensors is a wrong attention, which
    apply_plan's check refuses (a DataDependentOutputException on fake ranks) and which gives
    logits 0.88 off when applied past the check."""
    from tpplan.plan.schema import RegionRule

    attention = "layers.*.attention"
    rules = [
        r.model_copy(update={"local_output": False, "replicate_heads": None})
        if r.match.startswith(f"{attention}.") and r.style == "colwise"
        else r
        for r in plan.rules
    ]
    region = RegionRule(match=attention, why="benchmark: the attention on DTensors")
    return plan.model_copy(update={"rules": rules, "regions": [region]})


# --- one torchrun rank ---------------------------------------------------------------------
class CountingBackend:
    """inductor's own backend (`compile_fx`, what `torch.compile`'s default resolves to), with
    a count of the graphs dynamo hands it: one per graph, recompiles and graph breaks included."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(gm, example_inputs)


def agree(ok: bool) -> bool:
    """Whether every rank says ok (a method that fails on one rank is dropped on all)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def check_logits(calls: dict[str, Any], phase: str, ids: Any, result: dict[str, Any]) -> list[str]:
    """Each method's largest logits difference from `plain` in `phase` (this compiles the
    compiled methods); the methods that ran on every rank, the others' errors in
    result["errors"][phase]."""
    import traceback

    import torch

    ran, want = [], None
    for name, call in calls.items():
        try:
            with torch.set_grad_enabled(phase != "no_grad"):
                got = _common.whole(call(ids)).detach()
            ok = True
        except Exception as e:  # a method that cannot compile is a note that says why
            traceback.print_exc()
            result["errors"][phase][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            ok = False
        if not agree(ok):
            result["errors"][phase].setdefault(name, "failed on another rank")
            continue
        ran.append(name)
        if want is None:
            want = got
        else:
            result["diff" if phase == "no_grad" else "diff_train"][name] = float(
                (got - want).abs().max()
            )
    return ran


def time_pass(
    phase: str, models: dict[str, Any], ids: Any, result: dict[str, Any], args: Any
) -> None:
    """One pass: a fresh dynamo and fresh compiled wrappers, the logits check, then the rounds;
    graphs each compiled method made before and during the timed rounds into result["graphs"]."""
    import time

    import torch
    import torch.distributed as dist

    torch._dynamo.reset()
    backends = {f"{n} compiled": CountingBackend() for n in models if n != "plain"}
    calls = dict(models)
    for name, backend in backends.items():
        calls[name] = torch.compile(models[name.removesuffix(" compiled")], backend=backend)
    ran = check_logits(calls, phase, ids, result)
    times = result["times"][phase] = {n: [] for n in ran}
    before = {n: b.graphs for n, b in backends.items() if n in ran}
    graphs = result["graphs"][phase] = {n: [before[n], 0] for n in before}
    seen = {n: 0 for n in ran}

    def one(name: str, _phase: str) -> float:
        backend = backends.get(name)
        made = backend.graphs if backend else 0
        dist.barrier()
        t0 = time.perf_counter()
        if phase == "no_grad":
            with torch.no_grad():
                calls[name](ids)
        else:
            _common.whole(calls[name](ids)).float().sum().backward()
        seconds = time.perf_counter() - t0
        if phase != "no_grad":
            models[name.removesuffix(" compiled")].zero_grad(set_to_none=True)
        seen[name] += 1
        if backend:  # [before the timed rounds, during them]
            graphs[name][int(seen[name] > args.warmup)] += backend.graphs - made
        return seconds

    _common.time_rounds(one, {"times": {phase: times}}, [phase], ran, args.warmup, args.iters)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import tpplan

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ids = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.seq), generator=torch.Generator())
    plan = tpplan.infer_plan(build(), tp_size=TP, example_inputs=ids)
    plans = {"local": plan, "region": region_plan(plan)}
    result: dict[str, Any] = {"diff": {}, "diff_train": {}, "times": {}, "graphs": {}}
    result["errors"] = {p: {} for p in PASSES}
    result["apply_errors"] = {}
    models = {"plain": build()}
    for name, p in plans.items():
        try:  # a plan that cannot be applied is a note that says why, not a lost run
            models[name] = tpplan.apply_plan(build(), mesh, p)
        except tpplan.PlanProblemsError as e:
            result["apply_errors"][name] = " ".join(str(e).split())[:600]
    for phase in PASSES:
        time_pass(phase, models, ids, result, args)
    for phase in PASSES:  # a round's time is the slower rank's
        for name, times in result["times"][phase].items():
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            result["times"][phase][name] = t.tolist()
    if dist.get_rank() == 0:
        print(MARK + json.dumps(result), flush=True)
    # torch 2.13 on gloo aborts now and then in interpreter teardown
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


# --- driver ---------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, Any]:
    return _common.timed_worker(__file__, [], args, TP, MARK, 1800)


def render(results: dict[str, Any]) -> str:
    """The table; results saved before the compiled methods existed print as they did then."""
    if "error" in results:
        return f"failed: {results['error']}"
    names = [n for n in METHODS if any(n in results["times"][p] for p in PASSES)]
    compiled = any("compiled" in n for n in names)
    rows = []
    for name in names:
        cells = []
        for phase in PASSES:
            times = results["times"][phase].get(name)
            base = results["times"][phase].get(BASELINE[name])
            if not times:
                cells += ["failed", ""]
                continue
            ratio = f"{_common.median(times) / _common.median(base):.2f}×" if base else ""
            cells += [_common.spread_ms(times), ratio]
        diff = f"{results['diff'][name]:.1e}" if name in results["diff"] else "(reference)"
        rows.append([name, *cells, diff])
    ratio_header = "time / local (compiled rows: / local compiled)" if compiled else "time / local"
    headers = [
        "plan",
        "no-grad forward ms, median (min-max)",
        ratio_header,
        "forward + backward ms",
        ratio_header,
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
            *notes(results),
        ]
    )


def notes(results: dict[str, Any]) -> list[str]:
    """Under the table: the graphs each compiled method made, before and during the timed
    rounds; the training pass's logits differences; why a method failed. None for results
    saved before the compiled methods existed."""
    label = {"no_grad": "no-grad forward", "train": "forward + backward"}
    lines = []
    for phase in PASSES:
        graphs = results.get("graphs", {}).get(phase, {})
        if graphs:
            made = [
                f"{n} {b} graph(s) before the timed rounds, {d} during them"
                + (" (recompiles: its times are not steady-state)" if d else "")
                for n, (b, d) in graphs.items()
            ]
            lines.append(f"- {label[phase]}: " + "; ".join(made))
        for name, err in results.get("errors", {}).get(phase, {}).items():
            lines.append(f"- {label[phase]}, {name} failed: {err}")
    for name, err in results.get("apply_errors", {}).items():
        lines.append(f"- {name} and {name} compiled did not run: {err}")
    if results.get("diff_train"):
        lines.append(
            "- logits Δ vs plain in the forward + backward pass: "
            + ", ".join(f"{n} {d:.1e}" for n, d in results["diff_train"].items())
        )
    return ["", *lines] if lines else []


def command_line() -> argparse.ArgumentParser:
    """The command line; a test reads benchmarks/README.md's command back through it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--render", action="store_true", help="re-print the saved results")
    parser.add_argument(
        "--no-save",
        action="store_true",
        help="print the table, leave the saved results as they are",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = command_line().parse_args()
    if args.worker:
        worker(args)
        return
    if args.render:
        results = _common.load("region_cost")
    else:
        results = {"meta": _common.versions(), **measure(args)}
        results.update({k: getattr(args, k) for k in ("batch", "seq", "warmup", "iters")})
        if not args.no_save:
            _common.save("region_cost", results)
    print(render(results))


if __name__ == "__main__":
    main()
