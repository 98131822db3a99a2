"""LoRA adapters (peft) under tensor parallelism: the inferred plan splits each adapter as its
base layer (tpplan/infer/adapters.py), the sharded PEFT model computes, trains, saves and
merges as the unsharded one, and the adapters add no collective (tpplan/compile/adapters.py).

Every rank is simulated in this process; tests/test_processes.py runs the same on gloo."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from support.lora import TARGETS, lora_llama, train_step
from support.models import tiny_llama, token_batch
from support.parity import assert_parity
from support.plans import expand_rules
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import tpplan
from tpplan._runtime.local import fake_ranks, own_replicas, rank_values, simulated_ranks

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# fp32 on a 2-layer model: a sharded run sums the same products in another order (~1e-7);
# a wrong split of an adapter (lora_B set to 0.1-sized values) is off by O(0.1)
TOL = 1e-5


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
            assert (rule.head_size(), rule.shares_heads()) == (
                base.head_size(),
                base.shares_heads(),
            )
    assert tpplan.check_plan(plan, model, tp_size=tp) == []


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_forward_and_backward_match_the_unsharded_peft_model(tp: int) -> None:
    """Logits and every gradient (the adapters'; the base is frozen by peft), on both paths.
    At tp 8 the 4 key/value heads are shared by 2 ranks each: their adapters run child by
    child (compile/adapters.py fuses only plain splits)."""
    model = lora_llama()
    assert_parity(model, tpplan.infer_plan(model, tp_size=tp), tp, token_batch(), tol=TOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_training_step_matches_the_unsharded_peft_model(tp: int) -> None:
    ref, tokens = lora_llama(), token_batch()
    start, plan = copy.deepcopy(ref), tpplan.infer_plan(ref, tp_size=tp)
    want = train_step(ref, tokens)
    with simulated_ranks(tp) as mesh:
        model = own_replicas(tpplan.apply_plan(copy.deepcopy(start), mesh, plan), tp)
        loss = train_step(model, tokens)
        _assert_close(loss, want, "loss")
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        assert trained and all(".lora_" in n for n, _ in trained)
        after = dict(ref.named_parameters())
        for name, p in trained:
            _assert_close(p, after[name], f"{name} after the step")


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
    train_step(ref, tokens)
    with simulated_ranks(tp) as mesh:
        model = own_replicas(tpplan.apply_plan(copy.deepcopy(start), mesh, plan), tp)
        train_step(model, tokens)
        full = tpplan.full_state_dict(model, trainable_only=True)
        model.save_pretrained(tmp_path, state_dict=full)
    # only the adapter was gathered, not the frozen base
    assert set(full) == {n for n, p in ref.named_parameters() if p.requires_grad}
    assert all(".lora_" in n for n in full)
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


def test_a_lora_variant_peft_computes_otherwise_is_traced_op_by_op() -> None:
    """DoRA rescales the base's output by a norm of the merged weight: not the computation
    tpplan knows, so the wrapper is followed op by op, its base kept whole with the reason,
    and the sharded model still computes the unsharded one's numbers."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = LoraConfig(r=8, lora_alpha=16, use_dora=True, target_modules=TARGETS)
        model = get_peft_model(tiny_llama(), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    plan = tpplan.infer_plan(model, tp_size=2)
    rules = expand_rules(plan, model)
    bases = [n for n in rules if n.endswith(".base_layer")]
    assert len(bases) == 2 * len(TARGETS)
    assert all(rules[n].style == "replicate" and "kept whole" in rules[n].why for n in bases)
    assert_parity(model, plan, 2, token_batch(), tol=TOL)


# torchrun, two gloo processes that import torch, transformers and peft: ~15 s on 2 cores
@pytest.mark.slow
def test_the_docs_lora_snippet_runs_as_written(tmp_path: Path) -> None:
    """docs/guides/lora.md's script, saved and run with the torchrun command it gives."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "lora.md").read_text()
    script = page.split("```python\n", 1)[1].split("```", 1)[0]
    assert "`torchrun --nproc-per-node 2 lora_tp.py`" in page
    (tmp_path / "lora_tp.py").write_text(script)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [*command, "lora_tp.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=400,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "loss " in run.stdout
    saved = load_file(tmp_path / "lora-adapter" / "adapter_model.safetensors")
    shapes = {k.split("layers.0.", 1)[1]: tuple(v.shape) for k, v in saved.items() if "s.0." in k}
    # the snippet's widths: hidden 64, MLP 128, 2 key/value heads of 16; r 8; unsplit
    assert shapes["self_attn.k_proj.lora_B.weight"] == (32, 8)
    assert shapes["mlp.up_proj.lora_B.weight"] == (128, 8)
    assert shapes["mlp.down_proj.lora_A.weight"] == (8, 128)
    assert len(shapes) == 2 * len(TARGETS)


def test_check_names_an_adapter_split_unlike_its_base_layer() -> None:
    """A hand edit keeping q_proj's lora_B and o_proj's lora_A whole beside their split bases:
    one problem each (over every layer), naming the adapter and the style it needs."""
    model = lora_llama()
    plan = tpplan.infer_plan(model, tp_size=2)
    edited = ("q_proj.lora_B.default", "o_proj.lora_A.default")
    rules = [
        tpplan.Rule(match=r.match, style="replicate", why=r.why) if r.match.endswith(edited) else r
        for r in plan.rules
    ]
    problems = tpplan.check_plan(plan.model_copy(update={"rules": rules}), model, tp_size=2)
    assert [(p.kind, p.module.rsplit(".", 3)[-3]) for p in problems if p.module] == [
        ("adapter", "q_proj"),
        ("adapter", "o_proj"),
    ], problems
    assert "lora_B is replicate beside a colwise base_layer" in problems[0].message
    assert problems[0].fix.startswith("make it colwise with the base's rule fields")
    assert problems[1].fix.startswith("make it rowwise")


def test_fp32_adapters_beside_a_bf16_base_run_as_peft_runs_them() -> None:
    """peft keeps adapters in fp32 beside a bf16 base (autocast_adapter_dtype): each is
    computed in its own dtype, the collectives they share carry the wider one, and the
    output is the base's dtype, as unsharded."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
        model = get_peft_model(tiny_llama().to(torch.bfloat16), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    dtypes = {p.dtype for n, p in model.named_parameters() if ".lora_" in n}
    assert dtypes == {torch.float32}
    # bf16 keeps 8 bits of mantissa: O(1) logits summed in another order move by a few
    # ulps (~1e-2); a wrong split of an adapter is off by O(0.1)
    assert_parity(model, tpplan.infer_plan(model, tp_size=2), 2, token_batch(), tol=3e-2)


def test_sequence_parallel_with_adapters_is_refused_with_the_fix() -> None:
    with pytest.raises(tpplan.TpplanError) as caught:
        tpplan.infer_plan(lora_llama(), tp_size=2, sequence_parallel=True)
    message = str(caught.value)
    assert message.startswith("sequence_parallel is not supported with LoRA adapters yet: 14 ")
    assert "Fix: infer without sequence_parallel" in message


def _two_adapters() -> PeftModel:
    """lora_llama plus a second active adapter of r 4 on q_proj and down_proj."""
    model = lora_llama()
    with torch.random.fork_rng():
        torch.manual_seed(3)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
        model.add_adapter("second", config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B.second" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(4))
    model.base_model.set_adapter(["default", "second"])
    return model


@pytest.mark.filterwarnings("ignore:For backward hooks to be called:UserWarning")
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
def test_two_active_adapters_split_alike_and_share_the_base_collective() -> None:
    model, tokens = _two_adapters(), token_batch()
    plan = tpplan.infer_plan(model, tp_size=2)
    rules = _adapter_rules(model, plan)
    second = {
        ".".join(n.split(".")[-3:-1]): r.style for n, r in rules.items() if n.endswith("second")
    }
    assert second == {
        "q_proj.lora_A": "replicate",
        "q_proj.lora_B": "colwise",
        "down_proj.lora_A": "rowwise",
        "down_proj.lora_B": "replicate",
    }
    assert_parity(model, plan, 2, tokens, tol=TOL)
    with fake_ranks(2) as mesh:
        lora = _comms(tpplan.apply_plan(model, mesh, plan), tokens)
    plain = tiny_llama()
    with fake_ranks(2) as mesh:
        assert lora == _comms(
            tpplan.apply_plan(plain, mesh, tpplan.infer_plan(plain, tp_size=2)), tokens
        )
