"""Run by torchrun from test_generate.py: every shipped plan's small model, sharded over all
the gloo ranks, runs `generate` in every mode of MODES, and each rank compares its tokens
(and scores) with the unsharded model built from the same seed on the same rank.

`python -m torch.distributed.run --nproc-per-node N generate_ranks.py OUT [PLAN ...]`: each
rank writes OUT/rank{r}.json, {plan: {mode: "ok" | "mismatch: ..." | "error: ..." |
"unsupported: ..."}}; "unsupported" is a mode the unsharded model itself refuses, "n/a" a
plan that does not shard at this tp size (the reason after it). No cell stops the run: a
failing cell is recorded and the next one runs.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).parent))
from support.generate import MODES
from support.shipped import PLANS, generate_config, plan_spec

import tpplan
from tpplan._runtime.models import build_model

# fp32, 1-2 layers: the sharded model sums the same products in another order (seen ~1e-6
# on the logits); a wrong shard or a missing reduction is off by O(0.1), and a score that
# differs by more than the gap between two tokens' logits would show in the tokens anyway.
TOL = 1e-4
NEW = 6  # new tokens per call
SEED = 1234  # the sampling modes seed every rank's global RNG so before each call


def _prompts(vocab: int, pad: int) -> dict[str, torch.Tensor]:
    """One prompt of 5 tokens, and a batch of two (5 and 3 tokens) padded on the left; the
    same on every rank (a generator of our own). Pad never occurs among the tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (2, 5), generator=g)
    ids[ids == pad] = (pad + 1) % vocab
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = pad, 0
    return {"one": ids[:1], "batch": ids, "mask": mask}


def _call(model: Any, mode: str, prompts: dict[str, torch.Tensor], draft: Any, pad: int) -> Any:
    kwargs = dict(
        MODES[mode],
        max_new_tokens=NEW,
        pad_token_id=pad,
        return_dict_in_generate=True,
        output_scores=True,
    )
    if model.config.is_encoder_decoder:  # the decoder starts from the pad token, as T5's does
        kwargs["decoder_start_token_id"] = pad
    if mode == "padded":
        kwargs.update(input_ids=prompts["batch"], attention_mask=prompts["mask"])
    else:
        kwargs.update(input_ids=prompts["one"])
    if mode == "assisted":
        kwargs["assistant_model"] = draft
    torch.manual_seed(SEED)
    with torch.no_grad():
        return model.generate(**kwargs)


def _compare(got: Any, want: Any) -> str:
    if not torch.equal(got["sequences"], want["sequences"]):
        return f"mismatch: tokens {got['sequences'].tolist()} != unsharded {want['sequences'].tolist()}"
    for name in ("scores", "logits", "sequences_scores"):
        if want.get(name) is None:
            continue
        mine, theirs = got[name], want[name]
        mine, theirs = (torch.stack(list(x)) if isinstance(x, tuple) else x for x in (mine, theirs))
        edge = _at_the_filters_edge(mine, theirs)
        if edge:
            return f"mismatch: {name}: {edge}"
        same_inf = torch.isinf(theirs) & (mine == theirs)  # -inf where both filtered a token
        one_inf = torch.isinf(mine) ^ torch.isinf(theirs)
        worst = torch.where(same_inf | one_inf, 0.0, (mine - theirs).abs()).max().item()
        if not worst < TOL:  # also catches a NaN
            return f"mismatch: {name} differ by {worst:.3g} (tol {TOL})"
    return "ok"


def _at_the_filters_edge(mine: torch.Tensor, theirs: torch.Tensor) -> str | None:
    """Why tokens filtered (-inf) on one side only are not a tie at the sampling filter's edge,
    or None when they are (or there are none). top-k and top-p keep the best scores down to
    an edge, ties included; tokens whose scores tie there within TOL (the sharded sums differ
    in their last bits, which differs by CPU) may be kept on one side and not on the other.
    Each token kept on one side only must score, within TOL, what the other side's lowest
    kept token scores (seen: GPT-2's beam_sample, two tokens at -5.88059, both kept
    unsharded and one at tp 2)."""
    one_inf = torch.isinf(mine) ^ torch.isinf(theirs)
    if not one_inf.any():
        return None
    for side, other in ((mine, theirs), (theirs, mine)):
        kept = ~torch.isinf(other)
        edge = torch.where(kept, other, torch.inf).amin(-1, keepdim=True).expand_as(side)
        only = one_inf & ~torch.isinf(side)  # kept on this side only
        off = (side[only] - edge[only]).abs()
        if off.numel() and not off.max().item() < TOL:
            return f"a token kept on one side only, {off.max().item():.3g} off the other's edge"
    return None


def _error(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1]
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:300]} (at {Path(where.filename).name}:{where.lineno})"


def run_plan(path: Path, mesh: Any) -> dict[str, str]:
    """Every mode of one plan at the mesh's tp size."""
    spec, overrides = plan_spec(path)
    config = {**overrides, **generate_config(path.stem)}
    torch.manual_seed(0)
    ref = build_model(spec, config, device="cpu")
    torch.manual_seed(1)  # another model of the same vocab: most of its drafts are rejected
    draft = build_model(spec, config, device="cpu")
    try:
        sharded = tpplan.apply_plan(copy.deepcopy(ref), mesh, plan=path.stem)
    except tpplan.PlanProblemsError as e:  # the heads (or another size) do not split so
        return {mode: f"n/a: {str(e).splitlines()[0][:300]}" for mode in MODES}
    pad = ref.config.pad_token_id if ref.config.pad_token_id is not None else 0
    prompts = _prompts(ref.config.vocab_size, pad)
    cells = {}
    for mode in MODES:
        try:
            want = _call(ref, mode, prompts, draft, pad)
        except Exception as e:  # the unsharded model refuses the mode: no cell to compare
            cells[mode] = f"unsupported: {_error(e)}"
            continue
        try:
            cells[mode] = _compare(_call(sharded, mode, prompts, draft, pad), want)
        except Exception as e:
            cells[mode] = f"error: {_error(e)}"
        dist.barrier()  # the ranks start each cell together
    return cells


def main(out: Path, names: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    paths = [p for p in PLANS if not names or p.stem in names]
    report = {}
    for path in paths:
        start = time.perf_counter()
        try:
            report[path.stem] = run_plan(path, mesh)
        except Exception as e:  # building or sharding failed: every mode of the plan fails
            report[path.stem] = {mode: f"error: {_error(e)}" for mode in MODES}
        print(f"rank {rank}/{world} {path.stem} {time.perf_counter() - start:.1f}s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), sys.argv[2:])
