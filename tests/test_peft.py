"""LoRA adapters (peft) under tensor parallelism: the inferred plan splits each adapter as its
base layer (tpplan/infer/adapters.py), the sharded PEFT model computes, trains, saves and
merges as the unsharded one, and the adapters add no collective (tpplan/compile/adapters.py).

Every rank is simulated in this process; tests/test_processes.py runs the same on gloo."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from blocks import assert_parity, expand_rules
from models import tiny_llama, token_batch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import tpplan
from tpplan._runtime.local import fake_ranks, own_replicas, rank_values, simulated_ranks

pytestmark = pytest.mark.unit

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# fp32 on a 2-layer model: a sharded run sums the same products in another order (~1e-7);
# a wrong split of an adapter (lora_B set to 0.1-sized values) is off by O(0.1)
TOL = 1e-5


def lora_llama(*, r: int = 8, seed: int = 0) -> PeftModel:
    """tests/models.py's tiny Llama with LoRA on every attention and MLP projection. lora_B
    is drawn nonzero: peft starts it at zero, which would hide a wrong split of it."""
    with torch.random.fork_rng():  # peft draws lora_A from the global generator
        torch.manual_seed(seed)
        config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=TARGETS)
        model = get_peft_model(tiny_llama(), config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _adapter_rules(model: nn.Module, plan: tpplan.Plan) -> dict[str, tpplan.Rule]:
    rules = expand_rules(plan, model)
    return {n: rules[n] for n, _ in model.named_modules() if ".lora_" in n and n in rules}


@pytest.mark.parametrize("tp", [2, 4])
def test_the_inferred_plan_splits_each_adapter_as_its_base_layer(tp: int) -> None:
    model = lora_llama()
    plan = tpplan.infer_plan(model, tp_size=tp)  # inputs: those of the model PEFT wraps
    rules = expand_rules(plan, model)
    adapters = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".lora_" in n]
    assert len(adapters) == 2 * len(TARGETS) * 2  # lora_A and lora_B, 7 targets, 2 layers
    for name in adapters:
        wrapper, _, rest = name.rpartition(".lora_")
        base = rules[f"{wrapper}.base_layer"]
        colwise = wrapper.rsplit(".", 1)[-1] in COLWISE
        assert base.style == ("colwise" if colwise else "rowwise"), (wrapper, base.why)
        split = rest.startswith("B") if colwise else rest.startswith("A")
        rule = rules[name]
        assert rule.why.startswith("LoRA adapter (r=8)"), rule.why
        assert rule.style == (base.style if split else "replicate"), (name, rule.style)
        if split:
            assert (rule.head_dim, rule.replicate_heads) == (base.head_dim, base.replicate_heads)
    assert tpplan.check_plan(plan, model, tp_size=tp) == []


@pytest.mark.parametrize("tp", [2, 4])
def test_forward_and_backward_match_the_unsharded_peft_model(tp: int) -> None:
    """Logits and every gradient (the adapters'; the base is frozen by peft), on both paths."""
    model = lora_llama()
    assert_parity(model, tpplan.infer_plan(model, tp_size=tp), tp, token_batch(), tol=TOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_training_step_matches_the_unsharded_peft_model(tp: int) -> None:
    ref, tokens = lora_llama(), token_batch()
    start, plan = copy.deepcopy(ref), tpplan.infer_plan(ref, tp_size=tp)
    want = _train_step(ref, tokens)
    with simulated_ranks(tp) as mesh:
        model = own_replicas(tpplan.apply_plan(copy.deepcopy(start), mesh, plan), tp)
        loss = _train_step(model, tokens)
        _assert_close(loss, want, "loss")
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        assert trained and all(".lora_" in n for n, _ in trained)
        after = dict(ref.named_parameters())
        for name, p in trained:
            _assert_close(p, after[name], f"{name} after the step")


def _train_step(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    # SGD: a step linear in the gradient (Adam's first step would magnify ulp-level noise)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    logits = model(tokens).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    return loss


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    for rank, value in enumerate(rank_values(got.detach())):
        err = (value - want.detach()).abs().max().item()
        assert err <= TOL, f"{what} on rank {rank} differs by {err:.2e}"


def _comms(model: nn.Module, tokens: torch.Tensor) -> dict[str, int]:
    model.train()
    with CommDebugMode() as comms:
        model(tokens).logits.float().pow(2).mean().backward()
    return {str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()}


# CommDebugMode's module hooks warn on outputs that are not tensors (a model output class)
@pytest.mark.filterwarnings("ignore:For backward hooks to be called:UserWarning")
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("tp", [2, 4])
def test_the_adapters_add_no_collective(tp: int) -> None:
    """The PEFT model communicates as often as the plain model with its own inferred plan,
    forward and backward: each adapter rides on its base's one collective."""
    plain, tokens = tiny_llama(), token_batch()
    counts = {}
    for key, model in (("plain", plain), ("lora", lora_llama())):
        plan = tpplan.infer_plan(model, tp_size=tp)
        with fake_ranks(tp) as mesh:
            counts[key] = _comms(tpplan.apply_plan(model, mesh, plan), tokens)
    assert counts["lora"] == counts["plain"]
    assert counts["lora"]  # the plan does split: something is communicated


@pytest.mark.parametrize("tp", [2, 4])
def test_save_pretrained_of_the_full_state_dict_writes_the_unsplit_adapter(
    tp: int, tmp_path: Path
) -> None:
    """After a training step, the adapter file holds the unsharded model's trained adapter:
    loaded into a fresh unsharded PEFT model it gives the same weights and logits."""
    ref, tokens = lora_llama(), token_batch()
    start, plan = copy.deepcopy(ref), tpplan.infer_plan(ref, tp_size=tp)
    _train_step(ref, tokens)
    with simulated_ranks(tp) as mesh:
        model = own_replicas(tpplan.apply_plan(copy.deepcopy(start), mesh, plan), tp)
        _train_step(model, tokens)
        full = tpplan.full_state_dict(model)
        model.save_pretrained(tmp_path, state_dict=full)
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path).eval()
    got, first = loaded.state_dict(), start.state_dict()
    trained = {k: v for k, v in ref.state_dict().items() if ".lora_" in k}
    assert len(trained) == 2 * len(TARGETS) * 2
    for name, value in trained.items():
        assert torch.equal(got[name], full[name]), f"{name} was not saved as it is"
        assert torch.allclose(got[name], value, atol=TOL), name
        assert not torch.allclose(got[name], first[name], atol=TOL), f"{name} is untrained"
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, ref(tokens).logits, atol=TOL)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("how", ["merge_and_unload", "merge_adapter"])
def test_merging_the_sharded_adapters_gives_the_merged_unsharded_model(tp: int, how: str) -> None:
    """peft's merge (base.weight += lora_B.weight @ lora_A.weight * scaling) runs shard by
    shard on the DTensor weights; the merged model's weights and logits are the unsharded
    merged model's."""
    ref, tokens = lora_llama(), token_batch()
    start, plan = copy.deepcopy(ref), tpplan.infer_plan(ref, tp_size=tp)
    merged_ref = _merged(ref, how)
    with torch.no_grad():
        want = merged_ref(tokens).logits
    with simulated_ranks(tp) as mesh:
        merged = _merged(tpplan.apply_plan(copy.deepcopy(start), mesh, plan), how)
        with torch.no_grad():
            _assert_close(merged(tokens).logits, want, "merged logits")
        weights = tpplan.full_state_dict(merged)
    for name, value in merged_ref.state_dict().items():
        assert torch.allclose(weights[name], value, atol=TOL), name


def _merged(model: PeftModel, how: str) -> Any:
    if how == "merge_and_unload":
        return model.merge_and_unload()
    model.merge_adapter()
    return model


def test_sharded_weights_keep_the_unsharded_layout() -> None:
    """Split adapters are DTensors whose full tensor is the original; the whole ones too
    (Replicate), so that peft's merge and torch's state dicts see one kind of tensor."""
    ref = lora_llama()
    with simulated_ranks(2) as mesh:
        model = tpplan.apply_plan(copy.deepcopy(ref), mesh, tpplan.infer_plan(ref, tp_size=2))
        full = tpplan.full_state_dict(model)
        kinds = {n: type(p) for n, p in model.named_parameters() if ".lora_" in n}
    assert set(kinds.values()) == {DTensor}
    for name, value in ref.state_dict().items():
        assert torch.equal(full[name], value), name
