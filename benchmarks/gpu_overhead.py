"""GPU overhead of an applied plan: the model sharded by tpplan at tp 1 over NCCL against the
same plain model, bf16, a Llama-3-8B-wide stack of a few layers.

Run (one CUDA GPU): `python benchmarks/gpu_overhead.py` (about a minute; `--layers 4`,
`--iters 20`, `--render` re-prints benchmarks/results/gpu_overhead.json and redraws the
plot). Under `torchrun --nproc-per-node N` it measures tp N against the plain model on each
rank instead. Without CUDA it refuses (exit 2); `--smoke-cpu` runs the same code on CPU/gloo
with a tiny model to check the script itself, and saves nothing: its times say nothing
about GPUs.

At tp 1 a plan moves no data: every "split" layer holds its whole weight as a DTensor of one
shard, and no collective runs. What is left is the cost of going through DTensor and the
parallel styles' hooks on every sharded module: Python dispatch on the host, and whatever
redistribution or extra copies DTensor's sharding propagation adds on the device. That cost
matters most where the GPU work per call is small (one token, decode-like) and least for long
prefills. A third model, "torch styles", splits the same attention and MLP layers by hand with
torch's own ColwiseParallel / RowwiseParallel: the part of the overhead that is DTensor's own,
which any DTensor plan pays, against what tpplan's plan adds (it also splits the embedding and
the output head). All get the same weights (deep copies of the plain model) and the same
token ids; times are CUDA-event times with a `torch.cuda.synchronize()` around each call,
median over the timed calls after warm-up, the three models taking turns.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

# (label, batch, tokens, pass): decode-like single tokens, a short and a long prefill, and a
# training step where activations dominate
CASES = [
    ("1 token", 1, 1, "no_grad"),
    ("128 tokens", 1, 128, "no_grad"),
    ("2048 tokens", 1, 2048, "no_grad"),
    ("4 × 2048 tokens", 4, 2048, "no_grad"),
    ("2048 tokens, fwd + bwd", 1, 2048, "train"),
]
SMOKE_CASES = [("1 token", 1, 1, "no_grad"), ("32 tokens, fwd + bwd", 1, 32, "train")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(backend: str) -> Any:
    """The default process group: torchrun's environment, or a group of one made here."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def _build(layers: int, smoke: bool, device: Any, dtype: Any) -> Any:
    """A Llama-3-8B-wide model of `layers` layers, built on `device` with random weights, the
    same in every run (seeded) and on every rank."""
    import torch
    from transformers import AutoModelForCausalLM

    overrides: dict[str, Any] = {"num_hidden_layers": layers}
    if smoke:
        overrides |= dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                          num_key_value_heads=4, vocab_size=1024)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_common.config("Llama-3-8B", **overrides),
                                                 dtype=dtype)  # fmt: skip
    return model.eval()


def _timer(device: Any) -> Any:
    """time(fn) -> seconds of one call: CUDA events on a GPU, the wall clock on CPU."""
    import time

    import torch

    def time_it(fn: Any) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return time_it


METHODS = ("plain", "torch styles", "tpplan")


def _torch_styles(model: Any, mesh: Any) -> Any:
    """The same layers split by hand with torch's own ColwiseParallel / RowwiseParallel (the
    styles of transformers' Llama plan, without its embedding rule): DTensor's own cost, to
    tell apart from anything tpplan adds."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {}
    for i in range(len(model.model.layers)):
        block = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):  # fmt: skip
            plan[f"{block}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{block}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import tpplan

    smoke = args.smoke_cpu
    device = _init("gloo" if smoke else "nccl")
    dtype = torch.float32 if smoke else torch.bfloat16
    tp = dist.get_world_size()
    mesh = init_device_mesh(device.type, (tp,))
    plain = _build(args.layers, smoke, device, dtype)
    models = {
        "plain": plain,
        "torch styles": _torch_styles(copy.deepcopy(plain), mesh),
        "tpplan": tpplan.apply_plan(copy.deepcopy(plain), mesh),
    }
    as_dtensor = {
        name: f"{sum(isinstance(p, DTensor) for p in m.parameters())} of "
        f"{len(list(m.parameters()))}"
        for name, m in models.items()
    }
    time_it = _timer(device)
    vocab = plain.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for label, batch, tokens, phase in SMOKE_CASES if smoke else CASES:
        ids = torch.randint(0, vocab, (batch, tokens), generator=g).to(device)

        def call(model: Any, ids: Any = ids, phase: str = phase) -> Any:
            if phase == "no_grad":
                with torch.no_grad():
                    return model(input_ids=ids, use_cache=False).logits
            logits = model(input_ids=ids, use_cache=False).logits
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            logits.float().sum().backward()
            model.zero_grad(set_to_none=True)
            return None

        diff = {}
        with torch.no_grad():
            want = plain(input_ids=ids, use_cache=False).logits.float()
            for name in METHODS[1:]:
                got = models[name](input_ids=ids, use_cache=False).logits
                got = got.full_tensor() if isinstance(got, DTensor) else got
                diff[name] = float((got.float() - want).abs().max())
        del want
        times: dict[str, list[float]] = {name: [] for name in METHODS}
        for i in range(args.warmup + args.iters):
            # rotate which goes first, so clock and thermal drift hit all alike
            order = METHODS[i % 3 :] + METHODS[: i % 3]
            for name in order:
                seconds = time_it(lambda name=name: call(models[name]))
                if i >= args.warmup:
                    times[name].append(seconds)
        # the slower rank decides (one rank at tp 1)
        for name in times:
            t = torch.tensor(times[name], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name] = t.tolist()
        rows.append({"case": label, "batch": batch, "tokens": tokens, "pass": phase,
                     "diff": diff, "times": times})  # fmt: skip
    result = {
        "tp": tp,
        "layers": args.layers,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtensor_params": as_dtensor,
        "warmup": args.warmup,
        "iters": args.iters,
        "smoke": smoke,
        "rows": rows,
    }
    if device.type == "cuda":
        result["cuda"] = torch.version.cuda or ""
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    dist.destroy_process_group()
    return result


def render(results: dict[str, Any]) -> str:
    rows = []
    for r in results["rows"]:
        med = {name: _common.median(r["times"][name]) for name in METHODS}
        base = med["plain"]
        row = [r["case"], f"{1000 * base:.2f}"]
        for name in METHODS[1:]:
            row += [
                f"{1000 * med[name]:.2f}",
                f"{1000 * (med[name] - base):+.2f} ({100 * (med[name] / base - 1):+.1f}%)",
                f"{r['diff'][name]:.1e}",
            ]
        rows.append(row)
    dt = results["dtensor_params"]
    head = (
        f"{results['device']}, tp {results['tp']} ({'gloo' if results['smoke'] else 'NCCL'}), "
        f"{results['layers']} {'tiny Llama' if results['smoke'] else 'Llama-3-8B-wide'} layers, "
        f"{results['dtype']}; DTensor parameters: torch styles {dt['torch styles']}, tpplan "
        f"{dt['tpplan']}; median of {results['iters']} calls after {results['warmup']} warm-up. "
        + _common.provenance_line(results["meta"])
    )
    if results["smoke"]:
        head = "SMOKE RUN ON CPU (checks the script; says nothing about GPUs). " + head
    headers = ["case", "plain ms"]
    for name in METHODS[1:]:
        headers += [f"{name} ms", "over plain", "logits Δ"]
    return head + "\n\n" + _common.markdown(headers, rows)


def _plot(results: dict[str, Any]) -> None:
    plt = _common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [r["case"] for r in results["rows"]]
    width = 0.38
    for i, name in enumerate(METHODS[1:]):
        over = [
            100 * (_common.median(r["times"][name]) / _common.median(r["times"]["plain"]) - 1)
            for r in results["rows"]
        ]
        ax.bar([j + (i - 0.5) * width for j in range(len(labels))], over, width, label=name)
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=15, fontsize=8)
    ax.set_ylabel("time over the plain model (%)")
    ax.set_title(f"tp {results['tp']} over the plain model, {results['device']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    _common.save_plot(fig, "gpu_overhead")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke-cpu", action="store_true", help="check the script on CPU")
    parser.add_argument("--render", action="store_true", help="re-print the saved results")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.render:
        results = _common.load("gpu_overhead")
        print(render(results))
        if not args.no_plot:
            _plot(results)
        return

    import torch

    if not args.smoke_cpu and not torch.cuda.is_available():
        print(
            "gpu_overhead.py measures NCCL on a CUDA GPU, and torch sees none here "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False). Run it on a "
            "GPU machine with a CUDA build of torch; --smoke-cpu checks the script on CPU only.",
            file=sys.stderr,
        )
        sys.exit(2)
    results = run(args)
    results["meta"] = _common.versions()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(render(results))
    if results["smoke"]:
        return  # CPU times of a tiny model are not the result this script is for
    _common.save("gpu_overhead", results)
    if not args.no_plot:
        _plot(results)


if __name__ == "__main__":
    main()
