"""Fused layers as honest DTensors (tpplan/compile/strided.py): which part of the whole each rank
holds, checked against DTensor's own split, and what a fused colwise layer costs."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.infer_models import fused_gqa, gpt2
from support.models import token_batch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard

import tpplan
from tpplan._runtime.local import fake_ranks, rank_values, simulated_ranks
from tpplan.compile import strided
from tpplan.compile.strided import (
    boxes,
    equal_parts,
    fused_order,
    local_runs,
    split_parts,
    teach_checkpoint_chunks,
)


class _Mesh:
    """Stands for a DeviceMesh in local_runs, which reads only the axis sizes."""

    def __init__(self, *sizes: int) -> None:
        self.sizes = sizes

    def size(self, axis: int) -> int:
        return self.sizes[axis]


def _torch_split(n: int, placements: list, sizes: tuple[int, ...], coordinate: list[int]) -> list:
    """The global indices a rank holds along dim 0, by DTensor's own _split_tensor."""
    index = torch.arange(n)
    for axis, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            pieces, _ = p._split_tensor(index, sizes[axis], with_padding=False)
            index = pieces[coordinate[axis]]
    return index.tolist()


CASES = [
    (12, [Shard(0)], (2,)),
    (10, [Shard(0)], (4,)),  # uneven: the last rank holds less
    (12, [_StridedShard(0, split_factor=3)], (2,)),
    (24, [_StridedShard(0, split_factor=2)], (4,)),
    (30, [_StridedShard(0, split_factor=3)], (4,)),  # uneven pieces
    (16, [_StridedShard(0, split_factor=2), Shard(0)], (2, 2)),  # FSDP over TP
    (24, [Shard(0), _StridedShard(0, split_factor=3)], (2, 2)),
    (8, [Replicate(), Shard(0)], (2, 2)),
]


@pytest.mark.unit
@pytest.mark.parametrize(("n", "placements", "sizes"), CASES)
def test_local_runs_are_the_indices_dtensor_gives_each_rank(n, placements, sizes) -> None:
    for coordinate in itertools.product(*(range(s) for s in sizes)):
        (runs,) = local_runs((n,), placements, _Mesh(*sizes), list(coordinate))
        held = [g + i for _, g, length in runs for i in range(length)]
        assert held == _torch_split(n, placements, sizes, list(coordinate)), coordinate
        # local starts count the rows before each run
        assert [local for local, _, _ in runs] == list(
            itertools.accumulate([0] + [length for _, _, length in runs[:-1]])
        )


@pytest.mark.unit
def test_a_plain_shard_is_one_box_and_a_split_of_three_pieces_is_three() -> None:
    whole = torch.arange(24.0).reshape(12, 2)
    with fake_ranks(2) as mesh:
        plain = torch.distributed.tensor.distribute_tensor(whole, mesh, [Shard(0)])
        assert boxes(plain) is None
        fused = split_parts(whole, mesh, 0, [4, 4, 4], src_data_rank=None)
        # rank 0 holds rows 0-1 of each piece of 4 rows, at local rows 0, 2, 4
        assert boxes(fused) == [
            ((0, 0), (0, 0), (2, 2)),
            ((2, 0), (4, 0), (2, 2)),
            ((4, 0), (8, 0), (2, 2)),
        ]


@pytest.mark.unit
def test_split_parts_is_each_ranks_slice_of_each_piece_and_the_whole_is_the_original() -> None:
    whole = torch.arange(36.0).reshape(12, 3)
    with simulated_ranks(2) as mesh:
        t = split_parts(whole, mesh, 0, [4, 4, 4], src_data_rank=0)
        locals_ = rank_values(t.to_local())
        assert torch.equal(locals_[0], whole[[0, 1, 4, 5, 8, 9]])
        assert torch.equal(locals_[1], whole[[2, 3, 6, 7, 10, 11]])
        assert all(torch.equal(v, whole) for v in rank_values(t.full_tensor()))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("parts", "tp", "want"),
    [
        ([4, 4, 4], 2, [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]),
        ([4, 2, 2], 2, [0, 1, 4, 6, 2, 3, 5, 7]),  # unequal: each part cut on its own
        ([2, 2], 1, [0, 1, 2, 3]),
    ],
)
def test_fused_order_puts_each_ranks_slice_of_every_part_together(
    parts: list[int], tp: int, want: list[int]
) -> None:
    assert fused_order(parts, tp) == want
    assert sorted(want) == list(range(sum(parts)))  # a permutation: nothing lost


@pytest.mark.unit
@pytest.mark.parametrize(("parts", "want"), [([4, 4, 4], True), ([4, 2, 2], False), ([3], True)])
def test_equal_parts(parts: list[int], want: bool) -> None:
    assert equal_parts(parts) is want


@pytest.mark.unit
def test_split_parts_refuses_unequal_parts() -> None:
    with fake_ranks(2) as mesh, pytest.raises(ValueError, match=r"parts \[4, 2, 2\] are not all"):
        split_parts(torch.zeros(8, 2), mesh, 0, [4, 2, 2], src_data_rank=None)


@pytest.mark.unit
def test_a_fused_in_out_weight_is_split_along_dim_1_in_three_boxes() -> None:
    """GPT-2's c_attn, stored (in, out): the pieces lie along dim 1, whole along dim 0."""
    whole = torch.arange(24.0).reshape(2, 12)
    with fake_ranks(2) as mesh:
        fused = split_parts(whole, mesh, 1, [4, 4, 4], src_data_rank=None)
        assert fused.placements == (_StridedShard(1, split_factor=3),)
        assert fused.to_local().shape == (2, 6)
        assert boxes(fused) == [
            ((0, 0), (0, 0), (2, 2)),
            ((0, 2), (0, 4), (2, 2)),
            ((0, 4), (0, 8), (2, 2)),
        ]


@pytest.mark.unit
def test_a_replicated_tensor_is_one_box() -> None:
    with fake_ranks(2) as mesh:
        t = torch.distributed.tensor.distribute_tensor(torch.zeros(4, 2), mesh, [Replicate()])
        assert boxes(t) is None


@pytest.mark.unit
def test_local_runs_read_a_negative_dim_from_the_end() -> None:
    runs = local_runs((3, 8), [Shard(-1)], _Mesh(2), [1])
    assert runs == [[(0, 0, 3)], [(0, 4, 4)]]


@pytest.mark.unit
def test_teaching_checkpoint_chunks_twice_keeps_torchs_own_protocol() -> None:
    teach_checkpoint_chunks()
    teach_checkpoint_chunks()
    from torch.distributed.tensor import DTensor

    assert DTensor.__create_chunk_list__ is strided._chunk_list
    assert strided._TORCH_PROTOCOL["__create_chunk_list__"] is not strided._chunk_list


# CommDebugMode hooks every module for backward, which cannot fire on HF output dataclasses
@pytest.mark.filterwarnings("ignore:For backward hooks to be called:UserWarning")
def test_a_fused_layer_of_equal_pieces_adds_no_collective() -> None:
    """GPT-2's c_attn at tp 2: the forward's collectives are Megatron's (one all-reduce per
    attention and per MLP block, one after the vocab-split lookup, one all-gather of the
    logits), none for the fused layer itself."""
    model = gpt2()
    plan = tpplan.infer_plan(model, tp_size=2)
    with fake_ranks(2) as mesh:
        tpplan.apply_plan(model, mesh, plan)
        with CommDebugMode() as comm, torch.no_grad():
            model(token_batch())
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    assert counts == {"all_reduce": 2 * 2 + 1, "all_gather_into_tensor": 1}


@pytest.mark.parametrize("tp", [2, 4])
def test_unequal_pieces_are_a_plain_shard_of_the_original_and_stay_at_parity(tp: int) -> None:
    """q|k|v of 64|32|32 are no DTensor layout: the weight is a contiguous Shard of the
    original (so torch's APIs see it as it is), and each rank gathers the layer's output and
    picks its own slices; forward and backward match the unsharded model."""
    ref = fused_gqa()
    x = token_batch()
    want = ref(x)
    want.square().mean().backward()
    model = fused_gqa()
    plan = tpplan.infer_plan(model, example_inputs={"ids": x})
    with simulated_ranks(tp) as mesh:
        tpplan.apply_plan(model, mesh, plan)
        qkv = model.get_parameter("attn.qkv.weight")
        assert qkv.placements == (Shard(0),)
        assert all(torch.equal(v, ref.attn.qkv.weight) for v in rank_values(qkv.full_tensor()))
        got = model(x)
        assert all((v - want).abs().max() <= 1e-5 for v in rank_values(got))
        got.square().mean().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for v in rank_values(grad):
                assert (v - q.grad).abs().max() <= 1e-5, name
