"""The run-time fast path (tpplan/compile/local_run.py): split layers computed on their local
shards with direct collectives, against the DTensor path and the unsharded model.

Parity of every model the other test files check runs on both paths through
blocks.assert_parity; here: which layers take which path and why, what each path
communicates, the parameters both leave, and the lookups and gathers the fast path does
itself (uneven vocab shards, padding rows, gradients through the gather)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.models import tiny_llama, token_batch
from support.parity import assert_parity
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import tpplan
from tpplan import Plan, Rule
from tpplan._runtime.local import fake_ranks, rank_values, simulated_ranks
from tpplan.compile.local_run import runs_locally
from tpplan.diagnose.stats import plan_stats

TOL = 1e-5


def _plan(*rules: tuple[str, str, dict[str, Any]]) -> Plan:
    return Plan(rules=[Rule(match=m, style=s, why="test", **kw) for m, s, kw in rules])  # type: ignore[arg-type]


def _comms(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    with CommDebugMode() as comms:
        out = model(x).logits
        out.float().pow(2).mean().backward()
    return {str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()}


@pytest.mark.filterwarnings("ignore:For backward hooks to be called:UserWarning")
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("tp", [1, 2])
def test_a_llama_runs_every_split_layer_on_its_shards_and_communicates_as_the_dtensor_path(
    tp: int,
) -> None:
    ref, x = tiny_llama(), token_batch()
    counts = {}
    for local in (True, False):
        with fake_ranks(tp) as mesh:
            model = copy.deepcopy(ref)
            tpplan.apply_plan(model, mesh, local_shards=local)
            split = [
                n
                for n, m in model.named_modules()
                if isinstance(getattr(m, "weight", None), DTensor)
            ]
            fast = [n for n, m in model.named_modules() if runs_locally(m)]
            assert fast == (split if local else []), (local, split, fast)
            counts[local] = _comms(model, x)
    assert counts[True] == counts[False]
    if tp == 1:
        assert counts[True] == {}  # nothing to send at tp 1


def test_both_paths_leave_the_same_dtensor_parameters_and_state_dict() -> None:
    ref = tiny_llama()
    got = {}
    with fake_ranks(2) as mesh:
        for local in (True, False):
            model = copy.deepcopy(ref)
            tpplan.apply_plan(model, mesh, local_shards=local)
            got[local] = {
                k: (type(v).__name__, tuple(v.shape), getattr(v, "placements", None))
                for k, v in model.state_dict().items()
            }
    assert got[True] == got[False]
    assert all(t == "DTensor" for k, (t, *_) in got[True].items() if "proj" in k)


class _Looked(nn.Module):
    """An embedding with a padding row, then a head gathered whole: the two layers the fast
    path computes itself rather than through a Linear's matmul."""

    def __init__(self, vocab: int, dim: int = 8, out: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=3)
        self.head = nn.Linear(dim, out)
        with torch.no_grad():
            self.embed.weight[3].fill_(0.5)  # a padding row that is not zero

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


_LOOKED = _plan(
    ("embed", "vocab_parallel", {}),
    ("head", "colwise", {"output": "replicate"}),
)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_vocab_parallel_lookup_and_a_gathered_head_match_the_unsharded_model(tp: int) -> None:
    # ids at each shard's edges (4 rows a rank at tp 4), and the padding id, whose row is
    # looked up but gets no gradient
    ids = torch.tensor([[0, 3, 4, 7, 8, 15], [3, 11, 12, 1, 6, 3]])
    assert_parity(_Looked(16), _LOOKED, tp, ids, tol=TOL)


def test_the_padding_row_gets_no_gradient_on_the_local_path() -> None:
    ids = torch.tensor([[3, 3, 5, 0]])
    with simulated_ranks(2) as mesh:
        model = _Looked(16)
        tpplan.apply_plan(model, mesh, _LOOKED)
        assert runs_locally(model.embed)
        model(ids).sum().backward()
        grad = rank_values(model.embed.weight.grad.full_tensor())[0]
    assert torch.count_nonzero(grad[3]) == 0
    assert torch.count_nonzero(grad[5]) > 0


class _ByFeatures(nn.Module):
    """An embedding split on its features (colwise: each rank its columns, as T5's relative
    position bias is split by heads; gathered here, T5's split output is the shipped t5
    plan's parity test), a padding row among its ids."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Embedding(10, 8, padding_idx=2)
        self.out = nn.Linear(8, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bias(ids)))


@pytest.mark.parametrize("tp", [2, 4])
def test_an_embedding_split_on_its_features_looks_up_its_columns_locally(tp: int) -> None:
    plan = _plan(("bias", "colwise", {"output": "replicate"}))
    with fake_ranks(tp) as mesh:
        model = _ByFeatures()
        tpplan.apply_plan(model, mesh, plan)
        assert runs_locally(model.bias) and model.bias.weight.placements[0].dim == 1
    ids = torch.tensor([[0, 2, 9, 4], [2, 7, 1, 5]])
    assert_parity(_ByFeatures(), plan, tp, ids, tol=TOL)


class _OwnForward(nn.Linear):
    """A Linear whose forward is its own and reads its weight's values: the fast path does
    not know its computation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * 2, self.bias)


# --- forwards extending a known one (known_forwards.py), in the code styles models use ------


class _Scaled(nn.Embedding):
    """Gemma's and BART's scaled word embedding: super().forward, then a scale in the
    weight's dtype."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__(vocab, dim, padding_idx=1)
        self.register_buffer("scale", torch.tensor(dim**0.5), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale.to(self.weight.dtype)


class _ScaledOld(nn.Embedding):
    """The same in the two-argument super() of older code, the scale a plain number."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super(_ScaledOld, self).forward(ids)  # noqa: UP008 (the style under test)
        return out * (self.embedding_dim**0.5)


class _Clamped(nn.Linear):
    """A Linear whose output is clamped, reading its weight's device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.device)).clamp(-0.5, 0.5)


class _Extended(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed
        self.up = _Clamped(8, 16)
        self.down = _Clamped(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.embed(ids))))


_EXTENDED = _plan(("embed", "vocab_parallel", {}), ("up", "colwise", {}), ("down", "rowwise", {}))


@pytest.mark.parametrize("embed", [_Scaled, _ScaledOld])
@pytest.mark.parametrize("tp", [2, 4])
def test_forwards_extending_a_known_one_run_locally_with_parity(embed: type, tp: int) -> None:
    with fake_ranks(tp) as mesh:
        model = _Extended(embed(16, 8))
        tpplan.apply_plan(model, mesh, _EXTENDED)
        assert all(runs_locally(m) for m in (model.embed, model.up, model.down))
        assert isinstance(model.embed, embed) and type(model.embed).__name__ == embed.__name__
    ids = torch.tensor([[0, 1, 5, 15], [8, 7, 1, 3]])
    assert_parity(_Extended(embed(16, 8)), _EXTENDED, tp, ids, tol=TOL)


@pytest.mark.unit
def test_a_forward_reading_its_weights_values_is_not_an_extending_one() -> None:
    got = plan_stats(_Mixed(), _MIXED, tp_size=2).execution
    assert got["up"].startswith("DTensor: its forward (_OwnForward.forward) is not one")


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = _OwnForward(8, 16)
        self.fused = nn.Linear(8, 12)  # pieces 4 | 8, gathered whole
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fused(x).split([4, 8], -1)
        return self.down(self.up(x)) + a.sum(-1, keepdim=True) + b.sum(-1, keepdim=True)


_MIXED = _plan(
    ("up", "colwise", {}),
    ("down", "rowwise", {}),
    ("fused", "colwise", {"parts": [4, 8], "output": "replicate"}),
)


@pytest.mark.unit
def test_stats_name_the_layers_left_on_dtensors_and_why() -> None:
    got = plan_stats(_Mixed(), _MIXED, tp_size=4).execution
    assert got["down"] == "local shards"
    assert got["up"].startswith("DTensor: its forward (_OwnForward.forward) is not one")
    assert got["fused"] == "DTensor: its fused output is gathered whole"


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_left_on_dtensors_beside_local_ones_keep_parity(tp: int) -> None:
    assert_parity(_Mixed(), _MIXED, tp, torch.randn(3, 8), tol=TOL)


class _FalconLinear(nn.Linear):
    """Falcon's Linear: the matmul and the bias added apart, in a forward of its own that
    computes exactly a Linear (compile/linear_probe.py proves it by the ops it runs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class _OwnLayers(nn.Module):
    def __init__(self, layer: type[nn.Linear] = _OwnForward) -> None:
        super().__init__()
        self.up = layer(8, 16)
        self.down = layer(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


_OWN = _plan(("up", "colwise", {}), ("down", "rowwise", {}))


@pytest.mark.parametrize("tp", [1, 2])
def test_at_tp_1_a_forward_tpplan_does_not_know_runs_as_it_is_on_local_tensors(tp: int) -> None:
    # at tp 1 the local tensors are the whole ones: any forward computes what it computes
    # unsharded; at tp 2 the same layers stay on DTensors
    with fake_ranks(tp) as mesh:
        model = _OwnLayers()
        tpplan.apply_plan(model, mesh, _OWN)
        assert runs_locally(model.up) == runs_locally(model.down) == (tp == 1)
        assert isinstance(model.up.weight, DTensor)  # the parameters stay DTensors
    assert_parity(_OwnLayers(), _OWN, tp, torch.randn(3, 8), tol=TOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_forward_of_its_own_proved_to_compute_a_linear_runs_on_local_shards(tp: int) -> None:
    # `x @ self.weight.T + self.bias` is F.linear written out: the local forward replaces it
    with fake_ranks(tp) as mesh:
        model = _OwnLayers(_FalconLinear)
        tpplan.apply_plan(model, mesh, _OWN)
        assert runs_locally(model.up) and runs_locally(model.down)
    assert_parity(_OwnLayers(_FalconLinear), _OWN, tp, torch.randn(3, 8), tol=TOL)


def test_a_rowwise_layer_handed_a_dtensor_takes_the_dtensor_path_for_that_call() -> None:
    plan = _plan(("up", "colwise", {"local_output": False}), ("down", "rowwise", {}))
    model = nn.Sequential()
    model.add_module("up", nn.Linear(8, 16))
    model.add_module("down", nn.Linear(16, 8))
    assert_parity(model, plan, 2, torch.randn(3, 8), tol=TOL)
    stats = plan_stats(model, plan, tp_size=2).execution
    assert stats == {
        "up": "DTensor: its output stays a DTensor (a DTensor region)",
        "down": "DTensor: its input is a DTensor (inside a DTensor region)",
    }


@pytest.mark.unit
def test_compile_drops_the_layout_guards_of_local_layers_only() -> None:
    from types import SimpleNamespace

    from tpplan.apply.compiled import layout_guard_filter

    plan = _plan(("up", "colwise", {"local_output": False}), ("down", "rowwise", {}))
    model = nn.Sequential()
    model.add_module("up", nn.Linear(8, 16))
    model.add_module("down", _OwnForward(16, 8))
    model.add_module("last", nn.Sequential(nn.Linear(8, 8)))
    plan.rules.append(Rule(match="last.0", style="colwise", output="replicate", why="test"))
    with fake_ranks(2) as mesh:
        tpplan.apply_plan(model, mesh, plan)
        keep = layout_guard_filter(model)
    root = "L['self']"
    names = [
        f"{root}._modules['last']._modules['0']._parameters['weight']._spec",  # local: dropped
        f"{root}._modules['last']._modules['0']._parameters['weight'].device_mesh",  # dropped
        f"{root}._modules['last']._modules['0']._parameters['weight']._local_tensor",
        f"{root}._modules['up']._parameters['weight']._spec",  # a DTensor region: kept
        f"{root}._modules['down']._parameters['weight']._spec",  # its own forward: kept
    ]
    got = keep([SimpleNamespace(name=n) for n in names])
    assert got == [False, False, True, True, True]
