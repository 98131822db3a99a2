"""Collectives per transformer block, forward and backward, tpplan's plan next to transformers'.

Run: `python benchmarks/collectives.py` (about 1 minute on 2 cores; `--models Llama-3-8B`,
`--tp 2`, `--seq 128`, `--render` re-prints benchmarks/results/collectives.json).

Each model is built at its published widths in bf16 on the meta device, once with 2 blocks
and once with 4, and sharded on a fake process group (one process, shapes only) two ways:
tpplan's `infer_plan(model, tp_size=N)` applied with `apply_plan`, and transformers' own
hand-written plan applied by transformers' own `apply_tensor_parallelism` (what
`from_pretrained(..., tp_plan="auto")` runs). Both then see the same token ids (batch 1).
Every collective is counted at dispatch (DTensor's functional ones and plain c10d calls
alike), with its payload: the bytes of the tensor each rank hands to it.

Per block = (4-block count - 2-block count) / 2; "block params per rank" is the share of a
block's parameter bytes one rank holds (0.5 at tp 2 when everything is split); "outside" =
what the embedding, the final norm and the output head add once per pass. Three passes: a forward with autograd on (the
training forward), its backward (from the sum of the logits), and a forward under
`torch.no_grad()` (inference), where transformers takes a fast path of its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

MODELS = [
    "Llama-3-8B",
    "Qwen3-8B",
    "Mixtral-8x7B",
    "Qwen3-30B-A3B",
    "GPT-NeoX-20B",
    "Phi-3-mini",
]
PASSES = ("forward", "backward", "no_grad")
MIB = 2**20


def _count(name: str, layers: int, tp: int, seq: int, plan: str) -> dict[str, Any]:
    """Collectives of the three passes on a `layers`-block model sharded by `plan`."""
    import torch

    import tpplan
    from tpplan._runtime.inputs import example_inputs
    from tpplan._runtime.local import fake_ranks
    from tpplan._runtime.tree import first_tensor

    model = _common.build_meta(name, dtype=torch.bfloat16, num_hidden_layers=layers)
    inputs = example_inputs(model, batch=1, seq=seq, device="meta")
    out: dict[str, Any] = {"total": _common.local_param_bytes(model)}
    with fake_ranks(tp) as mesh:
        if plan == "tpplan":
            tpplan.apply_plan(model, mesh, tpplan.infer_plan(model, tp_size=tp))
        else:
            _common.apply_transformers_plan(model, mesh)
        out["per_rank"] = _common.local_param_bytes(model)
        fwd = _common.collective_counter()
        with fwd, torch.enable_grad():
            logits = first_tensor(model(**inputs))
        bwd = _common.collective_counter()
        with bwd:
            logits.float().sum().backward()
        inference = _common.collective_counter()
        with inference, torch.no_grad():
            model(**inputs)
    out["forward"], out["backward"], out["no_grad"] = fwd.seen, bwd.seen, inference.seen
    return out


def _diff(a: dict[str, Any], b: dict[str, Any], scale: float) -> dict[str, dict[str, float]]:
    """(a - b) * scale, kind by kind."""
    kinds = set(a) | set(b)
    zero = {"count": 0, "bytes": 0}
    out = {}
    for k in kinds:
        v = {f: (a.get(k, zero)[f] - b.get(k, zero)[f]) * scale for f in ("count", "bytes")}
        if v["count"]:
            out[k] = v
    return out


def measure(name: str, tp: int, seq: int) -> list[dict[str, Any]]:
    rows = []
    for plan in ("tpplan", "transformers"):
        row: dict[str, Any] = {"model": name, "plan": plan, "tp": tp, "seq": seq}
        try:
            two, four = (_count(name, n, tp, seq, plan) for n in (2, 4))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]
            rows.append(row)
            continue
        # a block's parameters held by one rank, over a block's parameters
        row["block_fraction"] = (four["per_rank"] - two["per_rank"]) / (
            four["total"] - two["total"]
        )
        for p in PASSES:
            block = _diff(four[p], two[p], 0.5)
            row[p] = {"block": block, "outside": _diff(two[p], _scaled(block, 2), 1)}
        rows.append(row)
    return rows


def _scaled(seen: dict[str, dict[str, float]], k: float) -> dict[str, dict[str, float]]:
    return {kind: {f: v * k for f, v in entry.items()} for kind, entry in seen.items()}


_SHORT = {"all_reduce": "AR", "all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS",
          "all_to_all_single": "A2A"}  # fmt: skip


def _cell(seen: dict[str, dict[str, float]]) -> str:
    if not seen:
        return "0"
    kinds = " + ".join(
        f"{v['count']:g} {_SHORT.get(k, k)}" for k, v in sorted(seen.items()) if v["count"]
    )
    return f"{kinds}, {sum(v['bytes'] for v in seen.values()) / MIB:.1f} MiB"


def render(results: dict[str, Any]) -> str:
    rows = []
    for r in results["rows"]:
        if "error" in r:
            rows.append([r["model"], r["plan"], f"failed: {r['error'][:150]}", "", "", "", "", ""])
            continue
        rows.append(
            [r["model"], r["plan"], f"{r['block_fraction']:.3f}"]
            + [_cell(r[p]["block"]) for p in PASSES]
            + [
                " / ".join(_cell(r[p]["outside"]) for p in ("forward", "backward")),
                _cell(r["no_grad"]["outside"]),
            ]
        )
    headers = [
        "model",
        "plan",
        "block params per rank",
        "forward, per block",
        "backward, per block",
        "no-grad forward, per block",
        "outside blocks, fwd / bwd",
        "outside, no-grad",
    ]
    return "\n".join(
        [
            f"tp {results['tp']}, batch 1 × {results['seq']} tokens, bf16; AR all-reduce, AG "
            "all-gather, RS reduce-scatter; MiB = payload per rank. "
            + _common.provenance_line(results["meta"]),
            "",
            _common.markdown(headers, rows),
        ]
    )


def _plot(results: dict[str, Any]) -> None:
    plt = _common.pyplot()
    ok = [r for r in results["rows"] if "error" not in r]
    models = list(dict.fromkeys(r["model"] for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.2
    for ax, key, label in ((axes[0], "count", "collectives"), (axes[1], "bytes", "MiB")):
        for i, (plan, p) in enumerate(
            [(pl, p) for pl in ("tpplan", "transformers") for p in ("forward", "backward")]
        ):
            ys = []
            for m in models:
                r = next((r for r in ok if r["model"] == m and r["plan"] == plan), None)
                v = _common.total(r[p]["block"], key) if r else 0
                ys.append(v / MIB if key == "bytes" else v)
            xs = [j + (i - 1.5) * width for j in range(len(models))]
            ax.bar(xs, ys, width, label=f"{plan}, {p}", hatch="//" if plan != "tpplan" else "")
        ax.set_xticks(range(len(models)), models, rotation=25, fontsize=7, ha="right")
        ax.set_ylabel(f"{label} per block per rank")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"Collectives per block at tp {results['tp']}, {results['seq']} tokens", fontsize=9
    )
    _common.save_plot(fig, "collectives")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--render", action="store_true", help="re-print the saved results")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.render:
        results = _common.load("collectives")
    else:
        rows = []
        for name in args.models:
            rows += measure(name, args.tp, args.seq)
            print(f"{name}: done", file=sys.stderr)
        results = {"meta": _common.versions(), "tp": args.tp, "seq": args.seq, "rows": rows}
        _common.save("collectives", results)
    print(render(results))
    if not args.no_plot:
        _plot(results)


if __name__ == "__main__":
    main()
