"""Peak memory per rank while loading a checkpoint into a sharded model, against the model's size.

Run: `python benchmarks/checkpoint_memory.py` (CPU, gloo, a few minutes; `--tp 2 4`, `--layers`;
`--render` re-prints benchmarks/results/checkpoint_memory.json without running anything).

It builds a Llama from a small config (about 320 MB in fp32, random weights), saves it with
save_pretrained into a temporary folder, and then, under torchrun at each tp size, loads it
four ways in fresh processes:

- tpplan, safetensors: meta-built model, apply_plan, to_empty, load_checkpoint;
- tpplan, DCP: the same from a torch.distributed.checkpoint folder saved at tp 2;
- `tpplan.from_pretrained(folder, mesh, plan=...)`: the one call doing all of the first row;
- transformers: `from_pretrained(folder, tp_plan="auto")`, its own hand-written plan. It
  needs the `accelerate` package, which tpplan does not depend on; without it that row
  says so.

Each rank resets its peak-RSS counter (writing 5 to /proc/self/clear_refs) right before the
load and reads VmHWM after it: the increase is what loading cost that rank, including the
shards it ends up holding. Pages of the checkpoint that a rank maps while reading count too,
as they should: they are resident. The target is at most 1/tp of the model plus 10%. After
measuring, rank 0 saves its logits on fixed tokens; they are compared with the unsharded
model's. The same file is the worker (`--worker`), started by torchrun. The rows go to
benchmarks/results/checkpoint_memory.json with the revision they were made at.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

SEQ = 16
METHODS = ("tpplan-safetensors", "tpplan-dcp", "tpplan-from-pretrained", "transformers-auto")
LABELS = {
    "tpplan-safetensors": "tpplan, safetensors",
    "tpplan-from-pretrained": "`tpplan.from_pretrained`, safetensors",
    "tpplan-dcp": "tpplan, DCP (saved at tp 2)",
    "transformers-auto": 'transformers `tp_plan="auto"`',
}
MIB = 2**20


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Linux resets VmHWM to the current RSS on '5' (since 4.0); False where it may not."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _config(layers: int):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=16000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _tokens():  # type: ignore[no-untyped-def]
    import torch

    return torch.randint(0, 16000, (1, SEQ), generator=torch.Generator().manual_seed(0))


# --- worker: one torchrun rank --------------------------------------------------------------


def worker(method: str, folder: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, LlamaForCausalLM

    import tpplan
    from tpplan.checkpoint import load_checkpoint, save_checkpoint

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # every rank decides before any writes: rank 0's save creates the folder, and a rank
    # that looked after that would skip the collective save and hang the others
    save_dcp = method == "tpplan-safetensors" and world == 2 and not (folder / "dcp").exists()
    dist.barrier()
    source = folder / ("dcp" if method == "tpplan-dcp" else "safetensors")
    mesh = init_device_mesh("cpu", (world,))
    plan = folder / f"plan-tp{world}.yaml"
    config = AutoConfig.from_pretrained(folder / "safetensors")
    error = ""
    if method == "tpplan-from-pretrained":
        # as for the rows above, the imports and a first plan check (Python objects, a fixed
        # cost that does not grow with the model) happen before the measured call
        with torch.device("meta"):
            tpplan.check_plan(tpplan.load_plan(plan), LlamaForCausalLM(config), tp_size=world)
    if method in ("tpplan-safetensors", "tpplan-dcp"):
        # building on meta and applying the plan allocate nothing worth counting; both are
        # inside transformers' measured call too
        with torch.device("meta"):
            model = LlamaForCausalLM(config).eval()
        tpplan.apply_plan(model, mesh, plan)
    dist.barrier()
    exact = _reset_peak()
    base_rss, base_hwm = _status("VmRSS"), _status("VmHWM")
    start = time.perf_counter()
    try:
        if method == "tpplan-from-pretrained":
            # the whole call: meta build, apply_plan and load_checkpoint
            model = tpplan.from_pretrained(source, mesh, plan=plan, dtype=torch.float32)
        elif method.startswith("tpplan"):
            model.to_empty(device="cpu")
            load_checkpoint(model, source)
        else:
            model = LlamaForCausalLM.from_pretrained(source, tp_plan="auto", dtype=torch.float32)
            model.eval()
    except Exception as e:
        error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - (base_rss if exact else base_hwm)
    held = 0
    if not error:
        for t in model.state_dict().values():
            local = t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t
            held += local.numel() * local.element_size()
    result = {
        "method": method,
        "tp": world,
        "rank": rank,
        "peak": peak,
        "held": held,
        "seconds": seconds,
        "exact": exact,
        "error": error,
    }
    if not error:
        with torch.no_grad():
            logits = model(_tokens()).logits
        # a model whose weights are views of the mapped file pays for them on first use
        result["peak_forward"] = _status("VmHWM") - (base_rss if exact else base_hwm)
        if isinstance(logits, torch.distributed.tensor.DTensor):
            logits = logits.full_tensor()
        if rank == 0:
            torch.save(logits, out / f"logits-{method}-tp{world}.pt")
    print("RESULT " + json.dumps(result), flush=True)
    if save_dcp:
        save_checkpoint(model, folder / "dcp", sharded=True)  # the DCP rows read this
    dist.barrier()  # a peer may still be finishing a DTensor collective
    dist.destroy_process_group()
    # torch 2.13 on gloo aborts now and then in interpreter teardown, after all the work
    sys.stdout.flush()
    os._exit(0)


# --- driver ---------------------------------------------------------------------------------


def _torchrun(nproc: int, method: str, folder: Path) -> tuple[list[dict], str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", __file__, "--worker", method, str(folder)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    results = []
    for chunk in run.stdout.split("RESULT ")[1:]:  # ranks' lines may share a line of stdout
        text = chunk[: chunk.index("}") + 1]
        results.append(json.loads(text))
    tail = "" if run.returncode == 0 else (run.stderr.strip().splitlines() or ["?"])[-1]
    return results, tail


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    import tpplan

    folder = Path(tempfile.mkdtemp(prefix="tpplan-ckpt-bench-"))
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config(args.layers)).eval()
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        model.save_pretrained(folder / "safetensors")
        with torch.no_grad():
            want = model(_tokens()).logits
        for tp in sorted(set(args.tp) | {2}):
            with torch.device("meta"):
                meta = LlamaForCausalLM(_config(args.layers))
            tpplan.infer_plan(meta, tp_size=tp).save(folder / f"plan-tp{tp}.yaml")
        del model
        print(f"model: Llama, {args.layers} layers, {size / MIB:.0f} MiB in fp32", file=sys.stderr)

        rows: list[dict[str, Any]] = []
        # tpplan-safetensors at tp 2 runs first: it also writes the DCP checkpoint the DCP
        # rows load
        for tp in args.tp if 2 in args.tp else [2, *args.tp]:
            for method in METHODS:
                results, tail = _torchrun(tp, method, folder)
                if tp not in args.tp:
                    continue
                errors = {r["error"] for r in results if r["error"]} | ({tail} if tail else set())
                logits_file = folder / f"logits-{method}-tp{tp}.pt"
                if not results or errors or not logits_file.exists():
                    error = "; ".join(sorted(errors)) or tail or "no result"
                    rows.append({"method": method, "tp": tp, "error": error})
                else:
                    keys = ("peak", "peak_forward", "held", "seconds")
                    row = {k: max(r[k] for r in results) for k in keys}
                    row |= {"method": method, "tp": tp, "exact": all(r["exact"] for r in results)}
                    row["diff"] = (torch.load(logits_file) - want).abs().max().item()
                    rows.append(row)
                print(f"{method} tp {tp}: {'failed' if 'error' in rows[-1] else 'done'}",
                      file=sys.stderr)  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"meta": _common.versions(), "layers": args.layers, "size": size, "rows": rows}


def render(results: dict[str, Any]) -> str:
    size = results["size"]
    table = []
    for r in results["rows"]:
        share = size / r["tp"]
        head = [LABELS[r["method"]], r["tp"], f"{share / MIB:.0f}"]
        if "error" in r:
            table.append([*head, f"failed: {r['error']}", "", "", "", "", "", ""])
            continue
        mark = "" if r["exact"] else "*"
        table.append(
            [
                *head,
                f"{r['held'] / MIB:.0f}",
                f"{r['peak'] / MIB:.0f}{mark}",
                f"{r['peak'] / share:.2f}",
                "yes" if r["peak"] <= 1.1 * share else "NO",
                f"{r['peak_forward'] / MIB:.0f}",
                f"{r['seconds']:.1f}",
                f"{r['diff']:.1e}",
            ]
        )
    headers = ["method", "tp", "model/tp", "params", "load peak", "÷ model/tp", "≤ 1.1"]
    headers += ["+1st fwd", "load s", "logits Δ"]
    out = [
        f"Llama, {results['layers']} layers, {size / MIB:.0f} MiB in fp32; MiB per rank, the "
        "worst rank. " + _common.provenance_line(results["meta"]),
        "",
        _common.markdown(headers, table),
    ]
    if not all(r.get("exact", True) for r in results["rows"]):
        out += ["", "*: the peak counter could not be reset; increase over the earlier peak "
                "(a lower bound)."]  # fmt: skip
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--render", action="store_true", help="re-print the saved results")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]), Path(args.worker[1]))
        return
    if args.render:
        results = _common.load("checkpoint_memory")
    else:
        results = measure(args)
        _common.save("checkpoint_memory", results)
    print(render(results))


if __name__ == "__main__":
    main()
