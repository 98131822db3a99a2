"""The shipped plans: what each one gathers inside its blocks, and what its blocks send.

For every plan in `plans/`, this builds the family's model at the shape the plan was written
for (its `model.command`), with 2 layers (2 + 2 for encoder-decoders), on the meta device in
bf16. It applies the plan at tp 2 on a fake process group and runs one forward of 32 tokens
under CommDebugMode. It prints the layers inside the blocks that the plan splits and then
gathers (colwise with `output: replicate`), and each block's all-gathers and all-reduces in
that forward. The Megatron split of a block is one all-reduce per attention and per MLP, with
no all-gather.

    python benchmarks/shipped_attention.py
"""

from __future__ import annotations

import shlex
from pathlib import Path

import _common
import torch

import tpplan
from tpplan import cli
from tpplan._runtime.inputs import example_inputs
from tpplan._runtime.local import fake_ranks
from tpplan._runtime.models import build_model, parse_overrides
from tpplan.check.run import _comm_counting
from tpplan.plan.shipped import shipped_plans
from tpplan.plan.styles import ColwiseRule

TP = 2
LAYERS = {"num_hidden_layers": 2}
# the decoder's layers; DeepSeek-V3's second layer with its experts (the first is dense)
EXTRA = {"t5": {"num_decoder_layers": 2}, "deepseek_v3": {"first_k_dense_replace": 1}}


def measure(name: str, path: Path) -> dict[str, object]:
    plan = tpplan.load_plan(path)
    assert plan.model is not None and plan.model.command
    args = cli._parser().parse_args(shlex.split(plan.model.command)[1:])
    layers = {**LAYERS, **EXTRA.get(name, {})}
    model = build_model(args.model, {**parse_overrides(args.overrides), **layers}, device="meta")
    model = model.to(torch.bfloat16)  # the experts' meta grouped matmul runs in bf16 only
    # colwise with output replicate; only colwise rules can gather (rowwise sums its output)
    gathered = sorted(
        r.match
        for r in plan.rules
        if isinstance(r, ColwiseRule) and r.output == "replicate" and "*" in r.match
    )
    inputs = example_inputs(model, batch=1, seq=32, device="meta")
    with fake_ranks(TP) as mesh:
        tpplan.apply_plan(model, mesh, plan)
        # CommDebugMode, mended for a module called twice in a forward (T5's dropout)
        with torch.no_grad(), _comm_counting() as comm:
            model(**inputs)
    # a block is a module whose name ends in its index (model.layers.0, decoder.block.1)
    blocks = {
        fqn: counts.get("forward", {})
        for fqn, counts in comm.comm_module_counts.items()
        if fqn.rpartition(".")[2].isdigit()
    }
    top = {f for f in blocks if not any(f != g and f.startswith(g + ".") for g in blocks)}

    def per_block(kind: str) -> float:
        total = sum(v for f in top for k, v in blocks[f].items() if kind in str(k))
        return total / max(len(top), 1)

    return {
        "plan": name,
        "class": plan.model.class_,
        "layers gathered in blocks": ", ".join(g.rpartition(".")[2] for g in gathered) or "none",
        "blocks": len(top),
        "all-gathers per block": per_block("all_gather"),
        "all-reduces per block": per_block("all_reduce"),
    }


def main() -> None:
    rows = [measure(name, path) for name, path in sorted(shipped_plans().items())]
    print(
        f"tpplan {_common.revision()}; torch {torch.__version__}; tp {TP}, fake process group, 32 tokens.\n"
    )
    cells = [[f"{v:g}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows]
    print(_common.markdown(list(rows[0]), cells))


if __name__ == "__main__":
    main()
