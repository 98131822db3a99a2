"""What the scaling benchmarks share: the published model shapes they build, transformers'
own hand-written plan applied by transformers' own code, a counter of collectives, and the
table, plot and provenance helpers.

Used by infer_time.py, memory_tp.py, collectives.py, forward_gloo.py, gpu_overhead.py and
checkpoint_memory.py. Nothing here downloads anything: models are built from config fields
written below, on the meta device when they are big. `fold` and `rendered` are for every
script whose tables are too long for benchmarks/README.md: it shows a short render, and
results/NAME.md every table.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PLOTS = HERE / "plots"

# Config fields of published checkpoints, copied from their config.json by hand (the scripts
# never download): enough to rebuild each model's shapes, not its weights.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "Llama-3-8B": ("llama", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
    )),
    "Llama-3-70B": ("llama", dict(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False,
    )),
    "Llama-3.1-405B": ("llama", dict(
        hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
        intermediate_size=53248, vocab_size=128256, tie_word_embeddings=False,
    )),
    "Qwen3-8B": ("qwen3", dict(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
    )),
    "Qwen3-30B-A3B": ("qwen3_moe", dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False,
    )),
    "Mixtral-8x7B": ("mixtral", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        tie_word_embeddings=False,
    )),
    "GPT-NeoX-20B": ("gpt_neox", dict(
        hidden_size=6144, num_hidden_layers=44, num_attention_heads=64, intermediate_size=24576,
        vocab_size=50432, rotary_pct=0.25, tie_word_embeddings=False,
    )),
    "Phi-3-mini": ("phi3", dict(
        hidden_size=3072, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=8192, vocab_size=32064, tie_word_embeddings=False,
    )),
}  # fmt: skip


def config(name: str, **overrides: Any) -> Any:
    """The transformers config of a named shape, with fields overridden (layer counts)."""
    from transformers import CONFIG_MAPPING

    model_type, fields = SHAPES[name]
    return CONFIG_MAPPING[model_type](**{**fields, **overrides})


def build_meta(name: str, *, dtype: Any = None, **overrides: Any) -> Any:
    """The causal-LM model of a named shape on the meta device: no memory, no weights."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = config(name, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)
    return model.eval()


def apply_transformers_plan(model: Any, mesh: Any) -> dict[str, str]:
    """Shard `model` with transformers' own hand-written plan through transformers' own code
    (what `from_pretrained(..., tp_plan="auto")` runs before it loads weights), in place.
    Returns the resolved plan, one entry per module or parameter."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=mesh.size()))
    apply_tensor_parallelism(model, mesh, plan)
    return plan


def local_param_bytes(model: Any) -> int:
    """Parameter bytes this rank holds (a DTensor counts its local shard; tied weights once)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def collective_counter() -> Any:
    """A dispatch mode that counts every collective by kind, with the bytes each sends per rank.

    It sees both DTensor's functional collectives (`_c10d_functional`) and the in-place c10d
    ones that transformers' no-grad fast path calls (`dist.all_reduce`), so both plans are
    counted the same way. Ops run through tpplan's `run_op`, which lets meta tensors through
    the grouped matmul of mixture-of-experts layers.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpplan.trace import run_op

    # bookkeeping ops that move no data
    skip = {"wait_tensor", "_wrap_tensor_autograd", "barrier"}
    # c10d's in-place names, mapped to the functional names so one kind reads the same
    rename = {"allreduce_": "all_reduce", "allgather_": "all_gather_into_tensor"}

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: dict[str, dict[str, int]] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kind = func.__name__.split(".")[0]
            if func.namespace in ("_c10d_functional", "c10d") and kind not in skip:
                kind = rename.get(kind, kind)
                entry = self.seen.setdefault(kind, {"count": 0, "bytes": 0})
                entry["count"] += 1
                first = args[0] if args else None
                if isinstance(first, (list, tuple)) and first:  # c10d ops take lists
                    first = first[0]
                if isinstance(first, torch.Tensor):
                    entry["bytes"] += first.numel() * first.element_size()
            return run_op(func, args, kwargs or {})

    return Counter()


def total(seen: dict[str, dict[str, int]], key: str) -> int:
    """Sum of `count` or `bytes` over the kinds a counter saw."""
    return sum(v[key] for v in seen.values())


# ---- provenance, tables, plots ----------------------------------------------------------------
def revision() -> str:
    """The commit the results were made at, and the tpplan files changed since (read only)."""

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=HERE.parent)
        return run.stdout

    changed = [ln[3:] for ln in git("status", "--porcelain", "tpplan").splitlines()]
    return git("rev-parse", "--short", "HEAD").strip() + (
        f" + uncommitted changes to {', '.join(changed)}" if changed else ""
    )


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {
        "tpplan": revision(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpus": str(os.cpu_count()),
    }


def provenance_line(meta: dict[str, str]) -> str:
    return (
        f"tpplan {meta['tpplan']}; torch {meta['torch']}, transformers {meta['transformers']}, "
        f"Python {meta['python']}, {meta['cpus']} CPUs."
    )


def markdown(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


# ---- short renders for benchmarks/README.md, every table in results/NAME.md --------------------
def render_flags(parser: Any) -> None:
    parser.add_argument(
        "--render", action="store_true", help="re-print the saved results (short, as README.md)"
    )
    parser.add_argument(
        "--full", action="store_true", help="with --render: every table, as results/NAME.md"
    )


def fold(summary: str, lines: list[str]) -> list[str]:
    """A long table folded under `summary` (GitHub renders <details>): results/NAME.md holds
    it, and the short render a line that links there."""
    return [f"<details><summary>{summary}</summary>", "", *lines, "", "</details>"]


_FOLD = re.compile(r"<details><summary>(.*?)</summary>\n.*?\n</details>", re.S)


def rendered(text: str, name: str, *, full: bool = False) -> str:
    """What `--render` prints of a render `text` that has folds: short, each fold a link to
    results/NAME.md (what benchmarks/README.md shows); with `full`, that file's text."""
    if full:
        head = f"# {name}: every table\n\nThe results in `{name}.json`, as the script's "
        head += "`--render --full` prints them; benchmarks/README.md shows the short form.\n\n"
        return head + text
    return _FOLD.sub(lambda m: f"{m.group(1)}: in [results/{name}.md](results/{name}.md).", text)


def save_tables(text: str, name: str) -> Path:
    """results/NAME.md: every table of a render that has folds, beside results/NAME.json."""
    path = RESULTS / f"{name}.md"
    path.write_text(rendered(text, name, full=True).rstrip() + "\n")
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; a clear exit when it is missing."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("the plots need matplotlib: pip install -e '.[bench]' (or pass --no-plot)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig: Any, name: str) -> Path:
    PLOTS.mkdir(parents=True, exist_ok=True)
    path = PLOTS / f"{name}.png"
    fig.tight_layout()
    # no timestamp in the PNG, so a rerun with the same numbers leaves the file unchanged
    fig.savefig(path, dpi=110, metadata={"Software": None})
    return path


def median(xs: list[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def spread_ms(times: list[float]) -> str:
    """Seconds as "median (min-max)" in milliseconds."""
    return f"{1000 * median(times):.0f} ({1000 * min(times):.0f}-{1000 * max(times):.0f})"


def time_rounds(
    one: Any, result: dict[str, Any], passes: Any, methods: Any, warmup: int, iters: int
) -> None:
    """`one(method, phase)` -> seconds, for each phase round after round, the methods in an
    order that rotates each round (so none always runs right after another); the rounds
    after `warmup` go into result["times"][phase][method]."""
    for phase in passes:
        for i in range(warmup + iters):
            k = i % len(methods)
            for name in methods[k:] + methods[:k]:
                seconds = one(name, phase)
                if i >= warmup:
                    result["times"][phase][name].append(seconds)


def timed_worker(
    script: str, worker: list[str], args: Any, tp: int, mark: str, timeout: float
) -> dict[str, Any]:
    """Run `script --worker ...` on `tp` gloo processes under torchrun with the timing
    settings of `args` (batch, seq, warmup, iters), one thread each; what rank 0 printed
    after `mark`, or {"error": the last error line}."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={tp}", script, "--worker", *worker]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq)]
    cmd += ["--warmup", str(args.warmup), "--iters", str(args.iters)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    for line in run.stdout.splitlines():
        if line.startswith(mark):
            return dict(json.loads(line[len(mark) :]))
    tail = [ln for ln in run.stderr.splitlines() if "Error" in ln][-1:] or ["?"]
    return {"error": tail[0][:300]}


def whole(t: Any) -> Any:
    """A DTensor's full tensor; anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def time_passes(
    models: dict[str, Any],
    forward: Any,
    result: dict[str, Any],
    passes: Any,
    methods: Any,
    warmup: int,
    iters: int,
) -> None:
    """`time_rounds` over `models` ({method: model}, in the order `methods`): a "no_grad" pass times `forward(model)`
    without autograd, any other a forward and the backward of the output's sum (its full
    tensor), the ranks starting together; gradients are cleared after each such pass."""
    import time

    import torch
    import torch.distributed as dist

    def one(name: str, phase: str) -> float:
        model = models[name]
        dist.barrier()
        t0 = time.perf_counter()
        if phase == "no_grad":
            with torch.no_grad():
                forward(model)
        else:
            whole(forward(model)).float().sum().backward()
        seconds = time.perf_counter() - t0
        if phase != "no_grad":
            model.zero_grad(set_to_none=True)
        return seconds

    time_rounds(one, result, passes, methods, warmup, iters)


def report_rounds(result: dict[str, Any], passes: Any, methods: Any, mark: str) -> None:
    """End a timed torchrun worker: each round's time becomes the slower rank's, rank 0
    prints `result` after `mark` for the driver to read, and the process exits (torch 2.13
    on gloo aborts now and then in interpreter teardown)."""
    import torch
    import torch.distributed as dist

    for phase in passes:
        for name in methods:
            t = torch.tensor(result["times"][phase][name], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            result["times"][phase][name] = t.tolist()
    if dist.get_rank() == 0:
        print(mark + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
