"""Each of tpplan's ParallelStyles on its own (tpplan/compile/), on small hand-written
modules: the parameters' placements and local shapes after `parallelize_module` with the
style, the output's layout, numbers against the unsharded module on simulated ranks, the
refusals, and `repr`; then `rule_to_style` for every style of the schema and `plan_to_torch`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from tpplan import Plan, Rule
from tpplan._runtime.local import fake_ranks, rank_values, simulated_ranks
from tpplan.compile import plan_to_torch, rule_to_style
from tpplan.compile.attention import HeadParallelAttention
from tpplan.compile.embeddings import SumAtLookup, WrittenRows
from tpplan.compile.experts import EXPERTS_MARK, Experts
from tpplan.compile.linear import Colwise, Rowwise
from tpplan.compile.params import ReplicateGradSum, SplitParams, split_param
from tpplan.compile.rules import placement
from tpplan.errors import TpplanError
from tpplan.plan import STYLES

pytestmark = pytest.mark.unit

# fp32 on a few dozen features: a sharded matmul or an all-reduce sums in another order,
# which moves the last bits (~1e-7 here); 1e-5 leaves room for that and catches any real
# error, which is of the order of the values (~1).
TOL = 1e-5


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    """The same values on every rank: drawn from a generator of our own, before the ranks."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ids(vocab: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _local(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every simulated rank's value of `got` equals `want`."""
    values = rank_values(got)
    assert values
    for v in values:
        assert v.shape == want.shape
        assert (v - want).abs().max() <= TOL


def _grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    assert g is not None
    return g


def _linear(i: int, o: int, *, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(i, o, bias=bias)


class Conv1D(nn.Module):
    """GPT-2's Conv1D: a Linear whose weight is stored (in_features, out_features)."""

    def __init__(self, i: int, o: int, *, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(i, o) * 0.2)
        self.bias = nn.Parameter(torch.randn(o) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)  # (N, out)
        return out.view(*x.shape[:-1], -1)  # (..., out)


def _apply(module: nn.Module, mesh: Any, style: Any) -> nn.Module:
    return parallelize_module(module, mesh, style)


def _rank_slices(t: torch.Tensor, tp: int, parts: list[int] | None = None) -> list[torch.Tensor]:
    """Each rank's share of `t`'s last dim: a contiguous slice, or with `parts` its slice of
    each part laid end to end."""
    pieces = list(t.split(parts, dim=-1)) if parts else [t]
    return [torch.cat([p.chunk(tp, dim=-1)[r] for p in pieces], dim=-1) for r in range(tp)]


def _assert_each_rank(got: torch.Tensor, wants: Any) -> None:
    """Each simulated rank's value of `got` is close to its own entry of `wants`."""
    for v, w in zip(rank_values(got), wants, strict=True):
        assert (v - w).abs().max() <= TOL


# ---- Colwise --------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_colwise_splits_weight_and_bias_by_output_features(tp: int) -> None:
    layer = _linear(16, 24)
    with fake_ranks(tp) as mesh:
        _apply(layer, mesh, Colwise(output_layouts=Shard(-1)))
        assert layer.weight.placements == (Shard(0),)
        assert layer.bias.placements == (Shard(0),)
        assert _local(layer.weight) == (24 // tp, 16)
        assert _local(layer.bias) == (24 // tp,)


@pytest.mark.parametrize("tp", [2, 4])
def test_colwise_hands_each_rank_its_slice_of_the_output(tp: int) -> None:
    ref = _linear(16, 24)
    layer = copy.deepcopy(ref)
    x = _randn(3, 16)
    want = ref(x)
    with simulated_ranks(tp) as mesh:
        _apply(layer, mesh, Colwise(output_layouts=Shard(-1)))
        got = layer(x)
        assert not isinstance(got, DTensor)
        _assert_each_rank(got, _rank_slices(want, tp))


def test_colwise_gathered_output_is_whole_and_may_be_changed_in_place() -> None:
    ref = _linear(16, 24)
    layer = copy.deepcopy(ref)
    x = _randn(3, 16)
    want = ref(x)
    want.sum().backward()
    with simulated_ranks(2) as mesh:
        _apply(layer, mesh, Colwise(output_layouts=Replicate()))
        got = layer(x)
        _assert_close(got, want)
        got += 1  # a view handed back by torch would refuse this under autograd
        got.sum().backward()
        _assert_close(layer.weight.grad.full_tensor(), _grad(ref.weight))


def test_colwise_output_kept_a_dtensor() -> None:
    layer = _linear(16, 24)
    x = _randn(3, 16)
    with simulated_ranks(2) as mesh:
        _apply(layer, mesh, Colwise(output_layouts=Shard(-1), use_local_output=False))
        got = layer(x)
        assert isinstance(got, DTensor) and got.placements == (Shard(1),)  # the last dim
        assert got.shape == (3, 24)


@pytest.mark.parametrize("tp", [2, 4])
def test_colwise_fused_equal_parts_are_a_strided_shard_of_the_original(tp: int) -> None:
    ref = _linear(16, 24)
    layer = copy.deepcopy(ref)
    with simulated_ranks(tp) as mesh:
        _apply(layer, mesh, Colwise(parts=[8, 8, 8]))
        w = layer.weight
        assert isinstance(w, DTensor)
        assert w.placements == (_StridedShard(0, split_factor=3),)
        assert layer.bias.placements == (_StridedShard(0, split_factor=3),)
        assert _local(w) == (24 // tp, 16)
        _assert_close(w.full_tensor(), ref.weight)
        # rank r holds rows r*step.. of each part of 8, in order
        for r, v in enumerate(rank_values(w.to_local())):
            want = torch.cat([ref.weight[s : s + 8].chunk(tp)[r] for s in (0, 8, 16)])
            assert torch.equal(v, want)


@pytest.mark.parametrize("tp", [2, 4])
def test_colwise_fused_equal_parts_output_is_each_ranks_slice_of_each_part(tp: int) -> None:
    ref = _linear(16, 24)
    layer = copy.deepcopy(ref)
    x = _randn(2, 3, 16)
    want = ref(x)
    with simulated_ranks(tp) as mesh:
        _apply(layer, mesh, Colwise(parts=[8, 8, 8]))
        got = layer(x)
        _assert_each_rank(got, _rank_slices(want, tp, [8, 8, 8]))


def test_colwise_fused_unequal_parts_are_a_plain_shard_and_gather_the_output() -> None:
    """q|k|v of 16|8|8: no DTensor layout holds a slice of each; the weight is a contiguous
    Shard of the original and each rank picks its slices from the gathered output."""
    ref = _linear(16, 32)
    layer = copy.deepcopy(ref)
    x = _randn(3, 16)
    want = ref(x)
    want.square().sum().backward()
    with simulated_ranks(2) as mesh:
        _apply(layer, mesh, Colwise(parts=[16, 8, 8]))
        assert layer.weight.placements == (Shard(0),)
        got = layer(x)
        _assert_each_rank(got, _rank_slices(want, 2, [16, 8, 8]))
        # the ranks' picks cover every feature once: their gradients sum to the whole one
        got.square().sum().backward()
        _assert_close(layer.weight.grad.full_tensor(), _grad(ref.weight))


def test_colwise_fused_parts_of_unequal_sizes_refuse_a_dtensor_output_outside_a_region() -> None:
    """Only a DTensor region's code, which may only cut them apart, takes a fused output held
    in unequal pieces (compile/region_pieces.py); anywhere else the label would be computed
    with, so the call is refused with the fix, on both paths."""
    for local_shards in (True, False):
        layer = _linear(16, 32)
        with simulated_ranks(2) as mesh:
            style = Colwise(parts=[16, 8, 8], use_local_output=False, local_shards=local_shards)
            _apply(layer, mesh, style)
            with pytest.raises(
                TpplanError, match=r"unequal parts \[16, 8, 8\] hands DTensors on .* Fix: drop"
            ):
                layer(_randn(3, 16))


def test_colwise_fused_parts_hand_on_a_strided_dtensor() -> None:
    """In a DTensor region a fused layer's output stays a DTensor whose global value is the
    unsplit output (q|k|v laid end to end), each rank holding its slice of every piece."""
    ref = _linear(16, 24)
    layer = copy.deepcopy(ref)
    x = _randn(3, 16)
    with simulated_ranks(2) as mesh:
        _apply(layer, mesh, Colwise(parts=[8, 8, 8], use_local_output=False))
        got = layer(x)
        assert isinstance(got.placements[0], _StridedShard)
        _assert_close(got.full_tensor(), ref(x))


def test_colwise_fused_parts_gathered_are_the_whole_output() -> None:
    ref = _linear(16, 24)
    layer = copy.deepcopy(ref)
    x = _randn(3, 16)
    with simulated_ranks(2) as mesh:
        _apply(layer, mesh, Colwise(parts=[8, 8, 8], output_layouts=Replicate()))
        _assert_close(layer(x), ref(x))


@pytest.mark.parametrize("tp", [2, 4])
def test_colwise_transposed_splits_dim_1_of_an_in_out_weight(tp: int) -> None:
    ref = Conv1D(16, 24)
    layer = copy.deepcopy(ref)
    x = _randn(2, 3, 16)
    want = ref(x)
    with simulated_ranks(tp) as mesh:
        _apply(layer, mesh, Colwise(transposed=True))
        assert layer.weight.placements == (Shard(1),)
        assert _local(layer.weight) == (16, 24 // tp)
        assert _local(layer.bias) == (24 // tp,)
        _assert_each_rank(layer(x), _rank_slices(want, tp))


def test_colwise_transposed_and_fused_is_gpt2s_c_attn() -> None:
    ref = Conv1D(16, 48)
    layer = copy.deepcopy(ref)
    x = _randn(3, 16)
    want = ref(x)
    with simulated_ranks(2) as mesh:
        _apply(layer, mesh, Colwise(parts=[16, 16, 16], transposed=True))
        assert layer.weight.placements == (_StridedShard(1, split_factor=3),)
        _assert_close(layer.weight.full_tensor(), ref.weight)
        _assert_each_rank(layer(x), _rank_slices(want, 2, [16] * 3))


def test_colwise_on_an_embedding_is_torchs() -> None:
    emb = nn.Embedding(32, 16)
    with fake_ranks(2) as mesh:
        _apply(emb, mesh, Colwise(output_layouts=Shard(-1)))
        assert emb.weight.placements == (Shard(1),)
        assert _local(emb.weight) == (32, 8)


def test_colwise_repr_names_parts_and_transposed() -> None:
    text = repr(Colwise(parts=[8, 8], transposed=True, output_layouts=Replicate()))
    assert text.startswith("Colwise(input_layouts=(Replicate(),), output_layouts=(Replicate(),)")
    assert text.endswith("use_local_output=True, parts=(8, 8), transposed=True)")


# ---- Rowwise --------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_rowwise_splits_the_weight_by_input_features_and_keeps_the_bias(tp: int) -> None:
    layer = _linear(24, 16)
    with fake_ranks(tp) as mesh:
        _apply(layer, mesh, Rowwise())
        assert layer.weight.placements == (Shard(1),)
        assert _local(layer.weight) == (16, 24 // tp)
        assert layer.bias.placements == (Replicate(),)
        assert _local(layer.bias) == (16,)


@pytest.mark.parametrize("tp", [2, 4])
def test_rowwise_sums_the_partial_output(tp: int) -> None:
    ref = _linear(24, 16)
    layer = copy.deepcopy(ref)
    x = _randn(3, 24)
    want = ref(x)
    with simulated_ranks(tp) as mesh:
        _apply(layer, mesh, Rowwise())
        got = layer(distribute_tensor(x, mesh, [Shard(-1)]))
        assert not isinstance(got, DTensor)
        _assert_close(got, want)


def test_rowwise_transposed_splits_dim_0_of_an_in_out_weight() -> None:
    layer = Conv1D(24, 16)
    with fake_ranks(4) as mesh:
        _apply(layer, mesh, Rowwise(transposed=True))
        assert layer.weight.placements == (Shard(0),)
        assert _local(layer.weight) == (6, 16)
        assert layer.bias.placements == (Replicate(),)


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_colwise_then_rowwise_is_the_unsharded_mlp(transposed: bool) -> None:
    """Megatron's MLP, forward and backward: the output handed back may be changed in place
    (Falcon adds its residual that way), which torch's own view would refuse."""
    make = (lambda i, o: Conv1D(i, o)) if transposed else (lambda i, o: _linear(i, o))
    ref = nn.Sequential(make(16, 32), nn.GELU(), make(32, 16))
    mlp = copy.deepcopy(ref)
    x = _randn(2, 3, 16)
    want = ref(x) + 1
    want.square().sum().backward()
    with simulated_ranks(2) as mesh:
        _apply(
            mlp, mesh, {"0": Colwise(transposed=transposed), "2": Rowwise(transposed=transposed)}
        )
        got = mlp(x)
        got += 1
        got.square().sum().backward()
        _assert_close(got, want)
        for p, q in zip(mlp.parameters(), ref.parameters(), strict=True):
            g = _grad(p)
            _assert_close(g.full_tensor() if isinstance(g, DTensor) else g, _grad(q))


def test_rowwise_output_without_grad_is_the_sum() -> None:
    ref = _linear(24, 16)
    layer = copy.deepcopy(ref)
    x = _randn(3, 24)
    with simulated_ranks(2) as mesh, torch.no_grad():
        _apply(layer, mesh, Rowwise())
        got = layer(distribute_tensor(x, mesh, [Shard(-1)]))
        _assert_close(got, ref(x))


def test_rowwise_reduce_scatters_to_a_sequence_shard() -> None:
    layer = _linear(8, 4)
    with fake_ranks(2) as mesh:
        _apply(layer, mesh, Rowwise(output_layouts=Shard(1)))
        assert layer(_randn(2, 6, 4)).shape == (2, 3, 4)


def test_rowwise_output_kept_a_dtensor() -> None:
    layer = _linear(8, 4)
    with fake_ranks(2) as mesh:
        _apply(layer, mesh, Rowwise(use_local_output=False))
        out = layer(_randn(3, 4))
        assert isinstance(out, DTensor) and out.placements == (Replicate(),)
        assert out.to_local().isfinite().all()  # waits for torch's asynchronous all-reduce


def test_rowwise_on_an_embedding_is_torchs_vocab_split() -> None:
    emb = nn.Embedding(32, 16)
    with fake_ranks(2) as mesh:
        _apply(emb, mesh, Rowwise(input_layouts=Replicate()))
        assert emb.weight.placements == (Shard(0),)
        assert _local(emb.weight) == (16, 16)


def test_rowwise_repr_names_transposed() -> None:
    text = repr(Rowwise(transposed=True))
    assert text.startswith("Rowwise(input_layouts=(Shard(dim=-1),)")
    assert text.endswith("transposed=True)")


# ---- embeddings whose forward does more than look up ----------------------------------------
SPECIAL = 3  # the token whose rows _Written overwrites


class _Normed(nn.Embedding):
    """Looks up through nn.Embedding's forward, then norms the rows (not linear in them)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = super().forward(input)
        return F.rms_norm(rows, (rows.shape[-1],))


class _Written(nn.Embedding):
    """Writes a learned row over the rows of one token, then scales (linear in the rows)."""

    def __init__(self, n: int = 32, dim: int = 16, **kw: Any) -> None:
        super().__init__(n, dim, **kw)
        self.special = nn.Parameter(_randn(dim, seed=5))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = super().forward(input)
        rows[input == SPECIAL] = self.special
        return rows * 2.0


class _Pair(nn.Embedding):
    def forward(self, input: torch.Tensor) -> Any:
        rows = super().forward(input)
        return rows, rows


def _embedding(cls: type[nn.Embedding] = _Normed, **kw: Any) -> nn.Embedding:
    torch.manual_seed(0)
    return cls(32, 16, **kw)


def _token_ids() -> torch.Tensor:
    ids = _ids(32, 2, 6)
    ids[0, 1] = SPECIAL
    ids[1, 2] = 0  # the padding row, where the embedding has one
    return ids


@pytest.mark.parametrize("tp", [2, 4])
def test_sum_at_lookup_splits_rows_and_keeps_the_class(tp: int) -> None:
    emb = _embedding()
    with fake_ranks(tp) as mesh:
        _apply(emb, mesh, SumAtLookup())
        assert emb.weight.placements == (Shard(0),)
        assert _local(emb.weight) == (32 // tp, 16)
        assert isinstance(emb, _Normed) and type(emb).__name__ == "_Normed"
        assert [n for n, _ in emb.named_parameters()] == ["weight"]


@pytest.mark.parametrize("tp", [2, 4])
def test_sum_at_lookup_sums_the_rows_before_the_norm(tp: int) -> None:
    ref = _embedding()
    emb = copy.deepcopy(ref)
    ids = _token_ids()
    want = ref(ids)
    probe = _randn(*want.shape, seed=2)  # made before the ranks, so the same on each
    (want * probe).sum().backward()
    with simulated_ranks(tp) as mesh:
        _apply(emb, mesh, SumAtLookup())
        got = emb(ids)
        assert not isinstance(got, DTensor)
        _assert_close(got, want)
        (got * probe).sum().backward()
        _assert_close(emb.weight.grad.full_tensor(), _grad(ref.weight))


def test_sum_at_lookup_on_a_plain_embedding_is_the_lookup() -> None:
    ref = nn.Embedding(32, 16)
    emb = copy.deepcopy(ref)
    ids = _token_ids()
    with simulated_ranks(2) as mesh:
        _apply(emb, mesh, SumAtLookup())
        _assert_close(emb(ids), ref(ids))


def test_sum_at_lookup_refuses_a_module_that_is_no_embedding() -> None:
    with (
        fake_ranks(2) as mesh,
        pytest.raises(TpplanError, match="sum_at: lookup applies to Embedding modules, not Linear"),
    ):
        _apply(_linear(4, 4), mesh, SumAtLookup())


def test_sum_at_lookup_repr() -> None:
    assert repr(SumAtLookup()) == "SumAtLookup()"


@pytest.mark.parametrize("tp", [2, 4])
def test_written_rows_splits_the_embedding_by_rows_and_the_written_row_by_features(tp: int) -> None:
    emb = _embedding(_Written)
    with fake_ranks(tp) as mesh:
        _apply(emb, mesh, WrittenRows(written=["special"]))
        assert emb.weight.placements == (Shard(0),)
        assert emb.special.placements == (Shard(0),)
        assert _local(emb.weight) == (32 // tp, 16)
        assert _local(emb.special) == (16 // tp,)
        assert type(emb).__name__ == "_Written"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_written_rows_matches_the_unsharded_embedding(tp: int, padding_idx: int | None) -> None:
    ref = _embedding(_Written, padding_idx=padding_idx)
    emb = copy.deepcopy(ref)
    ids = _token_ids()
    want = ref(ids)
    probe = _randn(*want.shape, seed=2)  # made before the ranks, so the same on each
    (want * probe).sum().backward()
    with simulated_ranks(tp) as mesh:
        _apply(emb, mesh, WrittenRows(written=["special"]))
        got = emb(ids)
        assert not isinstance(got, DTensor)
        _assert_close(got, want)
        (got * probe).sum().backward()
        for name in ("weight", "special"):
            g = _grad(getattr(emb, name))
            assert isinstance(g, DTensor)
            _assert_close(g.full_tensor(), _grad(getattr(ref, name)))
        assert "special" not in emb.__dict__  # the padded share lives for the call only


def test_written_rows_reduce_scatters_to_a_sequence_shard() -> None:
    ref = _embedding(_Written)
    emb = copy.deepcopy(ref)
    ids = _token_ids()
    want = ref(ids)
    with simulated_ranks(2) as mesh:
        _apply(emb, mesh, WrittenRows(written=["special"], output_layouts=Shard(1)))
        got = emb(ids)
        _assert_each_rank(got, want.chunk(2, dim=1))


def test_written_rows_output_kept_a_dtensor() -> None:
    emb = _embedding(_Written)
    with fake_ranks(2) as mesh:
        _apply(emb, mesh, WrittenRows(written=["special"], use_local_output=False))
        out = emb(_token_ids())
        assert isinstance(out, DTensor) and out.placements == (Replicate(),)


@pytest.mark.parametrize(
    ("make", "written", "message"),
    [
        (lambda: _linear(4, 4), ["weight"], "written applies to Embedding modules, not Linear"),
        (
            lambda: _embedding(_Written, max_norm=1.0),
            ["special"],
            "max_norm, scale_grad_by_freq and sparse gradients do not allow; keep the embedding "
            "whole",
        ),
        (lambda: _embedding(_Written, scale_grad_by_freq=True), ["special"], "scale_grad_by_freq"),
        (lambda: _embedding(_Written, sparse=True), ["special"], "sparse gradients"),
        (
            lambda: _embedding(_Written),
            ["missing"],
            r"written: 'missing' is not a parameter of _Written as wide as its rows \(16\); its "
            r"parameters are weight \(32, 16\), special \(16,\)",
        ),
        (lambda: _embedding(_Written), ["weight"], "written: 'weight' is not a parameter"),
    ],
    ids=["not_embedding", "max_norm", "scale_grad_by_freq", "sparse", "missing", "weight"],
)
def test_written_rows_refusals(
    make: Callable[[], nn.Module], written: list[str], message: str
) -> None:
    with fake_ranks(2) as mesh, pytest.raises(TpplanError, match=message):
        _apply(make(), mesh, WrittenRows(written=written))


def test_written_rows_refuses_a_parameter_narrower_than_a_row() -> None:
    emb = _embedding(_Written)
    emb.register_parameter("narrow", nn.Parameter(torch.zeros(8)))
    with fake_ranks(2) as mesh, pytest.raises(TpplanError, match="'narrow' is not a parameter"):
        _apply(emb, mesh, WrittenRows(written=["narrow"]))


def test_written_rows_refuses_an_output_that_is_not_one_tensor() -> None:
    emb = _embedding(_Pair)
    emb.register_parameter("special", nn.Parameter(torch.zeros(16)))
    with fake_ranks(2) as mesh:
        _apply(emb, mesh, WrittenRows(written=["special"]))
        with pytest.raises(TpplanError, match="must be one tensor, not tuple"):
            emb(_token_ids())
        assert "special" not in emb.__dict__  # cleaned up even so


def test_written_rows_repr() -> None:
    assert repr(WrittenRows(written=["special"])) == (
        "WrittenRows(written=['special'], output=Replicate())"
    )
    assert "output=Shard(dim=1)" in repr(WrittenRows(written=["a"], output_layouts=Shard(1)))


# ---- parameters used inside a split region --------------------------------------------------


class _HeadScale(nn.Module):
    """Scales every head by one shared weight (a q/k norm's weight) and, with `sinks`, adds
    one learned value per head (an attention sink); heads are the split features."""

    def __init__(self, heads: int = 4, head_dim: int = 4, *, sinks: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, head_dim))
        self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, heads)) if sinks else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.unflatten(-1, (-1, self.head_dim)) * self.scale  # (..., local heads, head_dim)
        if self.sinks is not None:
            h = h + self.sinks.unsqueeze(-1)  # one per (local) head
        return h.flatten(-2)


def _sandwich(**kw: bool) -> nn.Sequential:
    """colwise -> per-head module -> rowwise: the region the per-head module sits in."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), _HeadScale(**kw), nn.Linear(16, 8))


def _sandwich_grads(
    tp: int, middle: Any, **kw: bool
) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
    """The sharded sandwich, the unsharded one's gradients and each rank's (made whole) of
    the sharded one, after one forward and backward each; the outputs compared on the way."""
    ref = _sandwich(**kw)
    model = copy.deepcopy(ref)
    x = _randn(3, 8)
    ref(x).square().sum().backward()
    with simulated_ranks(tp) as mesh:
        styles = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        if middle is not None:
            styles["1"] = middle
        _apply(model, mesh, styles)
        out = model(x)
        _assert_close(out, ref(x))
        out.square().sum().backward()
        got = {n: rank_values(_grad(p)) for n, p in model.named_parameters()}
    return model, {n: _grad(p) for n, p in ref.named_parameters()}, got


@pytest.mark.parametrize("tp", [2, 4])
def test_replicate_grad_sum_gives_every_rank_the_whole_gradient(tp: int) -> None:
    model, want, got = _sandwich_grads(tp, ReplicateGradSum())
    assert not isinstance(model[1].scale, DTensor)  # kept whole and plain
    assert len(got["1.scale"]) == tp
    for v in got["1.scale"]:
        assert (v - want["1.scale"]).abs().max() <= TOL


def test_without_replicate_grad_sum_each_rank_holds_a_partial_gradient() -> None:
    """Why the style exists: each rank's gradient covers its own heads only."""
    _, want, got = _sandwich_grads(2, None)
    per_rank = got["1.scale"]
    assert len(per_rank) == 2
    assert all((v - want["1.scale"]).abs().max() > 1e-3 for v in per_rank)
    assert (per_rank[0] + per_rank[1] - want["1.scale"]).abs().max() <= TOL


def test_replicate_grad_sum_leaves_frozen_parameters_and_the_forward_alone() -> None:
    module = _HeadScale()
    module.scale.requires_grad_(False)
    with fake_ranks(2) as mesh:
        _apply(module, mesh, ReplicateGradSum())
    assert not module._forward_hooks and not module._forward_pre_hooks
    assert not module.scale._backward_hooks


def test_replicate_grad_sum_repr() -> None:
    assert repr(ReplicateGradSum()) == "ReplicateGradSum()"


@pytest.mark.parametrize("tp", [2, 4])
def test_split_params_gives_each_rank_its_heads_entries(tp: int) -> None:
    module = _HeadScale(sinks=True)
    with fake_ranks(tp) as mesh:
        _apply(module, mesh, SplitParams(shard={"sinks": 0}))
        assert module.sinks.placements == (Shard(0),)
        assert _local(module.sinks) == (4 // tp,)
        assert not isinstance(module.scale, DTensor)  # the rest left alone


@pytest.mark.parametrize("tp", [2, 4])
def test_split_params_matches_the_unsharded_region(tp: int) -> None:
    model, want, got = _sandwich_grads(tp, SplitParams(shard={"sinks": 0}), sinks=True)
    assert model[1].sinks.placements == (Shard(0),)
    for v in got["1.sinks"]:
        assert (v - want["1.sinks"]).abs().max() <= TOL
    assert "sinks" not in model[1].__dict__  # the local part lives for the call only


def test_split_params_cleans_up_when_the_forward_raises() -> None:
    module = _HeadScale(sinks=True)
    with fake_ranks(2) as mesh:
        _apply(module, mesh, SplitParams(shard={"sinks": 0}))
        with pytest.raises(RuntimeError):
            module(_randn(3, 5))  # 5 features are no whole heads
        assert "sinks" not in module.__dict__


def test_split_params_repr() -> None:
    assert repr(SplitParams(shard={"sinks": 0})) == "SplitParams(shard={'sinks': 0})"


def test_split_param_of_a_child_by_its_dotted_name() -> None:
    model = nn.Sequential(_linear(4, 8))
    with fake_ranks(2) as mesh:
        split_param(model, "0.weight", mesh, 0, None, 0)
        assert model[0].weight.placements == (Shard(0),)
        assert isinstance(model[0].weight, nn.Parameter)


@pytest.mark.parametrize(
    ("parts", "want"),
    [(None, Shard(0)), ((4, 4), _StridedShard(0, split_factor=2)), ((4, 2, 2), Shard(0))],
    ids=["plain", "equal_parts", "unequal_parts"],
)
def test_split_param_layouts(parts: tuple[int, ...] | None, want: Any) -> None:
    layer = _linear(4, 8)
    layer.weight.requires_grad_(False)
    with fake_ranks(2) as mesh:
        split_param(layer, "weight", mesh, 0, parts, 0)
        assert layer.weight.placements == (want,)
        assert not layer.weight.requires_grad  # kept as it was


# ---- experts --------------------------------------------------------------------------------


class _Experts(nn.Module):
    """Every expert's weights in 3-D parameters (experts first), gate|up fused; each token
    goes to one expert and is weighted by its routing weight. With `bias`, a bias added after
    the down projection; with `passing`, an identity expert added whole."""

    def __init__(self, n: int = 4, dim: int = 8, inner: int = 6, **kw: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate_up = nn.Parameter(torch.randn(n, dim, 2 * inner) * 0.3)
        self.down = nn.Parameter(torch.randn(n, inner, dim) * 0.3)
        self.bias = nn.Parameter(torch.randn(dim) * 0.3) if kw.get("bias") else None
        self.norm = nn.LayerNorm(dim) if kw.get("norm") else None
        self.passing = nn.Identity() if kw.get("passing") else None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        gate, up = torch.bmm(x.unsqueeze(1), self.gate_up[ids]).squeeze(1).chunk(2, -1)  # (N, I)
        out = torch.bmm((F.silu(gate) * up).unsqueeze(1), self.down[ids]).squeeze(1)  # (N, D)
        out = out * weights.unsqueeze(-1)
        if self.bias is not None:
            out = out + self.bias
        if self.passing is not None:
            out = out + self.passing(x)
        return out


def _routing(n: int = 4, tokens: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _randn(tokens, 8, seed=3), _ids(n, tokens, seed=4), _randn(tokens, seed=5).sigmoid()


def _tensor_mode(**kw: Any) -> Experts:
    return Experts(shard={"gate_up": 2, "down": 1}, fused={"gate_up": [6, 6]}, **kw)


def _expert_mode() -> Experts:
    return Experts(mode="expert", shard={"gate_up": 0, "down": 0})


@pytest.mark.parametrize("tp", [2, 3])
def test_experts_tensor_mode_splits_features_and_gate_up_piece_by_piece(tp: int) -> None:
    module = _Experts(norm=True)
    with fake_ranks(tp) as mesh:
        _apply(module, mesh, _tensor_mode())
        assert module.gate_up.placements == (_StridedShard(2, split_factor=2),)
        assert _local(module.gate_up) == (4, 8, 12 // tp)
        assert module.down.placements == (Shard(1),)
        assert _local(module.down) == (4, 6 // tp, 8)
        # every other parameter, a child's too, a replicated DTensor
        assert module.norm.weight.placements == (Replicate(),)
        assert module.__dict__[EXPERTS_MARK] == "tensor"


@pytest.mark.parametrize("tp", [2, 4])
def test_experts_expert_mode_gives_each_rank_whole_experts(tp: int) -> None:
    module = _Experts()
    with fake_ranks(tp) as mesh:
        _apply(module, mesh, _expert_mode())
        assert module.gate_up.placements == (Shard(0),)
        assert _local(module.gate_up) == (4 // tp, 8, 12)
        assert _local(module.down) == (4 // tp, 6, 8)
        assert module.__dict__[EXPERTS_MARK] == "expert"


@pytest.mark.parametrize(
    ("style", "kw", "tp"),
    [
        (_tensor_mode, {}, 2),
        (_tensor_mode, {}, 3),
        (_tensor_mode, {"norm": True}, 2),
        (lambda: _tensor_mode(after_sum=["bias"]), {"bias": True}, 2),
        (lambda: _tensor_mode(added_whole=["passing"]), {"passing": True}, 2),
        (lambda: _tensor_mode(added_whole=["passing"]), {"passing": True}, 3),
        (_expert_mode, {}, 2),
        (_expert_mode, {}, 4),
    ],
    ids=[
        "tensor_tp2",
        "tensor_tp3",
        "tensor_replicated_child",
        "tensor_after_sum",
        "tensor_added_whole_tp2",
        "tensor_added_whole_tp3",
        "expert_tp2",
        "expert_tp4",
    ],
)
def test_experts_match_the_unsharded_module(
    style: Callable[[], Experts], kw: dict[str, bool], tp: int
) -> None:
    ref = _Experts(**kw)
    module = copy.deepcopy(ref)
    x, ids, weights = _routing()
    # the tokens and routing weights train too (they come from the layers before)
    inputs = [x.requires_grad_(), ids, weights.requires_grad_()]
    ref_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    want = ref(*ref_inputs)
    probe = _randn(*want.shape, seed=6)  # made before the ranks, so the same on each
    (want * probe).sum().backward()
    with simulated_ranks(tp) as mesh:
        _apply(module, mesh, style())
        got = module(*inputs)
        assert not isinstance(got, DTensor)
        _assert_close(got, want)
        (got * probe).sum().backward()
        for (name, p), q in zip(module.named_parameters(), ref.parameters(), strict=True):
            g = _grad(p)
            assert isinstance(g, DTensor), name
            _assert_close(g.full_tensor(), _grad(q))
        for t, r in zip(inputs[::2], ref_inputs[::2], strict=True):
            _assert_close(_grad(t), _grad(r))
        assert not {"gate_up", "down"} & set(module.__dict__)  # for the call only


def test_experts_routing_given_by_keyword_is_renumbered_too() -> None:
    ref = _Experts()
    module = copy.deepcopy(ref)
    x, ids, weights = _routing()
    with simulated_ranks(2) as mesh:
        _apply(module, mesh, _expert_mode())
        _assert_close(module(x, ids=ids, weights=weights), ref(x, ids, weights))


def test_experts_expert_mode_needs_one_integer_input() -> None:
    module = _Experts()
    x, ids, weights = _routing()
    with fake_ranks(2) as mesh:
        _apply(module, mesh, _expert_mode())
        with pytest.raises(TpplanError, match=r"exactly one integer tensor input .* got 0"):
            module(x, ids.float(), weights)


def test_experts_expert_mode_needs_one_routing_weight_input() -> None:
    module = _Experts()
    x, ids, weights = _routing()
    with fake_ranks(2) as mesh:
        _apply(module, mesh, _expert_mode())
        with pytest.raises(
            TpplanError, match=r"exactly one floating-point input shaped like the routing \(10,\)"
        ):
            module(x, ids, weights.unsqueeze(-1))


def test_experts_repr() -> None:
    text = repr(_tensor_mode(after_sum=["bias"], added_whole=["passing"]))
    assert text == (
        "Experts(mode=tensor, shard={'gate_up': 2, 'down': 1}, fused={'gate_up': (6, 6)}, "
        "after_sum=('bias',), added_whole=('passing',))"
    )


# ---- rule_to_style, placement, plan_to_torch ------------------------------------------------


def _rule(style: str, **fields: Any) -> Rule:
    return Rule(match="m", style=style, why="test", **fields)


@pytest.mark.parametrize(
    ("layout", "want"),
    [
        ("replicate", Replicate()),
        ("partial", Partial()),
        ("shard(0)", Shard(0)),
        ("shard(-1)", Shard(-1)),
        (None, None),
    ],
)
def test_placement(layout: str | None, want: Any) -> None:
    assert placement(layout) == want


# every style of the schema, each with the fields that pick another class or setting
RULES: list[tuple[str, dict[str, Any], type | None, dict[str, Any]]] = [
    ("colwise", {}, Colwise, {"output_layouts": (Shard(-1),), "local_shards": True}),
    ("colwise", {"input": "shard(1)"}, Colwise, {"input_layouts": (Shard(1),)}),
    ("colwise", {"local_output": False}, Colwise, {"use_local_output": False}),
    ("colwise", {"parts": [4, 4]}, Colwise, {"parts": (4, 4), "transposed": False}),
    ("colwise", {"transposed": True}, Colwise, {"parts": None, "transposed": True}),
    ("colwise", {"output": "replicate"}, Colwise, {"output_layouts": (Replicate(),)}),
    ("rowwise", {}, Rowwise, {"input_layouts": (Shard(-1),), "transposed": False}),
    ("rowwise", {"transposed": True}, Rowwise, {"transposed": True}),
    ("rowwise", {"output": "shard(1)"}, Rowwise, {"output_layouts": (Shard(1),)}),
    ("rowwise", {"input": "replicate"}, Rowwise, {"input_layouts": (Replicate(),)}),
    ("vocab_parallel", {}, Rowwise, {"input_layouts": (Replicate(),), "local_shards": True}),
    ("vocab_parallel", {"output": "shard(1)"}, Rowwise, {"output_layouts": (Shard(1),)}),
    ("vocab_parallel", {"sum_at": "lookup"}, SumAtLookup, {}),
    (
        "vocab_parallel",
        {"written": ["special"], "output": "shard(1)", "local_output": False},
        WrittenRows,
        {"written": ["special"], "output_layout": Shard(1), "use_local_output": False},
    ),
    ("vocab_parallel", {"written": ["a"]}, WrittenRows, {"output_layout": Replicate()}),
    ("sequence_parallel", {}, SequenceParallel, {"sequence_sharding": (Shard(1),)}),
    (
        "sequence_parallel",
        {"input": "shard(0)"},
        SequenceParallel,
        {"sequence_sharding": (Shard(0),)},
    ),
    ("sequence_parallel", {"local_output": True}, SequenceParallel, {"use_local_output": True}),
    (
        "prepare",
        {"inputs": ["shard(1)", None], "desired_inputs": ["replicate", None]},
        PrepareModuleInput,
        {
            "input_layouts": (Shard(1), None),
            "desired_input_layouts": (Replicate(), None),
            "use_local_output": False,
        },
    ),
    (
        "prepare",
        {
            "input_kwargs": {"h": "shard(1)"},
            "desired_input_kwargs": {"h": "replicate"},
            "local_input": True,
        },
        PrepareModuleInput,
        {
            "input_kwarg_layouts": {"h": Shard(1)},
            "desired_input_kwarg_layouts": {"h": Replicate()},
            "use_local_output": True,
        },
    ),
    (
        "prepare",
        {"outputs": ["replicate"], "desired_outputs": ["shard(1)"], "local_output": False},
        PrepareModuleOutput,
        {"output_layouts": (Replicate(),), "desired_output_layouts": (Shard(1),)},
    ),
    (
        "prepare",
        {
            "inputs": ["shard(1)"],
            "desired_inputs": ["replicate"],
            "outputs": ["replicate"],
            "desired_outputs": ["shard(1)"],
            "local_input": True,
        },
        PrepareModuleInputOutput,
        {},
    ),
    ("replicate", {}, None, {}),
    ("replicate_grad_sum", {}, ReplicateGradSum, {}),
    ("split_params", {"shard": {"sinks": 0}}, SplitParams, {"shard": {"sinks": 0}}),
    ("heads", {"head_dim": 8}, HeadParallelAttention, {}),
    ("experts", {"shard": {"w": 1}}, Experts, {"mode": "tensor", "fused": {}, "after_sum": ()}),
    (
        "experts",
        {"shard": {"w": 2}, "fused": {"w": [4, 4]}, "after_sum": ["b"], "added_whole": ["id"]},
        Experts,
        {"fused": {"w": (4, 4)}, "after_sum": ("b",), "added_whole": ("id",)},
    ),
    ("experts", {"mode": "expert", "shard": {"w": 0}}, Experts, {"mode": "expert"}),
]


def _rule_id(case: tuple[str, dict[str, Any], type | None, dict[str, Any]]) -> str:
    style, fields, _, _ = case
    return "-".join([style, *fields]) if fields else style


@pytest.mark.parametrize(("style", "fields", "cls", "attrs"), RULES, ids=map(_rule_id, RULES))
def test_rule_to_style(
    style: str, fields: dict[str, Any], cls: type | None, attrs: dict[str, Any]
) -> None:
    got = rule_to_style(_rule(style, **fields))
    if cls is None:
        assert got is None
        return
    assert type(got) is cls  # exactly
    for name, want in attrs.items():
        assert getattr(got, name) == want, name


def test_rule_to_style_covers_every_style_of_the_schema() -> None:
    assert {style for style, *_ in RULES} == set(STYLES)


def test_prepare_with_inputs_and_outputs_passes_both_local_flags() -> None:
    got = rule_to_style(
        _rule(
            "prepare",
            inputs=["shard(1)"],
            desired_inputs=["replicate"],
            outputs=["replicate"],
            desired_outputs=["shard(1)"],
            local_input=True,
            local_output=False,
        )
    )
    assert isinstance(got, PrepareModuleInputOutput)
    assert got.prepare_module_input.use_local_output is True
    assert got.prepare_module_input.desired_input_layouts == (Replicate(),)
    assert got.prepare_module_output.use_local_output is False
    assert got.prepare_module_output.desired_output_layouts == (Shard(1),)


class _Layers(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)) for _ in range(n)
        )
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 4)


def _plan(*rules: tuple[str, str]) -> Plan:
    return Plan(rules=[Rule(match=m, style=s, why="test") for m, s in rules])


def test_plan_to_torch_expands_patterns_in_the_models_module_order() -> None:
    plan = _plan(("head", "colwise"), ("layers.*.2", "rowwise"), ("layers.*.0", "colwise"))
    got = plan_to_torch(plan, _Layers())
    assert list(got) == [
        "layers.0.0",
        "layers.0.2",
        "layers.1.0",
        "layers.1.2",
        "layers.2.0",
        "layers.2.2",
        "head",
    ]
    assert isinstance(got["layers.1.2"], Rowwise)
    assert type(got["layers.2.0"]) is Colwise
    # one style object per rule, shared by the modules it matches
    assert got["layers.0.0"] is got["layers.2.0"]


def test_plan_to_torch_leaves_replicated_and_unmatched_modules_out() -> None:
    plan = _plan(("norm", "replicate"), ("nothing.*", "colwise"), ("layers.1.0", "colwise"))
    assert list(plan_to_torch(plan, _Layers())) == ["layers.1.0"]


def test_plan_to_torch_of_an_empty_plan_is_empty() -> None:
    assert plan_to_torch(Plan(), _Layers()) == {}


def test_plan_to_torch_later_rules_win_and_replicate_does_not_undo() -> None:
    plan = _plan(("layers.*.0", "colwise"), ("layers.0.0", "rowwise"), ("layers.1.0", "replicate"))
    got = plan_to_torch(plan, _Layers())
    assert isinstance(got["layers.0.0"], Rowwise)
    assert type(got["layers.1.0"]) is Colwise
