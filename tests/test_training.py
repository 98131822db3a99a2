"""One plan for training and generation: a training step, loss parallel and `generate`
give the unsharded model's numbers and tokens (every rank simulated in this process)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.infer_models import bert, gpt2
from support.models import tiny_llama, token_batch
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from tpplan import InputMismatchError, Plan, apply_plan, infer_plan, load_plan
from tpplan._runtime.local import own_replicas, rank_values, simulated_ranks

LLAMA_PLAN = Path(__file__).parent / "plans" / "llama.yaml"
TOL = 1e-5  # the bar for fp32; observed errors are ~1e-7


def _lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _whole(t: torch.Tensor) -> list[torch.Tensor]:
    return rank_values(t.full_tensor() if isinstance(t, DTensor) else t)


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    for rank, v in enumerate(_whole(got)):
        err = (v.detach() - want.detach()).abs().max().item()
        assert err <= TOL, f"{what} on rank {rank} differs by {err:.2e}"


def _train_step(
    model: torch.nn.Module, tokens: torch.Tensor, *, parallel_loss: bool = False
) -> torch.Tensor:
    # SGD: the step is linear in the gradient, so gradient parity is parameter parity. Adam's
    # first step divides by |g| + eps and turns ulp-level noise in near-zero gradients
    # (|g| ~ eps) into visible differences that say nothing about the sharding.
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    logits = model(tokens).logits
    if parallel_loss:
        with loss_parallel():
            loss = _lm_loss(logits, tokens)
            loss.backward()
    else:
        loss = _lm_loss(logits, tokens)
        loss.backward()
    opt.step()
    return loss


def _assert_step_matches(
    ref: torch.nn.Module,
    plan: Plan | Path | Callable[[torch.nn.Module], Plan],
    tp: int,
    *,
    parallel_loss: bool = False,
) -> torch.nn.Module:
    """One SGD step of `ref` sharded by `plan` (or by the plan a function gives for it) over
    `tp` simulated ranks: the loss, every gradient and every weight after the step equal the
    unsharded model's, fused parameters included (they hold the unsharded layout). Returns
    the sharded model (call inside no simulation of your own)."""
    tokens = token_batch()
    start = copy.deepcopy(ref)
    want_loss = _train_step(ref, tokens, parallel_loss=False)
    plan = plan(start) if callable(plan) else plan
    with simulated_ranks(tp) as mesh:
        model = apply_plan(copy.deepcopy(start), mesh, plan)
        own_replicas(model, tp)
        loss = _train_step(model, tokens, parallel_loss=parallel_loss)
        _assert_close(loss, want_loss, "loss")
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            _assert_close(p.grad, q.grad, f"{name}.grad")
            _assert_close(p, q, f"{name} after the step")
    return model


def _split_fraction(model: torch.nn.Module) -> float:
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if isinstance(p, DTensor)) / total


@pytest.mark.parametrize("tp", [2, 4])
def test_a_training_step_matches_the_unsharded_model(tp: int) -> None:
    model = _assert_step_matches(tiny_llama(), LLAMA_PLAN, tp)
    assert _split_fraction(model) > 0.5


@pytest.mark.parametrize(("family", "tp"), [("gpt2", 2), ("gpt2", 4), ("bert", 2), ("bert", 4)])
def test_a_training_step_with_the_inferred_plan(family: str, tp: int) -> None:
    """GPT-2 (Conv1D, fused q|k|v, tied head) and BERT (encoder, tied decoder) with the plan
    the tracer infers: one SGD step gives the unsharded model's loss, gradients and weights."""
    ref = {"gpt2": gpt2, "bert": bert}[family]()
    model = _assert_step_matches(ref, lambda m: infer_plan(m, tp_size=tp), tp)
    assert _split_fraction(model) > 0.5


def test_loss_parallel_keeps_logits_sharded_and_matches() -> None:
    text = LLAMA_PLAN.read_text().replace("loss_parallel: false", "loss_parallel: true")
    text = text.replace(
        "    output: replicate\n    why: output head split over the vocab; logits gathered so callers see full rows",
        "    local_output: false\n    why: output head split over the vocab; logits stay sharded for loss_parallel",
    )
    plan = Plan.from_yaml(text)
    assert plan.options.loss_parallel
    ref = tiny_llama()
    tokens = token_batch()
    start = copy.deepcopy(ref)
    want_loss = _train_step(ref, tokens)
    with simulated_ranks(2) as mesh:
        model = apply_plan(copy.deepcopy(start), mesh, plan)
        logits = model(tokens).logits
        assert isinstance(logits, DTensor) and logits.placements[0].is_shard(dim=-1 % logits.ndim)
        own_replicas(model, 2)
        model.zero_grad(set_to_none=True)
        loss = _train_step(model, tokens, parallel_loss=True)
        _assert_close(loss, want_loss, "loss")
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            _assert_close(p, q, f"{name} after the step")


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_on_a_hugging_face_llama_trains_like_the_unsharded_model(tp: int) -> None:
    """Norms run on sequence shards, blocks all-gather and reduce-scatter; the residual
    stream stays a DTensor, so the model's positions span the whole sequence."""
    _assert_step_matches(tiny_llama(), Path(__file__).parent / "plans" / "llama_sp.yaml", tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_inferred_sequence_parallel_plan_trains_like_the_unsharded_model(tp: int) -> None:
    plan = infer_plan(tiny_llama(), tp_size=tp, sequence_parallel=True)
    assert plan.options.sequence_parallel
    _assert_step_matches(tiny_llama(), plan, tp)


def test_inferred_loss_parallel_plan_trains_like_the_unsharded_model() -> None:
    plan = infer_plan(tiny_llama(), loss_parallel=True)
    assert plan.options.loss_parallel
    head = next(r for r in plan.rules if r.match == "lm_head")
    assert (head.style, head.output, head.local_output) == ("colwise", None, False)
    _assert_step_matches(tiny_llama(), plan, 2, parallel_loss=True)


@pytest.mark.filterwarnings(
    "ignore::UserWarning"
)  # transformers: no attention mask given for a batch
@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "beam"])
def test_generate_returns_the_same_tokens(beams: int) -> None:
    ref = tiny_llama()
    prompt = token_batch()
    want = ref.generate(prompt, max_new_tokens=6, do_sample=False, num_beams=beams)
    with simulated_ranks(2) as mesh:
        model = apply_plan(copy.deepcopy(ref), mesh, LLAMA_PLAN)
        got = model.generate(prompt, max_new_tokens=6, do_sample=False, num_beams=beams)
        for v in rank_values(got):
            assert torch.equal(v, want)


def _per_rank(base: torch.Tensor, tp: int, odd_rank: int) -> LocalTensor:
    other = base.clone()
    other[0, 0] = (other[0, 0] + 1) % 128
    return LocalTensor({r: other if r == odd_rank else base for r in range(tp)})


@pytest.mark.parametrize("how", ["keyword", "environment"])
def test_inputs_that_differ_across_ranks_are_named(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = token_batch()
    if how == "environment":
        monkeypatch.setenv("TPPLAN_CHECK_INPUTS", "1")
    with simulated_ranks(4) as mesh:
        kw = {"check_inputs": True} if how == "keyword" else {}
        model = apply_plan(tiny_llama(), mesh, load_plan(LLAMA_PLAN), **kw)
        model(tokens)  # the same everywhere: passes
        with pytest.raises(
            InputMismatchError,
            match=r"input 'input_ids' differs across tp ranks: rank\(s\) 2 do not",
        ):
            model(input_ids=_per_rank(tokens, 4, odd_rank=2))


def test_the_input_check_is_off_by_default() -> None:
    tokens = token_batch()
    with simulated_ranks(2) as mesh:
        model = apply_plan(tiny_llama(), mesh, LLAMA_PLAN)
        model(_per_rank(tokens, 2, odd_rank=1))  # garbage in, no word: why the switch exists
