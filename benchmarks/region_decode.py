"""Decode and training steps of models whose attention is a DTensor region (issue 33), their
regions on local shards (tpplan's default now) against the same regions on DTensors (as
before), the local-path Llama, transformers' own tensor parallelism and the plain model.

Run: `python benchmarks/region_decode.py` (about 10 minutes on 2 cores; `--tp 2`, `--rounds
15`, `--models phi3 bloom`, `--cases decode`, `--out NAME` saves to benchmarks/results/NAME.json,
`--render` re-prints it). Needs `pip install -e '.[bench]'`.

Every model has the same widths: hidden 512, 4 layers, 8 heads (4 key/value heads where the
family has them), MLP 1376, vocab 16000, fp32, random weights from one seed. torchrun starts
the tp ranks on gloo, one thread each; every rank builds each method in the same process:

- tpplan: `apply_plan(model, mesh, plan=<shipped plan>)` (the phi3 and deepseek_v3 plans
  inferred: the shipped ones state the full-size models' fused widths), regions on local
  shards where their proof allows;
- tpplan, DTensor regions: the same plan with its regions run on DTensors (what tpplan did
  before issue 33; split layers outside them still on local shards);
- transformers: transformers' own plan applied by its own code (`apply_tensor_parallelism`,
  what `from_pretrained(tp_plan="auto")` runs), where the family has one;
- plain: the unsharded model on every rank.

Cases: every model's every method is built first; then each round runs all of them in
turn (the order rotating), each timed as the slower rank:
- decode: one token through a 32-token KV cache under no_grad, the cache cropped back to 32
  after every step (T5: a decoder step over 32 encoder tokens); a turn is `--steps` steps
  (4), timed together, so that one step's jitter on a busy machine weighs a quarter;
- train: forward and backward of the loss over 1 x 128 tokens.
Reported: the median over the timed rounds after warm-up, min-max, and the largest
difference of the logits from the plain model's; each ratio (tpplan against another method,
or a model's tpplan decode against Llama's) is the median of the ratios within a round, with
their quartiles, so that the machine's drift over minutes cancels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import load, markdown, median, save  # noqa: E402

MARK = "REGION_DECODE "
MODELS = ("llama", "phi3", "bloom", "t5", "deepseek_v3", "gpt2")
CASES = ("decode", "train")
METHODS = ("tpplan", "tpplan_dtensor_regions", "transformers", "plain")
WIDTH = {
    "llama": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1376, vocab_size=16000),
    "phi3": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1376, vocab_size=16000, pad_token_id=0, eos_token_id=0),
    "bloom": dict(hidden_size=512, n_layer=4, n_head=8, vocab_size=16000),
    "t5": dict(d_model=512, num_layers=4, num_decoder_layers=4, num_heads=8, d_kv=64, d_ff=1376, vocab_size=16000),
    "deepseek_v3": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1376, moe_intermediate_size=256, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=4, vocab_size=16000, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
    "gpt2": dict(n_embd=512, n_layer=4, n_head=8, vocab_size=16000),
}  # fmt: skip


def build(name: str) -> Any:
    import torch

    from tpplan._runtime.models import build_model

    torch.manual_seed(0)
    return build_model(name, dict(WIDTH[name]), device="cpu").eval()


def shard(name: str, method: str, mesh: Any) -> Any:
    """The model of `name` as `method` runs it."""
    import tpplan
    from tpplan.check import complete_plan
    from tpplan.compile.shard import shard_model

    model = build(name)
    if method == "plain":
        return model
    if method == "transformers":
        from _common import apply_transformers_plan

        apply_transformers_plan(model, mesh)
        return model
    # phi3's and deepseek_v3's shipped plans state the full-size models' fused widths
    inferred = name in ("phi3", "deepseek_v3")
    plan = tpplan.infer_plan(model, tp_size=mesh.size()) if inferred else name
    if method == "tpplan":
        return tpplan.apply_plan(model, mesh, plan)
    full, _ = complete_plan(
        tpplan.load_plan(plan) if isinstance(plan, str) else plan, model, tp_size=mesh.size()
    )
    shard_model(model, mesh, full)  # no proof notes: every region on DTensors
    return model


def _logits(out: Any) -> Any:
    from torch.distributed.tensor import DTensor

    t = out.logits
    return t.full_tensor() if isinstance(t, DTensor) else t


def decode_step(name: str, model: Any) -> tuple[Any, Any]:
    """(one step, its logits): a token through a 32-token cache, cropped back after."""
    import torch

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (1, 32), generator=g)
    nxt = torch.randint(3, vocab, (1, 1), generator=g)
    with torch.no_grad():
        if name == "t5":
            enc = model.get_encoder()(input_ids=ids)
            out = model(encoder_outputs=enc, decoder_input_ids=ids, use_cache=True)
            cache = out.past_key_values

            # no_grad inside the step: the step runs later, outside this block
            @torch.no_grad()
            def step() -> Any:
                o = model(encoder_outputs=enc, decoder_input_ids=nxt, past_key_values=cache)
                cache.self_attention_cache.crop(-1)
                return o
        else:
            cache = model(input_ids=ids, use_cache=True).past_key_values

            @torch.no_grad()
            def step() -> Any:
                o = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                cache.crop(-1)
                return o

        return step, _logits(step())


def train_step(name: str, model: Any) -> tuple[Any, Any]:
    import torch

    ids = torch.randint(3, 16000, (1, 128), generator=torch.Generator().manual_seed(2))
    kw = {"decoder_input_ids": ids} if name == "t5" else {}

    def step() -> Any:
        out = model(input_ids=ids, **kw)
        _logits(out).float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        return out

    with torch.no_grad():
        logits = _logits(model(input_ids=ids, **kw))
    return step, logits


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result: dict[str, Any] = {}
    for case in args.cases:
        # every model's every method built first, then all of them take turns in each round
        # (the order rotating): a ratio between two models is paired within a round, not
        # read across the minutes that separate one model's rounds from another's
        runs: dict[tuple[str, str], Any] = {}
        for name in args.models:
            for method in METHODS:
                try:
                    model = shard(name, method, mesh)
                    make = decode_step if case == "decode" else train_step
                    runs[name, method] = make(name, model)
                except Exception as e:  # a method the family lacks: reported, not timed
                    runs[name, method] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        order = [key for key, run in runs.items() if not isinstance(run, str)]
        steps = args.steps if case == "decode" else 1
        times: dict[tuple[str, str], list[float]] = {key: [] for key in order}
        for i in range(args.warmup + args.rounds):
            k = i % max(1, len(order))
            for key in order[k:] + order[:k]:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(steps):
                    runs[key][0]()
                if i >= args.warmup:
                    times[key].append((time.perf_counter() - t0) / steps)
        for name in args.models:
            plain = runs[name, "plain"][1]
            entry: dict[str, Any] = {}
            for method in METHODS:
                run = runs[name, method]
                if isinstance(run, str):
                    entry[method] = {"error": run}
                    continue
                t = torch.tensor(times[name, method], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                diff = (run[1].float() - plain.float()).abs().max().item()
                entry[method] = {"times": t.tolist(), "max_diff": diff}
            result[f"{name}/{case}"] = entry
    if dist.get_rank() == 0:
        print(MARK + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def paired(times: list[float], other: list[float], rounds_together: bool) -> str:
    """With the rounds taken together: the median of the round-by-round ratios as "1.02x
    (0.95-1.10)", with their quartiles. Results from before they were (each model's rounds
    apart): the ratio of the medians."""
    if not rounds_together:
        return f"{median(times) / median(other):.2f}x"
    ratios = sorted(a / b for a, b in zip(times, other, strict=True))
    q = len(ratios) // 4
    return f"{median(ratios):.2f}x ({ratios[q]:.2f}-{ratios[-1 - q]:.2f})"


def render(results: dict[str, Any]) -> str:
    lines = [results["meta"], ""]
    together = results.get("rounds_together", False)
    for tp, table in results["tp"].items():
        rows = []
        llama = table.get("llama/decode", {}).get("tpplan", {})
        base = llama.get("times")
        for key, entry in table.items():
            row = [key, tp]
            for method in METHODS:
                run = entry.get(method, {})
                if "times" not in run:
                    row.append("n/a")
                    continue
                ms = [1000 * x for x in run["times"]]
                row.append(
                    f"{median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}), diff {run['max_diff']:.1e}"
                )
            own = entry.get("tpplan", {})
            ratios = []
            for other, label in (
                ("tpplan_dtensor_regions", "DTensor regions"),
                ("transformers", "transformers"),
            ):
                run = entry.get(other, {})
                if "times" in own and "times" in run:
                    ratios.append(f"{paired(own['times'], run['times'], together)} {label}")
            if base and key.endswith("/decode") and "times" in own:
                ratios.append(f"{paired(own['times'], base, together)} Llama")
            row.append(", ".join(ratios))
            rows.append(row)
        headers = ["model/case", "tp", *[f"{m} ms" for m in METHODS], "tpplan vs"]
        lines.append(markdown(headers, rows))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=4, help="decode steps a turn, their mean timed"
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--render", action="store_true")
    parser.add_argument("--out", default="region_decode", help="results name (benchmarks/results/)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.render:
        print(render(load(args.out)))
        return
    import platform
    import subprocess

    from _common import provenance_line, versions

    results: dict[str, Any] = {
        "meta": f"{provenance_line(versions())} gloo, one thread per rank, {platform.machine()}; "
        f"{args.rounds} rounds after {args.warmup} warm-up, {args.steps} decode steps a turn; "
        "median (min-max) ms a step",
        "tp": {},
        "rounds_together": True,
    }
    for tp in args.tp:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={tp}",
        ]
        cmd += [__file__, "--worker", "--rounds", str(args.rounds), "--warmup", str(args.warmup)]
        cmd += ["--steps", str(args.steps)]
        cmd += ["--models", *args.models, "--cases", *args.cases]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith(MARK)), None)
        if line is None:
            sys.exit(f"tp {tp} failed:\n{run.stderr[-3000:]}")
        results["tp"][str(tp)] = json.loads(line[len(MARK) :])
    save(args.out, results)
    print(render(results))


if __name__ == "__main__":
    main()
