"""Run time of a sharded model (issue 22): a decode step, `generate`, and a training step, at
tp 1 and tp 2, tpplan eager and compiled against transformers' `tp_plan="auto"` and the plain
model, the methods taking turns in the same processes.

Run: `python benchmarks/runtime.py` (about 5 minutes on 2 cores; `--rounds 20`, `--tp 1 2`,
`--only decode train`, `--methods plain transformers`, `--render` re-prints
benchmarks/results/runtime.json and redraws benchmarks/plots/runtime.png; `--render --full`
adds the targets, logits differences and notes, which a run writes to results/runtime.md). `--gpu` runs the
same cases at tp 1 on one CUDA GPU instead (NCCL, world size 1, bf16, a wider model,
CUDA-event times, the compiled rows with `mode="reduce-overhead"`: CUDA graphs), saved to
runtime_gpu.json. Needs `pip install -e '.[bench]'` (accelerate for transformers' loading).

The model is a 4-layer transformers Llama of width 512 in fp32 (8 query and 4 key/value
heads, MLP 1376, vocab 16000), random weights saved once with `save_pretrained` so that
transformers can load it with its own plan. torchrun starts tp ranks on gloo, one thread each
(the machine has 2 cores); every rank loads each method in the same process:

- plain: the unsharded model, whole on every rank; plain compiled: `torch.compile` of it;
- tpplan: `tpplan.apply_plan(model, mesh)`, the plan inferred, on its default path (local
  shards with direct collectives, once `apply_plan` takes `local_shards`);
- tpplan (DTensor path): `apply_plan(..., local_shards=False)`, every sharded layer through
  DTensor dispatch; before `local_shards` existed this was what `apply_plan` did, and the
  only tpplan row;
- tpplan compiled: `tpplan.compile_model` of the applied model (its default path;
  `torch.compile` where the tpplan measured has no compile_model);
- transformers: `from_pretrained(folder, tp_plan="auto")`, its hand-written plan.

Cases, each a round of every method in turn (the order rotating), a round starting at a
barrier and timed as the slower rank:

- decode: one token through a 32-token KV cache, under no_grad. The cache is filled once by a
  32-token prefill (eager, also for the compiled rows), and cropped back to 32 after every
  step, so every step sees the same shapes and a compiled model compiles the step once (the
  graphs compiled during the timed rounds are counted and printed). On the GPU the cache is
  a StaticCache of 64 whose token count is rewound after each step, so every step writes
  position 32: the static shapes and addresses CUDA graphs need.
- generate: 16 new tokens, greedy, from an 8-token prompt. The compiled rows use
  transformers' own way to compile generate: a static cache, and its `compile_config`.
- train: forward and backward of the loss over 1 x 128 tokens (gradients cleared between
  rounds, outside the time).

Each case starts from a fresh torch._dynamo (`reset`), so each compiles its own graphs.
Reported: the median over the timed rounds after warm-up, min-max, the largest difference
from the plain model's logits (generate: over the 16 steps' logits), and how many
parameters each method holds as DTensors.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

MARK = "RUNTIME_RESULT "
CASES = ("decode", "generate", "train")
CASE_LABELS = {
    "decode": "decode step, 32-token cache",
    "generate": "generate 16 tokens",
    "train": "fwd + bwd, 128 tokens",
}
METHODS = (
    "plain",
    "plain compiled",
    "tpplan",
    "tpplan (DTensor path)",
    "tpplan compiled",
    "transformers",
)
CACHE, NEW_TOKENS, PROMPT, TRAIN_TOKENS = 32, 16, 8, 128

CPU_CONFIG = dict(
    hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    intermediate_size=1376, vocab_size=16000, max_position_embeddings=512,
    tie_word_embeddings=False, pad_token_id=0,
)  # fmt: skip
# Llama-3-8B's widths, 4 layers, its vocabulary cut to 32000 (a smaller head to save)
GPU_CONFIG = dict(
    hidden_size=4096, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=32000, max_position_embeddings=512,
    tie_word_embeddings=False, pad_token_id=0,
)  # fmt: skip

# The targets: (case, tp, numerator, denominator, at most)
TARGETS = (
    ("decode", 1, "tpplan", "plain", 1.10),
    ("decode", 2, "tpplan", "transformers", 1.0),
    ("generate", 2, "tpplan", "transformers", 1.0),
    ("train", 2, "tpplan", "transformers", 1.0),
    ("decode", 1, "tpplan compiled", "plain compiled", 1.05),
    ("train", 1, "tpplan compiled", "plain compiled", 1.05),
    ("generate", 1, "tpplan compiled", "plain compiled", 1.05),
)


def has_local_shards() -> bool:
    """Whether this tpplan's `apply_plan` takes `local_shards` (the run-time fast path)."""
    import tpplan

    return "local_shards" in inspect.signature(tpplan.apply_plan).parameters


def lead(methods: Any) -> str:
    """The tpplan row the targets read: its default path ("tpplan" once it differs from the
    DTensor path, "tpplan (DTensor path)" before)."""
    return "tpplan" if "tpplan" in methods else "tpplan (DTensor path)"


@dataclass
class Method:
    """One way of running the model: `model` is the module (`generate` is called on it),
    `call` what a forward goes through (the module, or torch.compile of it)."""

    name: str
    model: Any
    call: Any
    compiled: bool


# --- building the methods ------------------------------------------------------------------
def load_methods(folder: Path, mesh: Any, names: list[str], *, dtype: Any, mode: str) -> Any:
    """({name: Method}, {name: error}) for `names`, each loaded from `folder` on its own
    (no two methods share a parameter or a gradient)."""
    import torch
    from transformers import AutoModelForCausalLM

    import tpplan

    device = mesh.device_type

    def load(**kw: Any) -> Any:
        # at world size 1 transformers' tp_plan applies nothing and leaves the model on the
        # CPU: it goes to the device like the plain model (a no-op where it is there)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw).to(device).eval()

    def compiled(model: Any, name: str) -> Any:
        how = None if mode == "default" else mode
        if name.startswith("tpplan") and hasattr(tpplan, "compile_model"):
            # tpplan's documented way: torch.compile less the layout guards its local-shard
            # layers do not need
            return tpplan.compile_model(model, mode=how)
        return torch.compile(model, mode=how)

    build: dict[str, Callable[[], tuple[Any, bool]]] = {
        "plain": lambda: (load(), False),
        "plain compiled": lambda: (load(), True),
        "tpplan": lambda: (tpplan.apply_plan(load(), mesh), False),
        "tpplan (DTensor path)": lambda: (
            tpplan.apply_plan(
                load(), mesh, **({"local_shards": False} if has_local_shards() else {})
            ),
            False,
        ),
        "tpplan compiled": lambda: (tpplan.apply_plan(load(), mesh), True),
        "transformers": lambda: (load(tp_plan="auto"), False),
    }
    methods, errors = {}, {}
    for name in names:
        try:
            model, is_compiled = build[name]()
        except Exception as e:  # a method that cannot load is a row that says why
            errors[name] = one_line(e)
            continue
        call = compiled(model, name) if is_compiled else model
        methods[name] = Method(name, model, call, is_compiled)
    return methods, errors


def dtensor_params(model: Any) -> str:
    """How many of the model's parameters are DTensors ("0 of 39": nothing sharded)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    return f"{sum(isinstance(p, DTensor) for p in params)} of {len(params)}"


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:240]


# --- the cases -----------------------------------------------------------------------------
def ids_for(vocab: int, n: int, seed: int, device: Any) -> Any:
    """The same token ids on every rank (a generator of our own, not the global RNG)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (1, n), generator=g).to(device)


def decode_case(m: Method, vocab: int, device: Any, *, static: bool) -> tuple[Any, Any]:
    """(step, check): one token through a cache of CACHE tokens, the same shapes every step.
    A DynamicCache is cropped back after each step; a StaticCache rewinds its count of tokens,
    so that each step rewrites the same slot."""
    import torch
    from transformers import StaticCache

    prompt, token = ids_for(vocab, CACHE, 1, device), ids_for(vocab, 1, 2, device)
    kwargs: dict[str, Any] = {}
    if static:
        kwargs["past_key_values"] = StaticCache(config=m.model.config, max_cache_len=2 * CACHE)
    with torch.no_grad():  # the prefill runs eager for every row: only the step is compiled
        cache = m.model(input_ids=prompt, use_cache=True, **kwargs).past_key_values
        if not static:
            # one eager step and crop first: from then on the cache's tensors are views of
            # CACHE + 1 rows, as after every timed step (fresh ones have other strides, and
            # a compiled step would compile twice)
            m.model(input_ids=token, past_key_values=cache, use_cache=True)
            cache.crop(-1)

    def step() -> Any:
        if m.compiled and device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            out = m.call(input_ids=token, past_key_values=cache, use_cache=True)
        if static:
            # back to CACHE tokens: the next step writes the same slot again (transformers
            # 5.17 to 5.24 count a static layer's tokens in this tensor, updated in place)
            for layer in cache.layers:
                layer.cumulative_length.sub_(1)
        else:
            cache.crop(-(cache.get_seq_length() - CACHE))
        return out.logits

    return step, lambda: _common.whole(step()).float().clone()


def generate_case(m: Method, vocab: int, device: Any) -> tuple[Any, Any]:
    """(run, check): NEW_TOKENS greedy tokens from a PROMPT-token prompt. A compiled row
    generates with a static cache and transformers' compile_config (on every device)."""
    from transformers import CompileConfig

    prompt = ids_for(vocab, PROMPT, 3, device)
    kwargs: dict[str, Any] = dict(
        do_sample=False, min_new_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS,
        attention_mask=prompt.new_ones(prompt.shape), pad_token_id=0,
    )  # fmt: skip
    if m.compiled:
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        config = CompileConfig(mode=mode)
        guards = _layout_guard_filter(m)
        if guards is not None:
            # as tpplan.compile_model does: torch.compile takes a guard filter only in its
            # options, and options only without a mode
            from torch._inductor import list_mode_options

            config = CompileConfig(
                mode=None, options={**list_mode_options(mode), "guard_filter_fn": guards}
            )
        config._compile_all_devices = True  # transformers' switch to compile off GPUs too
        kwargs |= dict(cache_implementation="static", compile_config=config)

    def run() -> Any:
        return m.model.generate(prompt, **kwargs)

    def check() -> Any:
        import torch

        out = m.model.generate(prompt, output_logits=True, return_dict_in_generate=True, **kwargs)
        return torch.stack([_common.whole(x).float() for x in out.logits])

    return run, check


def _layout_guard_filter(m: Method) -> Any:
    """tpplan.compile_model's guard filter for a compiled tpplan row (None otherwise, or
    with a tpplan that has none)."""
    if not m.name.startswith("tpplan"):
        return None
    try:
        from tpplan.apply.compiled import layout_guard_filter
    except ImportError:
        return None
    return layout_guard_filter(m.model)


def train_case(m: Method, vocab: int, device: Any) -> tuple[Any, Any]:
    """(run, check): forward and backward of the loss over TRAIN_TOKENS tokens."""
    ids = ids_for(vocab, TRAIN_TOKENS, 4, device)

    def run() -> Any:
        if m.compiled and device.type == "cuda":
            import torch

            torch.compiler.cudagraph_mark_step_begin()
        out = m.call(input_ids=ids, labels=ids)
        _common.whole(out.loss).backward()
        return out.logits

    def check() -> Any:
        logits = _common.whole(run()).detach().float().clone()
        m.model.zero_grad(set_to_none=True)
        return logits

    return run, check


def prepare(case: str, m: Method, vocab: int, device: Any) -> tuple[Any, Any]:
    if case == "decode":
        return decode_case(m, vocab, device, static=device.type == "cuda")
    if case == "generate":
        return generate_case(m, vocab, device)
    return train_case(m, vocab, device)


# --- timing, shared by the gloo ranks and the GPU ------------------------------------------
def graphs() -> int:
    """Graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def agree(ok: bool) -> bool:
    """Whether every rank says ok (a method that fails on one rank is dropped on all)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _device() -> Any:
    import torch
    import torch.distributed as dist

    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def clock(device: Any) -> Callable[[Callable[[], Any]], float]:
    """time(fn) -> seconds: starting at a barrier, by the wall clock on CPU and by CUDA events
    (with a synchronize each side) on a GPU."""
    import torch
    import torch.distributed as dist

    def wall(fn: Callable[[], Any]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def events(fn: Callable[[], Any]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        dist.barrier()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000

    return events if device.type == "cuda" else wall


def run_case(
    case: str, methods: dict[str, Method], vocab: int, device: Any, args: Any
) -> dict[str, Any]:
    """One case: each method's parity check (which also compiles), then rounds of every
    method in turn. Returns times, logits differences, errors and the graphs compiled."""
    import torch

    out: dict[str, Any] = {"times": {}, "diff": {}, "errors": {}, "graphs": {}, "recompiles": {}}
    runs, want = {}, None
    for name, m in methods.items():
        before = graphs()
        try:
            run, check = prepare(case, m, vocab, device)
            got = check()
            ok = True
        except Exception as e:  # a method that cannot run a case is a cell that says why
            traceback.print_exc()
            out["errors"][name] = one_line(e)
            ok = False
        if not agree(ok):
            out["errors"].setdefault(name, "failed on another rank")
            continue
        if name == "plain":
            want = got
        elif want is not None:
            out["diff"][name] = (
                float((got - want).abs().max()) if got.shape == want.shape else float("nan")
            )
        if m.compiled:
            out["graphs"][name] = graphs() - before
        runs[name] = run
        del got
    time_it = clock(device)
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    counted = {n: 0 for n in names}
    calls = {n: 0 for n in names}

    def one(name: str, phase: str) -> float:
        before = graphs()
        seconds = time_it(runs[name])
        calls[name] += 1
        if calls[name] > args.warmup:  # graphs made during the timed rounds: recompiles
            counted[name] += graphs() - before
        elif methods[name].compiled:
            out["graphs"][name] += graphs() - before
        if phase == "train":
            methods[name].model.zero_grad(set_to_none=True)
        return seconds

    result = {"times": {case: times}}
    _common.time_rounds(one, result, [case], names, args.warmup, args.rounds)
    for name in names:  # a round's time is the slower rank's
        t = torch.tensor(times[name], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        out["times"][name] = t.tolist()
        if methods[name].compiled:
            out["recompiles"][name] = counted[name]
    return out


def measure_all(
    folder: Path, mesh: Any, args: Any, *, dtype: Any, mode: str, on_case: Any = None
) -> dict[str, Any]:
    """Every case for every method on this rank; the same dict on every rank. `on_case(result)`
    runs after each case (the GPU run saves what it has, in case the next case outlasts it)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    names = [n for n in args.methods if n != "tpplan" or has_local_shards()]
    device = _device()
    methods, errors = load_methods(folder, mesh, names, dtype=dtype, mode=mode)
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    result: dict[str, Any] = {
        "tp": dist.get_world_size(),
        "methods": names,
        "local_shards": has_local_shards(),
        "load_errors": errors,
        "dtensor_params": {name: dtensor_params(m.model) for name, m in methods.items()},
        "loadavg_before": list(os.getloadavg()),
        "cases": {},
    }
    for case in args.only:
        # each case compiles its own graphs: a no-grad graph from an earlier case left in
        # dynamo's cache made the training graph of tpplan compiled fail (RecursionError in
        # AOT autograd's tracing) where the same case alone compiles
        torch._dynamo.reset()
        t0 = time.perf_counter()
        result["cases"][case] = run_case(case, methods, vocab, device, args)
        result["cases"][case]["seconds"] = time.perf_counter() - t0
        if dist.get_rank() == 0:
            print(
                f"tp {result['tp']}: {case} done in {time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        if on_case is not None:
            on_case(result)
    result["loadavg_after"] = list(os.getloadavg())
    return result


# --- one torchrun rank (CPU) ---------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = measure_all(Path(args.worker), mesh, args, dtype=torch.float32, mode="default")
    if dist.get_rank() == 0:
        print(MARK + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 on gloo aborts now and then in interpreter teardown


def run_tp(folder: Path, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    """torchrun with `tp` gloo ranks, one thread each; what rank 0 printed, or the error."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={tp}", __file__, "--worker", str(folder)]
    cmd += ["--rounds", str(args.rounds), "--warmup", str(args.warmup)]
    cmd += ["--only", *args.only, "--methods", *args.methods]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=3600, env=env)
    for line in run.stdout.splitlines():
        if line.startswith(MARK):
            return dict(json.loads(line[len(MARK) :]))
    return {"tp": tp, "error": f"torchrun exited {run.returncode} (its stderr is above)"}


def save_model(folder: Path, fields: dict[str, Any], dtype: Any) -> int:
    """Random weights, seeded, saved with save_pretrained; returns the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**fields), dtype=dtype)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def meta() -> dict[str, str]:
    """Versions; TPPLAN_BENCH_REVISION names the tpplan measured where git cannot (a copy of
    the package carried to a GPU machine, inside a checkout whose work tree differs)."""
    found = _common.versions()
    if os.environ.get("TPPLAN_BENCH_REVISION"):
        found["tpplan"] = os.environ["TPPLAN_BENCH_REVISION"]
    return found


def machine() -> dict[str, Any]:
    """What says which machine the numbers come from."""
    import platform

    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "processor": platform.processor() or platform.machine(),
    }


def measure_cpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    folder = Path(tempfile.mkdtemp(prefix="tpplan-runtime-"))
    try:
        params = save_model(folder, CPU_CONFIG, torch.float32)
        results: dict[str, Any] = {
            "meta": meta(),
            "machine": machine(),
            "params": params,
        }
        results |= {"config": CPU_CONFIG, "dtype": "float32", "device": "cpu", "runs": []}
        results |= {"rounds": args.rounds, "warmup": args.warmup}
        print(info_line(results), file=sys.stderr, flush=True)
        for tp in args.tp:
            results["runs"].append(run_tp(folder, tp, args))
        return results
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --- the GPU (one process, world size 1, NCCL) ---------------------------------------------
def measure_gpu(args: argparse.Namespace, name: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from gpu_overhead import _init
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    device = _init("nccl")
    folder = Path(tempfile.mkdtemp(prefix="tpplan-runtime-gpu-"))
    try:
        params = save_model(folder, GPU_CONFIG, torch.bfloat16)
        results: dict[str, Any] = {
            "meta": meta(),
            "machine": machine(),
            "params": params,
        }
        results |= {"config": GPU_CONFIG, "dtype": "bfloat16", "runs": []}
        results |= {"device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda or ""}
        results |= {"rounds": args.rounds, "warmup": args.warmup}
        print(info_line(results), file=sys.stderr, flush=True)
        mesh = init_device_mesh("cuda", (1,))

        def partial(run: dict[str, Any]) -> None:
            _common.save(name, {**results, "runs": [run]})

        run = measure_all(
            folder, mesh, args, dtype=torch.bfloat16, mode="reduce-overhead", on_case=partial
        )
        results["runs"].append(run)
        results["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    dist.destroy_process_group()
    return results


# --- printing and drawing ------------------------------------------------------------------
def info_line(results: dict[str, Any]) -> str:
    meta, mach, cfg = results["meta"], results["machine"], results["config"]
    load = ", ".join(f"{x:.2f}" for x in mach["loadavg"])
    where = (
        f"{results['device']} (CUDA {results.get('cuda', '')}), NCCL world size 1, CUDA-event times"
        if results["device"] != "cpu"
        else "gloo, one thread per rank, wall-clock times of the slower rank"
    )
    return (
        f"Llama, {cfg['num_hidden_layers']} layers of width {cfg['hidden_size']} "
        f"({cfg['num_attention_heads']} heads, {cfg['num_key_value_heads']} kv heads, MLP "
        f"{cfg['intermediate_size']}, vocab {cfg['vocab_size']}), {results['params'] / 1e6:.0f} M "
        f"params, {results['dtype']}; {where}; median (min-max) of {results['rounds']} rounds "
        f"after {results['warmup']} warm-up. Machine {mach['host']}: {mach['cpus']} CPUs, load "
        f"average {load} at the start. " + _common.provenance_line(meta)
    )


def ratio(case: dict[str, Any], num: str, den: str) -> float | None:
    t = case["times"]
    if not t.get(num) or not t.get(den):
        return None
    return _common.median(t[num]) / _common.median(t[den])


def cell(case: dict[str, Any], name: str, run: dict[str, Any]) -> str:
    if name in run.get("load_errors", {}):
        return "fails to load"
    if name in case["errors"]:
        return "fails"
    if not case["times"].get(name):
        return ""
    ms = [1000 * s for s in case["times"][name]]
    med = _common.median(ms)
    digits = 1 if med < 100 else 0
    return f"{med:.{digits}f} ({min(ms):.{digits}f}-{max(ms):.{digits}f})"


def render(results: dict[str, Any]) -> str:
    runs = [r for r in results["runs"] if "error" not in r]
    names = [n for n in METHODS if any(n in r["methods"] for r in runs)]
    ratio_cols = [
        ("tpplan / plain", lambda ms: (lead(ms), "plain")),
        ("tpplan / transformers", lambda ms: (lead(ms), "transformers")),
        ("compiled: tpplan / plain", lambda ms: ("tpplan compiled", "plain compiled")),
    ]
    wanted = {(c, tp, n, d): limit for c, tp, n, d, limit in TARGETS}
    rows, lines, notes = [], [], []
    for case_name in CASES:
        for run in runs:
            case = run["cases"].get(case_name)
            if case is None:
                continue
            row = [CASE_LABELS[case_name], run["tp"]] + [cell(case, n, run) for n in names]
            for _, pick in ratio_cols:
                num, den = pick(run["methods"])
                r = ratio(case, num, den)
                limit = wanted.get(
                    (case_name, run["tp"], "tpplan" if num == lead(run["methods"]) else num, den)
                )
                if r is None:
                    row.append("")
                elif limit is None:
                    row.append(f"{r:.2f}")
                else:
                    verdict = "met" if r <= limit else "not met"
                    row.append(f"**{r:.2f}** (≤ {limit:.2f}: {verdict})")
                    lines.append(
                        f"- {'MET' if r <= limit else 'NOT MET'} {CASE_LABELS[case_name]}, tp "
                        f"{run['tp']}: {num} / {den} = {r:.2f} (target ≤ {limit:.2f})"
                    )
            rows.append(row)
            for name, err in sorted(case["errors"].items()):
                notes.append(f"- {CASE_LABELS[case_name]}, tp {run['tp']}, {name}: {err}")
            if case["recompiles"]:
                made = [
                    f"{n} {case['graphs'].get(n, 0)} graph(s) before the timed rounds, {k} "
                    f"during them{' (recompiles)' if k else ''}"
                    for n, k in sorted(case["recompiles"].items())
                ]
                notes.append(f"- {CASE_LABELS[case_name]}, tp {run['tp']}: " + "; ".join(made))
    diff_rows = [
        [CASE_LABELS[c], run["tp"]]
        + [
            f"{run['cases'][c]['diff'][n]:.1e}" if n in run["cases"][c]["diff"] else ""
            for n in names[1:]
        ]
        for c in CASES
        for run in runs
        if c in run["cases"]
    ]
    for run in runs:
        if run.get("dtensor_params"):
            counts = ", ".join(f"{n} {c}" for n, c in run["dtensor_params"].items())
            notes.append(f"- tp {run['tp']}, parameters that are DTensors: {counts}")
    for run in results["runs"]:
        if "error" in run:
            notes.append(f"- tp {run['tp']}: {run['error']}")
        for name, err in sorted(run.get("load_errors", {}).items()):
            notes.append(f"- tp {run['tp']}, {name} does not load: {err}")
    headers = ["case", "tp", *[f"{n} ms" for n in names], *[c for c, _ in ratio_cols]]
    path = (
        "present"
        if any(r.get("local_shards") for r in runs)
        else "absent (apply_plan has no local_shards yet)"
    )
    parts = [
        info_line(results),
        f"tpplan's local_shards fast path: {path}.",
        "",
        _common.markdown(headers, rows),
    ]
    # the rest folded (the bold cells say which target is met): results/NAME.md holds it
    folded = ["Targets (issue 22):", *lines, ""] if lines else []
    folded += [
        "Largest logits difference from the plain model (generate: over its steps' logits):",
        "",
        _common.markdown(["case", "tp", *names[1:]], diff_rows),
    ]
    folded += ["", "Notes:", *notes] if notes else []
    parts += ["", *_common.fold("The targets, the logits differences and notes", folded)]
    return "\n".join(parts)


def plot(results: dict[str, Any], name: str) -> None:
    plt = _common.pyplot()
    runs = [r for r in results["runs"] if "error" not in r]
    cases = [c for c in CASES if any(c in r["cases"] for r in runs)]
    names = [n for n in METHODS if any(n in r["methods"] for r in runs)]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.6 * len(cases), 3.8), squeeze=False)
    width = 0.8 / len(names)
    for ax, case_name in zip(axes[0], cases, strict=True):
        for i, method in enumerate(names):
            xs, meds, lows, highs = [], [], [], []
            for j, run in enumerate(runs):
                times = run["cases"].get(case_name, {}).get("times", {}).get(method)
                if not times:
                    continue
                med = 1000 * _common.median(times)
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                meds.append(med)
                lows.append(med - 1000 * min(times))
                highs.append(1000 * max(times) - med)
            ax.bar(xs, meds, width, yerr=[lows, highs], capsize=2, label=method)
        ax.set_xticks(range(len(runs)), [f"tp {r['tp']}" for r in runs])
        ax.set_yscale("log")
        ax.set_ylabel("ms (median; bars: min-max)")
        ax.set_title(CASE_LABELS[case_name], fontsize=9)
        ax.grid(alpha=0.3, axis="y", which="both")
    axes[0][0].legend(fontsize=7)
    where = results["device"] if results["device"] != "cpu" else "CPU, gloo"
    fig.suptitle(f"tpplan run time ({where}, {results['dtype']})", fontsize=10)
    _common.save_plot(fig, name)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# --- command line --------------------------------------------------------------------------
def command_line() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tp sizes (CPU)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds before them")
    parser.add_argument("--only", nargs="+", default=list(CASES), choices=CASES, help="cases")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--gpu", action="store_true", help="tp 1 on one CUDA GPU, bf16")
    parser.add_argument("--out", help="results name (default runtime, or runtime_gpu)")
    _common.render_flags(parser)
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = command_line().parse_args()
    if args.worker:
        worker(args)
        return
    name = args.out or ("runtime_gpu" if args.gpu else "runtime")
    if args.render:
        results = _common.load(name)
    elif args.gpu and not cuda_available():
        print("--gpu measures on a CUDA GPU; torch sees none here", file=sys.stderr)
        sys.exit(2)
    else:
        results = measure_gpu(args, name) if args.gpu else measure_cpu(args)
        _common.save(name, results)
        _common.save_tables(render(results), name)
    print(_common.rendered(render(results), name, full=args.full))
    if not args.no_plot:
        plot(results, name)


if __name__ == "__main__":
    main()
