"""apply_plan on the fake process group (shapes, collectives) and in LocalTensorMode
(numbers: forward and backward parity with the unsharded model)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from support.infer_models import opt
from support.models import HeadNormBlock, tiny_llama, token_batch
from support.unrunnable import CASES, unrunnable
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import tpplan
from tpplan import MeshError, Plan, PlanProblemsError, apply_plan, load_plan
from tpplan._runtime.local import fake_ranks, rank_values, simulated_ranks
from tpplan.compile import plan_to_torch
from tpplan.errors import MetaWeightsError

LLAMA_PLAN = Path(__file__).parent / "plans" / "llama.yaml"
# fp32 logits of a 2-layer model: sharded matmuls sum in another order, which moves the last
# bits (observed ~2e-7); 1e-5 is the bar the issue sets and leaves room for that.
TOL = 1e-5


def _local_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)


def _wide_llama(device: str = "cpu"):  # type: ignore[no-untyped-def]
    """16 query and 8 KV heads, so tp 8 still splits whole heads."""
    return tiny_llama(hidden=128, heads=16, kv_heads=8, vocab=256, device=device)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_shard_shapes(tp: int) -> None:
    model = _wide_llama()
    with fake_ranks(tp) as mesh:
        apply_plan(model, mesh, LLAMA_PLAN)
        layer = model.model.layers[1]
        assert _local_shape(layer.self_attn.q_proj.weight) == (128 // tp, 128)
        assert _local_shape(layer.self_attn.k_proj.weight) == (64 // tp, 128)
        assert _local_shape(layer.self_attn.o_proj.weight) == (128, 128 // tp)
        assert _local_shape(layer.mlp.up_proj.weight) == (192 // tp, 128)
        assert _local_shape(layer.mlp.down_proj.weight) == (128, 192 // tp)
        assert _local_shape(model.model.embed_tokens.weight) == (256 // tp, 128)
        assert _local_shape(model.lm_head.weight) == (256 // tp, 128)
        assert not isinstance(layer.input_layernorm.weight, DTensor)  # left replicated


# CommDebugMode hooks every module for backward; HF models return output dataclasses, for
# which torch warns that those hooks cannot fire. We count forward collectives only.
@pytest.mark.filterwarnings("ignore:For backward hooks to be called:UserWarning")
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_one_all_reduce_per_block(tp: int) -> None:
    """Megatron's count: one all-reduce closing attention, one closing the MLP, one after the
    vocab-parallel lookup, and one all-gather of the logits."""
    model = _wide_llama()
    with fake_ranks(tp) as mesh:
        apply_plan(model, mesh, LLAMA_PLAN)
        with CommDebugMode() as comm, torch.no_grad():
            model(token_batch(256))
    counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    layers = len(model.model.layers)
    assert counts == {"all_reduce": 2 * layers + 1, "all_gather_into_tensor": 1}


def test_a_model_on_the_meta_device_is_sharded_then_materialized() -> None:
    model = _wide_llama(device="meta")
    with fake_ranks(4) as mesh:
        apply_plan(model, mesh, LLAMA_PLAN)
        q = model.model.layers[0].self_attn.q_proj.weight
        assert isinstance(q, DTensor) and q.device.type == "meta"
        assert _local_shape(q) == (32, 128)
        model.to_empty(device="cpu")
        q = model.model.layers[0].self_attn.q_proj.weight
        assert q.to_local().device.type == "cpu" and _local_shape(q) == (32, 128)


def test_a_forward_before_the_weights_of_a_meta_model_exist_names_the_fix() -> None:
    model = tiny_llama(device="meta")
    with fake_ranks(2) as mesh:
        apply_plan(model, mesh, LLAMA_PLAN)
        with pytest.raises(MetaWeightsError) as caught:
            model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert str(caught.value) == (
        "the model's weights are still on the meta device (23 of 23 tensors, e.g. "
        "model.embed_tokens.weight) and its forward got inputs on cpu: apply_plan sharded a "
        "model built on the meta device, whose weights do not exist yet. Fix: before the "
        "first forward, load them with tpplan.load_checkpoint(model, folder) "
        "(tpplan.from_pretrained(...) builds, shards and loads in one call), or make them "
        "with model.to_empty(device='cpu') and initialize them."
    )


def test_the_meta_weights_guard_leaves_at_the_first_forward_with_weights() -> None:
    """Nothing is left on the hot path once the weights exist."""
    model = tiny_llama(device="meta")
    with fake_ranks(2) as mesh:
        apply_plan(model, mesh, LLAMA_PLAN)
        assert len(model._forward_pre_hooks) == 1
        model.to_empty(device="cpu")
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert len(model._forward_pre_hooks) == 0


def test_a_model_with_its_weights_gets_no_meta_weights_guard() -> None:
    model = tiny_llama()
    with fake_ranks(2) as mesh:
        apply_plan(model, mesh, LLAMA_PLAN)
    assert len(model._forward_pre_hooks) == 0


def test_the_tp_axis_of_a_2d_mesh() -> None:
    model = tiny_llama()
    with fake_ranks(4):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(MeshError, match=r"this mesh has 2 \(axes: dp, tp\).*mesh\['tp'\]"):
            apply_plan(model, mesh, LLAMA_PLAN)
        apply_plan(model, mesh["tp"], LLAMA_PLAN)
        assert _local_shape(model.model.layers[0].self_attn.q_proj.weight) == (32, 64)


def test_problems_are_raised_before_torch_touches_the_model() -> None:
    model = tiny_llama()
    broken = Plan.from_yaml(
        LLAMA_PLAN.read_text().replace(
            "match: model.layers.*.mlp.up_proj", "match: model.layers.*.mlp.up"
        )
    )
    with fake_ranks(2) as mesh, pytest.raises(PlanProblemsError) as e:
        apply_plan(model, mesh, broken)
    msg = str(e.value)
    assert "nothing was changed" in msg and "rules[6] (match: model.layers.*.mlp.up)" in msg
    assert "Did you mean 'model.layers.*.mlp.up_proj'?" in msg
    assert not any(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize("case", list(CASES))
def test_a_plan_that_cannot_run_is_refused_before_torch_touches_the_model(case: str) -> None:
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = CASES[case]
    with fake_ranks(2) as mesh, pytest.raises(PlanProblemsError) as e:
        apply_plan(model, mesh, unrunnable(case))
    msg = str(e.value)
    assert "nothing was changed" in msg and want.rule in msg
    assert (want.static or want.ran) in msg and want.fix in msg
    params = dict(model.named_parameters())
    assert params.keys() == before.keys()
    for name, p in params.items():
        assert type(p) is torch.nn.Parameter and torch.equal(p, before[name]), name
    assert model.model.layers[0].self_attn.head_dim == 8


def test_a_plan_that_splits_nothing_warns_at_tp_above_1() -> None:
    whole = Plan.from_yaml("tpplan: 7\nrules:\n  - {match: lm_head, style: replicate, why: x}\n")
    with fake_ranks(2) as mesh, pytest.warns(UserWarning, match="the plan splits nothing"):
        apply_plan(tiny_llama(), mesh, whole)
    with fake_ranks(1) as mesh:
        apply_plan(tiny_llama(), mesh, whole)  # nothing to split at tp 1: no warning


def test_an_unknown_plan_path_is_named(tmp_path: Path) -> None:
    with (
        fake_ranks(2) as mesh,
        pytest.raises(tpplan.PlanFileError, match=r"nope\.yaml: cannot read the file"),
    ):
        apply_plan(tiny_llama(), mesh, tmp_path / "nope.yaml")


def test_what_is_not_a_model_is_named() -> None:
    with (
        fake_ranks(2) as mesh,
        pytest.raises(
            tpplan.ModelError,
            match=r"^apply_plan shards a torch nn\.Module, but the model given is None\. Fix: "
            r"pass the model itself",
        ),
    ):
        apply_plan(None, mesh, LLAMA_PLAN)  # type: ignore[arg-type]


def test_a_model_sharded_already_is_named_not_a_rule() -> None:
    model = tiny_llama()
    with fake_ranks(2) as mesh:
        apply_plan(model, mesh, LLAMA_PLAN)
        with pytest.raises(
            tpplan.ModelError,
            match=r"^this LlamaForCausalLM is already sharded \(its parameters "
            r"model\.embed_tokens\.weight, model\.layers\.0\.self_attn\.q_proj\.weight, \.\.\. "
            r"are DTensors\); a plan applies "
            r"once, to the unsharded model\. Fix: build a fresh model",
        ):
            apply_plan(model, mesh, LLAMA_PLAN)


def test_a_model_a_plan_that_split_nothing_was_applied_to_is_named() -> None:
    """Applying again would divide its attributes by tp a second time."""
    model = tiny_llama()
    plan = Plan.model_validate({"tpplan": 1, "rules": []})
    with fake_ranks(2) as mesh:
        with pytest.warns(UserWarning, match="the plan splits nothing"):
            apply_plan(model, mesh, plan)
        with pytest.raises(tpplan.ModelError, match=r"already sharded \(apply_plan ran on it\)"):
            apply_plan(model, mesh, plan)


def test_attributes_are_divided_per_rank() -> None:
    # OPT views by its stored head count (4 heads), which its plan divides
    model = opt()
    plan = tpplan.infer_plan(model, tp_size=2)
    with fake_ranks(2) as mesh:
        apply_plan(model, mesh, plan)
    assert model.model.decoder.layers[1].self_attn.num_heads == 2


def test_to_torch_expands_every_rule_to_full_names() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = tiny_llama(layers=3)
    styles = plan_to_torch(load_plan(LLAMA_PLAN), model)
    assert len(styles) == 3 * 7 + 2
    assert isinstance(styles["model.layers.2.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(styles["model.layers.0.mlp.down_proj"], RowwiseParallel)
    assert isinstance(styles["model.embed_tokens"], RowwiseParallel)
    assert next(iter(styles)) == "model.embed_tokens" and list(styles)[-1] == "lm_head"


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tp", [2, 4])
def test_parity_forward_and_backward(tp: int) -> None:
    ref = tiny_llama()
    x = token_batch()
    want = ref(x).logits
    want.square().mean().backward()
    want_grads = _grads(ref)
    with simulated_ranks(tp) as mesh:
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        apply_plan(model, mesh, LLAMA_PLAN)
        got = model(x).logits
        for v in rank_values(got):
            assert (v - want).abs().max().item() <= TOL
        got.square().mean().backward()
        got_grads = _grads(model)
        assert got_grads.keys() == want_grads.keys()
        for name, g in got_grads.items():
            for v in rank_values(g):
                assert (v - want_grads[name]).abs().max().item() <= TOL, name


REPLICATED_NORM = """\
tpplan: 1
rules:
  - {match: fc1, style: colwise, why: opens the region, head_dim: 8}
  - {match: fc2, style: rowwise, why: closes it, head_dim: 8}
"""


@pytest.mark.parametrize("grad_sum", [True, False])
def test_replicated_parameters_in_a_sharded_region_get_summed_gradients(grad_sum: bool) -> None:
    """Without replicate_grad_sum each rank's norm gradient covers its own heads only; the
    False case shows the test can tell."""
    text = REPLICATED_NORM
    if grad_sum:
        text += (
            "  - {match: norm, style: replicate_grad_sum, why: per-head weight on sharded heads}\n"
        )
    ref = HeadNormBlock()
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    ref(x).square().sum().backward()
    with simulated_ranks(2) as mesh:
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        apply_plan(model, mesh, Plan.from_yaml(text))
        out = model(x)
        assert all((v - ref(x)).abs().max() <= TOL for v in rank_values(out))
        out.square().sum().backward()
        errors = [
            (v - ref.norm.weight.grad).abs().max().item()
            for v in rank_values(model.norm.weight.grad)
        ]
    if grad_sum:
        assert max(errors) <= TOL
    else:
        assert max(errors) > 1e-2


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_styles_parity(tp: int) -> None:
    """vocab_parallel reduce-scatter, sequence_parallel norms, prepare on a positional input,
    rowwise reduce-scatter and a colwise layer that gathers a sequence-sharded input."""
    from support.models import SeqParallelNet

    torch.manual_seed(0)
    ref = SeqParallelNet()
    x = token_batch(32, seq=8)
    want = ref(x)
    want.square().mean().backward()
    with simulated_ranks(tp) as mesh:
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        apply_plan(model, mesh, Path(__file__).parent / "plans" / "seq_parallel.yaml")
        got = model(x)
        assert all((v - want).abs().max().item() <= TOL for v in rank_values(got))
        got.square().mean().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            for v in rank_values(p.grad):
                assert (v - q.grad).abs().max().item() <= TOL, name
