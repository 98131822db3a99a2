"""A vocab the tp size does not divide (GPT-2's 50257) splits unevenly (`uneven: true`):
the ranks hold DTensor's shares of the rows (ceil(V/tp) each, the last ones what is left),
the lookup is summed and the head gathered as for an even vocab, and the full tensors are
the original ones. Before, the embedding and the head (30% of GPT-2 small) stayed whole on
every rank. Checked here: the plan, check's message without `uneven`, parity forward and
backward on both paths at tp 2, 3 and 4 (tied and untied), each rank's share, every
`generate` mode's tokens, and a whole checkpoint saved at one tp size loaded at another."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from support.parity import assert_parity

import tpplan
from tpplan import Plan, check_plan
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan.checkpoint import full_state_dict, load_checkpoint, save_checkpoint

VOCAB = 257  # prime: no tp size above 1 divides it


def _gpt2(vocab: int = VOCAB) -> transformers.PreTrainedModel:
    """Tied: lm_head's weight is wte's."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).eval()


def _llama(vocab: int = VOCAB) -> transformers.PreTrainedModel:
    """Untied: embed_tokens and lm_head hold their own weights."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


MODELS = {"gpt2": (_gpt2, "transformer.wte"), "llama": (_llama, "model.embed_tokens")}


def _ids(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(1))


def _rules(plan: Plan) -> dict[str, tpplan.Rule]:
    return {r.match: r for r in plan.rules}


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_an_uneven_vocab_splits_and_matches_the_unsharded_model(name: str, tp: int) -> None:
    make, table = MODELS[name]
    model, ids = make(), _ids()
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=ids)
    rules = _rules(plan)
    assert rules[table].style == "vocab_parallel" and rules[table].uneven
    head = rules["lm_head"]
    assert (head.style, head.output, head.uneven) == ("colwise", "replicate", True)
    step = -(-VOCAB // tp)
    shares = " or ".join(map(str, sorted({step, VOCAB - (tp - 1) * step}, reverse=True)))
    assert f"ranks hold {shares} entries each (uneven)" in rules[table].why
    assert plan.tpplan >= 14  # uneven came in schema 14
    assert check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, ids)


@pytest.mark.unit
def test_each_rank_holds_dtensors_share_and_the_full_tensor_is_the_original() -> None:
    model, ids = _gpt2(), _ids()
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=ids)
    with simulated_ranks(2) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        wte = sharded.transformer.wte.weight
        assert [t.shape[0] for t in rank_values(wte.to_local())] == [129, 128]
        assert sharded.lm_head.weight is wte  # still tied
        whole = full_state_dict(sharded)
    for key, t in model.state_dict().items():
        assert torch.equal(whole[key], t), key


@pytest.mark.unit
def test_check_names_uneven_as_a_fix_for_a_vocab_tp_does_not_divide() -> None:
    model, ids = _llama(), _ids()
    data = tpplan.infer_plan(model, tp_size=2, example_inputs=ids).model_dump(exclude_none=True)
    for rule in data["rules"]:
        rule.pop("uneven", None)
    said = [str(p) for p in check_plan(Plan.model_validate(data), model, tp_size=2)]
    assert said == [
        "rules[0] (match: model.embed_tokens), module model.embed_tokens: num_embeddings (the "
        "vocab) = 257 does not divide by tp size 2. Fix: use a tp size among 1, or keep this "
        "module replicated, or set uneven: true (each rank then holds DTensor's share, the "
        "last ones less).",
        f"rules[{len(data['rules']) - 1}] (match: lm_head), module lm_head: out_features = 257 "
        "does not divide by tp size 2. Fix: use a tp size among 1, or keep this module "
        "replicated, or set uneven: true (each rank then holds DTensor's share, the last "
        "ones less).",
    ]


@pytest.mark.unit
def test_uneven_colwise_needs_its_output_gathered() -> None:
    with pytest.raises(ValueError, match="colwise with uneven splits features tp need not divide"):
        tpplan.Rule(match="lm_head", style="colwise", uneven=True, why="a test")


@pytest.mark.unit
def test_a_parallel_loss_keeps_an_uneven_head_whole() -> None:
    """loss_parallel leaves the head's output split for the loss, which takes no uneven
    split: the head stays whole, saying why; the lookup still splits."""
    model, ids = _llama(), _ids()
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=ids, loss_parallel=True)
    rules = _rules(plan)
    assert rules["model.embed_tokens"].uneven
    assert rules["lm_head"].style == "replicate"
    assert "257" in rules["lm_head"].why


@pytest.mark.parametrize("mode", ["greedy", "sample", "beam"])
def test_generate_at_an_uneven_vocab_gives_the_unsharded_tokens(mode: str) -> None:
    model, ids = _gpt2(), _ids()[:1, :4]
    kwargs = {
        "greedy": {"do_sample": False},
        "sample": {"do_sample": True, "top_k": 5},
        "beam": {"do_sample": False, "num_beams": 3},
    }[mode]
    torch.manual_seed(3)
    want = model.generate(ids, max_new_tokens=6, **kwargs)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=ids)
    with simulated_ranks(2) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        torch.manual_seed(3)
        got = sharded.generate(ids, max_new_tokens=6, **kwargs)
    for tokens in rank_values(got):
        assert torch.equal(tokens, want), (tokens, want)


@pytest.mark.parametrize(("saved_at", "loaded_at"), [(2, 4), (3, 2), (2, 1)])
def test_a_whole_checkpoint_saved_at_one_tp_loads_at_another(
    tmp_path: Path, saved_at: int, loaded_at: int
) -> None:
    model, ids = _llama(), _ids()
    folder = tmp_path / "ckpt"
    with simulated_ranks(saved_at) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(
            sharded, mesh, tpplan.infer_plan(model, tp_size=saved_at, example_inputs=ids)
        )
        save_checkpoint(sharded, folder, sharded=False)
    want = model(ids).logits
    fresh = _llama()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    if loaded_at == 1:
        load_checkpoint(fresh, folder)
        torch.testing.assert_close(fresh(ids).logits, want, atol=1e-5, rtol=1e-5)
        return
    plan = tpplan.infer_plan(fresh, tp_size=loaded_at, example_inputs=ids)
    with simulated_ranks(loaded_at) as mesh:
        tpplan.apply_plan(fresh, mesh, plan)
        load_checkpoint(fresh, folder)
        got = fresh(ids).logits
    for v in rank_values(got):
        torch.testing.assert_close(v, want, atol=1e-5, rtol=1e-5)
