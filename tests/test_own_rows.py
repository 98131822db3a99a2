"""A fused q|k|v layer of unequal pieces (grouped-query attention in one Linear) on its local
shards: the parameter a plain Shard of the original, the forward on a working copy of the
rank's own rows, rebuilt when the parameter changes (compile/own_rows.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from support.infer_models import fused_gqa
from support.models import token_batch
from support.parity import assert_parity, forward_collectives
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import tpplan
from tpplan._runtime.local import own_replicas, rank_values, simulated_ranks
from tpplan.compile.local_run import group_name, local_run_reason, runs_locally
from tpplan.compile.own_rows import OwnRows, own_order
from tpplan.compile.strided import fused_order

# fp32, a few layers: a sharded run sums the same products in another order (~1e-7 off);
# a stale working copy is off by the learning rate times a gradient, O(1e-2)
TOL = 1e-5


def _plan(model: torch.nn.Module) -> tpplan.Plan:
    return tpplan.infer_plan(model, example_inputs={"ids": token_batch()})


def _attn_collectives(model: torch.nn.Module, x: torch.Tensor) -> dict[str, int]:
    with CommDebugMode() as comms, torch.no_grad():
        model(x)
    return forward_collectives(comms, "FusedGqa.attn")


@pytest.mark.parametrize("tp", [2, 4])
def test_unequal_pieces_run_on_local_shards_at_parity(tp: int) -> None:
    model = fused_gqa()
    plan = _plan(model)
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        assert runs_locally(sharded.attn.qkv)
        w = sharded.get_parameter("attn.qkv.weight")
        assert w.placements == (Shard(0),)  # the original, cut in rank order
        assert all(torch.equal(v, model.attn.qkv.weight) for v in rank_values(w.full_tensor()))
    assert_parity(model, plan, tp, token_batch())


@pytest.mark.parametrize("tp", [2, 4])
def test_the_working_rows_are_gathered_once_then_no_collective_but_megatrons(tp: int) -> None:
    """The first call gathers the weight and the bias once; every later call makes only the
    all-reduce after o_proj. The DTensor path gathers the fused output at every call."""
    model = fused_gqa()
    plan = _plan(model)
    x = token_batch()
    with simulated_ranks(tp) as mesh:
        local = copy.deepcopy(model)
        tpplan.apply_plan(local, mesh, plan)
        assert _attn_collectives(local, x) == {"all_gather_into_tensor": 2, "all_reduce": 1}
        assert _attn_collectives(local, x) == {"all_reduce": 1}
        dtensor = copy.deepcopy(model)
        tpplan.apply_plan(dtensor, mesh, plan, local_shards=False)
        for _ in range(2):
            assert _attn_collectives(dtensor, x)["all_gather_into_tensor"] == 1


def _sgd_steps(model: torch.nn.Module, x: torch.Tensor, steps: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("tp", [2, 4])
def test_optimizer_steps_refresh_the_working_rows(tp: int) -> None:
    """Three SGD steps: each step's loss (computed with the rows the last step changed) and
    the weights after the last equal the unsharded model's."""
    ref = fused_gqa().train()
    x = token_batch()
    plan = _plan(ref)
    model = copy.deepcopy(ref)
    want = _sgd_steps(ref, x, 3)
    with simulated_ranks(tp) as mesh:
        tpplan.apply_plan(model, mesh, plan)
        own_replicas(model, tp)
        got = _sgd_steps(model, x, 3)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            for v in rank_values(g):
                assert (v - w).abs().item() <= TOL, f"step {step}'s loss"
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            for v in rank_values(whole.detach()):
                assert (v - q.detach()).abs().max().item() <= TOL, name


def test_a_write_into_the_local_shard_refreshes_the_working_rows() -> None:
    """A loader that copies into the parameter's local tensor (not through the parameter)
    bumps only the local tensor's version: the rows are rebuilt all the same."""
    model = fused_gqa()
    x = token_batch()
    other = fused_gqa(seed=1)
    want = copy.deepcopy(model)
    want.attn.qkv.load_state_dict(other.attn.qkv.state_dict())
    plan = _plan(model)
    with simulated_ranks(2) as mesh:
        tpplan.apply_plan(model, mesh, plan)
        with torch.no_grad():
            model(x)  # the rows are built
            for name in ("weight", "bias"):
                p = model.attn.qkv.get_parameter(name)
                new = getattr(other.attn.qkv, name)
                p._local_tensor.copy_(distribute_tensor(new, mesh, [Shard(0)]).to_local())
            got = model(x)
        for v in rank_values(got):
            assert (v - want(x)).abs().max().item() <= TOL


@pytest.mark.unit
def test_pieces_that_do_not_split_tp_ways_stay_on_dtensors() -> None:
    layer = torch.nn.Linear(8, 12)
    got = local_run_reason(
        layer,
        "colwise",
        transposed=False,
        parts=(6, 3, 3),
        input_layout=None,
        output_layout=None,
        local_output=True,
        tp=2,
    )
    assert got == "its fused pieces [6, 3, 3] do not all split 2 ways"


@pytest.mark.unit
@pytest.mark.parametrize(("parts", "tp"), [((64, 32, 32), 2), ((64, 32, 32), 4), ((8, 8), 2)])
def test_own_order_is_each_ranks_slice_of_each_piece(parts: tuple[int, ...], tp: int) -> None:
    order = own_order(parts, tp)
    assert [i for rows in order for i in rows] == fused_order(parts, tp)


@pytest.mark.unit
def test_own_order_gives_pieces_of_fewer_heads_than_ranks_one_whole_head() -> None:
    """Multi-query attention at tp 4 (4 query heads of 2, one key/value head): each rank its
    query head and the one k and v head; grouped-query (2 key/value heads) the head its
    query heads read."""
    assert own_order((8, 2, 2), 4, unit=2) == [[0, 1, 8, 9, 10, 11], [2, 3, 8, 9, 10, 11],
                                               [4, 5, 8, 9, 10, 11], [6, 7, 8, 9, 10, 11]]  # fmt: skip
    assert own_order((8, 4, 4), 4, unit=2)[2] == [4, 5, 10, 11, 14, 15]
    with pytest.raises(ValueError, match="splits neither 4 ways nor by heads"):
        own_order((8, 6, 6), 4, unit=2)  # 3 key/value heads over 4 ranks


@pytest.mark.parametrize(("parts", "tp"), [((32, 8, 8), 4), ((32, 16, 16), 4), ((32, 16, 16), 2)])
def test_shared_head_rows_forward_and_gradient(parts: tuple[int, ...], tp: int) -> None:
    """A fused q|k|v Linear whose k and v may have fewer heads (of 8) than ranks: each
    rank's output is its own rows' (a shared head whole), and the Shard parameter's
    gradient is the sum of every rank's, a shared head's gradient summed over its ranks."""
    ref = torch.nn.Linear(16, sum(parts))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    order = own_order(parts, tp, unit=8)
    want_grad = torch.zeros_like(ref.weight)
    for rows in order:  # each rank's loss: its own outputs squared, summed
        out = x @ ref.weight[rows].T
        want_grad.index_add_(0, torch.tensor(rows), 2 * out.T @ x)
    with simulated_ranks(tp) as mesh:
        w = torch.nn.Parameter(distribute_tensor(ref.weight.detach(), mesh, [Shard(0)]))
        own = OwnRows(parts, mesh, group_name(mesh), unit=8)
        out = x @ own.rows("weight", w, 0).T
        for r, v in enumerate(rank_values(out)):
            assert (v - x @ ref.weight[order[r]].T).abs().max().item() <= TOL
        out.square().sum().backward()
        for v in rank_values(w.grad.full_tensor()):
            assert (v - want_grad).abs().max().item() <= TOL
