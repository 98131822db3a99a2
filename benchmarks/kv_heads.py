"""More tp than key/value heads, or than tp divides: what each rank holds and sends in
attention.

Builds Llama-3-70B's and Qwen3-30B-A3B's shapes (2 layers, on the meta device), infers a
plan at a tp size above their key/value head counts (16 for 8 heads, 8 for 4), and
Qwen2-7B's, Falcon-7B's and Qwen2-0.5B's at a tp size that does not divide their query
heads (28 and 71 at tp 8, 14 at tp 4: heads split unevenly, issue 35 h), applies it on a fake process group and
prints, for rank 0 (the most loaded one): the attention parameters (query and output
projections, key and value projections) and the KV cache as fractions of the model's, the
working copies of its own rows a layer of heads split unevenly keeps beside its shard (as a
fraction of the query and output projections), and the collectives of each block's
attention in the forward. Saves results/kv_heads.json; `--render` prints it again without
importing torch.

    python benchmarks/kv_heads.py
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
from typing import Any

import _common

LAYERS = 2
CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "Llama-3-70B": (
        "llama",
        {
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
        },
        16,
    ),
    "Qwen3-30B-A3B": (
        "qwen3_moe",
        {
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "vocab_size": 151936,
        },
        8,
    ),
    "Qwen2-7B": (
        "qwen2",
        {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
        },
        8,
    ),
    # multi-query attention in one fused query_key_value, viewed (B, T, num_heads + 2, D)
    "Falcon-7B": (
        "falcon",
        {
            "hidden_size": 4544,
            "num_attention_heads": 71,
            "num_kv_heads": 1,
            "multi_query": True,
            "new_decoder_architecture": False,
            "parallel_attn": True,
            "bias": False,
            "vocab_size": 65024,
        },
        8,
    ),
    "Qwen2-0.5B": (
        "qwen2",
        {
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
        },
        4,
    ),
}
SEQ = 32


def _attention(model: Any) -> dict[str, list[str]]:
    """{"q, o": [...], "k, v": [...]}: the projections' parameter names of every block; a
    fused q|k|v (Falcon's query_key_value) and its output layer under "fused"."""
    out: dict[str, list[str]] = {"q, o": [], "k, v": [], "fused": []}
    for name, _ in model.named_parameters():
        if ".self_attn." in name:
            side = "k, v" if any(f".{p}." in name for p in ("k_proj", "v_proj")) else "q, o"
            if any(f".{p}." in name for p in ("q_proj", "o_proj", "k_proj", "v_proj")):
                out[side].append(name)
        elif ".self_attention." in name:
            out["fused"].append(name)
    return out


def _cache(out: Any) -> int:
    """Bytes of the key/value cache a forward returned (transformers' DynamicCache)."""
    import torch

    from tpplan._runtime.tree import local_bytes

    cache = out.past_key_values
    return sum(
        local_bytes(t)
        for layer in cache.layers
        for t in (layer.keys, layer.values)
        if isinstance(t, torch.Tensor)
    )


def measure(label: str) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    import tpplan
    from tpplan._runtime.local import fake_ranks
    from tpplan._runtime.models import build_model
    from tpplan._runtime.tree import local_bytes
    from tpplan.plan.styles import ColwiseRule

    spec, config, tp = CASES[label]
    model = build_model(spec, {**config, "num_hidden_layers": LAYERS}, device="meta")
    model = model.to(torch.bfloat16)  # the meta grouped matmul of experts runs in bf16 only
    plan = tpplan.infer_plan(model, tp_size=tp)
    shared = any(getattr(r, "replicate_heads", None) for r in plan.rules)
    uneven = any(r.uneven_group() is not None for r in plan.rules)
    # gathered: split and gathered right after (colwise with output replicate; only colwise
    # rules can gather, and the other styles' rules have no `output` or sum it)
    gathered = any(
        isinstance(r, ColwiseRule)
        and r.output == "replicate"
        and any(p in r.match for p in (".self_attn.", ".self_attention."))
        for r in plan.rules
    )
    sides = _attention(model)
    params = dict(model.named_parameters())
    total = {k: sum(local_bytes(params[n]) for n in v) for k, v in sides.items()}
    fused = total["fused"] > 0  # no q, o and k, v apart: their shares are not told
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    with torch.no_grad():
        whole_cache = _cache(model(input_ids=ids, use_cache=True))
    sharded = copy.deepcopy(model)
    with fake_ranks(tp) as mesh:
        tpplan.apply_plan(sharded, mesh, plan)
        mine = dict(sharded.named_parameters())
        held = {k: sum(local_bytes(mine[n]) for n in v) for k, v in sides.items()}
        with torch.no_grad(), CommDebugMode() as first:
            cache = _cache(sharded(input_ids=ids, use_cache=True))
        # every call's collectives: the second call's (a layer of heads split unevenly
        # gathers its weight's own rows once, at its first call: counted apart)
        with torch.no_grad(), CommDebugMode() as comm:
            sharded(input_ids=ids, use_cache=True)
        copies = sum(
            local_bytes(t)
            for m in sharded.modules()
            if (run := getattr(m, "_tpplan_local_run", None)) is not None and run.own is not None
            for t in run.own.kept()
        )
        # the collectives inside each block's attention module (its fqn ends in self_attn)
        attn = [
            counts.get("forward", {})
            for fqn, counts in comm.comm_module_counts.items()
            if fqn.endswith(("self_attn", "self_attention"))
        ]
    reduce = sum(v for c in attn for k, v in c.items() if "all_reduce" in str(k))
    gather = sum(v for c in attn for k, v in c.items() if "all_gather" in str(k))
    once = sum(
        v
        for fqn, counts in first.comm_module_counts.items()
        if fqn.endswith(("self_attn", "self_attention"))
        for k, v in counts.get("forward", {}).items()
        if "all_gather" in str(k)
    )
    return {
        "model": label,
        "tp": tp,
        "kv heads": config.get("num_key_value_heads", config.get("num_kv_heads")),
        "plan": "uneven" if uneven else "shared" if shared else "gathered" if gathered else "split",
        "q, o per rank": None if fused else held["q, o"] / total["q, o"],
        "k, v per rank": None if fused else held["k, v"] / total["k, v"],
        "attention per rank": sum(held.values()) / sum(total.values()),
        "KV cache per rank": cache / whole_cache,
        # over the query and output projections (fused: the whole attention's)
        "row copies per rank": copies / (total["fused"] or total["q, o"]),
        "attention all-reduces per block": reduce / LAYERS,
        "attention all-gathers per block": gather / LAYERS,
        "weight-row gathers per block, first call": (once - gather) / LAYERS,
    }


def _cell(key: str, value: object) -> str:
    if value is None:
        return "(fused)"
    if isinstance(value, float) and (value == 0 or "per block" in key):
        return f"{value:g}"
    if isinstance(value, float) and 0 < value <= 1:
        return f"1/{1 / value:.3g}"
    return str(value)


def render(data: dict[str, Any]) -> str:
    rows = data["rows"]
    meta = data["meta"]
    head = (
        f"{meta['date']}; tpplan {meta['tpplan']}; torch {meta['torch']}, Python "
        f"{meta['python']}; {LAYERS} layers on the meta device, a fake process group; rank 0."
    )
    cols = data["columns"]  # the order measure() gives them (the file sorts its keys)
    table = _common.markdown(cols, [[_cell(k, r[k]) for k in cols] for r in rows])
    return f"{head}\n\n{table}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.render_flags(parser)
    args = parser.parse_args()
    if args.render:
        print(render(_common.load("kv_heads")))
        return
    import torch

    rows = [measure(label) for label in CASES]
    meta = {
        "date": datetime.date.today().isoformat(),
        "tpplan": _common.revision(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    data = {"meta": meta, "rows": rows, "columns": list(rows[0])}
    _common.save("kv_heads", data)
    print(render(data))


if __name__ == "__main__":
    main()
