"""The split algebra of tpplan/trace/split.py, case by case, against real tensor ops.

A Split says which rank's shard holds each element of a tensor under a tp-way split of some
layer's output features. `_ranks` draws that as a tensor of rank numbers; a rule is right
when applying the real op to that tensor gives what the rule's own Split draws."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tpplan.trace.split import (
    Split,
    SplitEnds,
    after_reduce,
    carved,
    check_broadcast,
    check_padding,
    every_step,
    merge,
    norm_dim,
    permutation,
    reshape,
    strides,
)

pytestmark = pytest.mark.unit

A = frozenset({"a"})
B = frozenset({"b"})


def _split(dim: int, outer: int, n: int, inner: int, sources: frozenset[str] = A) -> Split:
    return Split(dim, outer, n, inner, sources)


def _ranks(shape: tuple[int, ...], s: Split, tp: int) -> torch.Tensor:
    """The rank whose shard holds each element: dim `s.dim`'s index read as (outer, n, inner),
    its middle digit cut into tp contiguous chunks."""
    assert s.outer * s.n * s.inner == shape[s.dim], "the split must cover its dim exactly"
    digit = (torch.arange(shape[s.dim]) // s.inner) % s.n
    rank = digit // (s.n // tp)
    view = [1] * len(shape)
    view[s.dim] = shape[s.dim]
    return rank.view(view).expand(shape)


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


# ---- strides, norm_dim, same_cut ------------------------------------------------------------
@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (4, 1, 6), (2, 3, 4, 5), (1, 1, 7)])
def test_strides_are_those_of_a_contiguous_tensor(shape: tuple[int, ...]) -> None:
    assert strides(shape) == list(torch.empty(shape).stride())


@pytest.mark.parametrize(
    ("d", "ndim", "expected"), [(0, 3, 0), (2, 3, 2), (-1, 3, 2), (-3, 3, 0), (-1, 1, 0)]
)
def test_norm_dim_counts_negative_dims_from_the_end(d: int, ndim: int, expected: int) -> None:
    assert norm_dim(d, ndim) == expected


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (_split(2, 1, 64, 1), _split(2, 1, 8, 8, B), True),  # finer or coarser, same cut
        (_split(2, 1, 64, 1), _split(2, 1, 64, 1, B), True),
        (_split(2, 1, 64, 1), _split(1, 1, 64, 1), False),  # another dim
        (_split(2, 2, 32, 1), _split(2, 1, 64, 1), False),  # another outer digit
        (_split(2, 1, 32, 1), _split(2, 1, 64, 1), False),  # another width
        (_split(0, 3, 4, 2), _split(0, 3, 2, 4), True),
    ],
)
def test_same_cut(a: Split, b: Split, same: bool) -> None:
    assert a.same_cut(b) is same and b.same_cut(a) is same


def test_at_moves_a_split_and_keeps_the_rest() -> None:
    assert _split(2, 3, 4, 5).at(0) == _split(0, 3, 4, 5)


# ---- reshape --------------------------------------------------------------------------------
RESHAPES = [
    # (before, split, after, expected split): worked out by hand, each checked on real tensors
    ((2, 16, 64), _split(2, 1, 64, 1), (2, 16, 8, 8), _split(2, 1, 8, 1)),  # into heads
    ((2, 16, 64), _split(2, 1, 64, 1), (2, 16, 4, 16), _split(2, 1, 4, 1)),
    ((2, 16, 64), _split(2, 1, 64, 1), (2, 16, 64, 1), _split(2, 1, 64, 1)),
    ((2, 16, 64), _split(2, 1, 64, 1), (2, 16, 1, 64), _split(3, 1, 64, 1)),
    ((2, 16, 64), _split(2, 1, 64, 1), (32, 64), _split(1, 1, 64, 1)),  # batch and sequence
    ((2, 16, 64), _split(2, 1, 64, 1), (2, 1024), _split(1, 16, 64, 1)),  # sequence outside
    ((2, 16, 64), _split(2, 1, 64, 1), (2048,), _split(0, 32, 64, 1)),
    ((2, 16, 8, 8), _split(2, 1, 8, 1), (2, 16, 64), _split(2, 1, 8, 8)),  # heads merged back
    ((2, 16, 8, 8), _split(2, 1, 8, 1), (2, 16, 8, 4, 2), _split(2, 1, 8, 1)),  # pairs in heads
    ((2, 16, 8, 8), _split(2, 1, 8, 1), (32, 8, 8), _split(1, 1, 8, 1)),
    ((2, 16, 8, 8), _split(2, 1, 8, 1), (2, 16, 4, 16), _split(2, 1, 4, 1)),  # two heads a row
    ((2, 16, 8, 8), _split(2, 1, 8, 1), (2, 16, 16, 4), _split(2, 1, 8, 2)),  # half heads
    ((2, 8, 16, 8), _split(1, 1, 8, 1), (16, 16, 8), _split(0, 2, 8, 1)),  # batch * heads
    ((2, 8, 16, 8), _split(1, 1, 8, 1), (2, 8, 128), _split(1, 1, 8, 1)),
    ((2, 8, 16, 8), _split(1, 1, 8, 1), (2, 4, 256), _split(1, 1, 4, 1)),
    ((2, 8, 16, 8), _split(1, 1, 8, 1), (2, 16, 8, 8), _split(1, 1, 8, 2)),
    ((2, 8, 16, 8), _split(1, 1, 8, 1), (4, 512), _split(0, 2, 2, 1)),
    ((2, 16, 192), _split(2, 1, 192, 1), (2, 16, 8, 24), _split(2, 1, 8, 1)),  # q|k|v per head
    ((2, 16, 192), _split(2, 1, 192, 1), (2, 16, 3, 64), _split(2, 1, 3, 1)),  # q, k, v
    ((2, 64), _split(1, 1, 8, 8), (2, 8, 8), _split(1, 1, 8, 1)),
    ((2, 64), _split(1, 1, 8, 8), (2, 4, 16), _split(1, 1, 4, 1)),
    ((2, 64), _split(1, 1, 8, 8), (2, 32, 2), _split(1, 1, 8, 4)),
    ((2, 64), _split(1, 1, 8, 8), (2, 2, 32), _split(1, 1, 2, 1)),
    ((2, 64), _split(1, 1, 4, 16), (2, 8, 8), _split(1, 1, 4, 2)),
    ((2, 48), _split(1, 1, 6, 8), (2, 3, 16), _split(1, 1, 3, 1)),
    ((2, 48), _split(1, 2, 6, 4), (2, 2, 24), _split(2, 1, 6, 4)),  # outer digit split off
    ((2, 48), _split(1, 1, 6, 8), (2, 12, 4), _split(1, 1, 6, 2)),
    ((2, 10), _split(1, 1, 10, 1), (4, 5), _split(0, 2, 2, 1)),  # each row's halves
    ((2, 12), _split(1, 1, 4, 3), (2, 2, 6), _split(1, 1, 2, 1)),
    ((6, 4), _split(0, 1, 6, 1), (24,), _split(0, 1, 6, 4)),
    ((6, 4), _split(0, 1, 6, 1), (3, 8), _split(0, 1, 3, 1)),
    ((6, 4), _split(0, 1, 6, 1), (6, 2, 2), _split(0, 1, 6, 1)),
    ((4, 6), _split(1, 1, 6, 1), (4, 2, 3), _split(1, 1, 2, 1)),
    ((4, 6), _split(1, 1, 3, 2), (4, 3, 2), _split(1, 1, 3, 1)),
    ((4, 6), _split(1, 1, 3, 2), (24,), _split(0, 4, 3, 2)),
    ((3, 4, 5), _split(1, 1, 4, 1), (3, 20), _split(1, 1, 4, 5)),
    ((3, 4, 5), _split(1, 1, 4, 1), (12, 5), _split(0, 3, 4, 1)),
    ((3, 4, 5), _split(1, 1, 4, 1), (3, 2, 2, 5), _split(1, 1, 2, 1)),
    ((1, 8, 1), _split(1, 1, 8, 1), (8,), _split(0, 1, 8, 1)),
    ((8,), _split(0, 1, 8, 1), (1, 8, 1), _split(1, 1, 8, 1)),
    ((8,), _split(0, 1, 8, 1), (2, 2, 2), _split(0, 1, 2, 1)),
    ((2, 3, 8), _split(2, 1, 8, 1), (6, 8), _split(1, 1, 8, 1)),
    ((2, 3, 8), _split(2, 1, 2, 4), (2, 3, 2, 4), _split(2, 1, 2, 1)),
    # one head (multi-query attention's key): a dim of one keeps its place among dims of one
    ((2, 8, 1, 8), _split(2, 1, 1, 1), (2, 8, 1, 1, 8), _split(2, 1, 1, 1)),  # unsqueeze(3)
    ((2, 8, 1, 1, 8), _split(2, 1, 1, 1), (2, 8, 1, 8), _split(2, 1, 1, 1)),
    ((2, 8, 1, 4, 8), _split(2, 1, 1, 1), (2, 8, 4, 8), _split(2, 1, 1, 4)),  # repeated heads
]


@pytest.mark.parametrize(("before", "split", "after", "expected"), RESHAPES)
def test_reshape_follows_the_split_features(
    before: tuple[int, ...], split: Split, after: tuple[int, ...], expected: Split
) -> None:
    got = reshape(split, before, after)
    assert got == expected
    for tp in _divisors(got.n):
        moved = _ranks(before, split, tp).reshape(after)
        assert torch.equal(moved, _ranks(after, got, tp)), f"tp {tp}"


@pytest.mark.parametrize(
    ("before", "split", "after", "said"),
    [
        ((4, 6), _split(1, 1, 6, 1), (3, 8), "cuts across"),  # a row of 8 mixes two shards
        ((2, 6, 4), _split(1, 1, 6, 1), (2, 4, 6), "cuts across"),
        ((2, 48), _split(1, 1, 6, 8), (2, 4, 12), "cuts across"),
        ((2, 12), _split(1, 1, 6, 2), (2, 4, 3), "cuts across"),
        ((3, 4), _split(0, 1, 3, 1), (2, 6), "cuts across"),
        ((4, 1), _split(1, 1, 1, 1), (4,), "scatters"),  # a split of one feature
        ((2, 12), _split(1, 1, 4, 3), (2, 3, 4), "cuts across"),  # a block of 3 cut in two
    ],
)
def test_a_reshape_that_mixes_shards_ends_the_split(
    before: tuple[int, ...], split: Split, after: tuple[int, ...], said: str
) -> None:
    with pytest.raises(SplitEnds, match=said):
        reshape(split, before, after)


def _factorizations(total: int, dims: int) -> list[tuple[int, ...]]:
    if dims == 1:
        return [(total,)]
    return [
        (d, *rest)
        for d in range(1, total + 1)
        if total % d == 0
        for rest in _factorizations(total // d, dims - 1)
    ]


@pytest.mark.parametrize("before", [(4, 6), (2, 12), (2, 2, 6), (3, 8), (2, 4, 3), (24,)])
def test_every_reshape_the_algebra_follows_keeps_each_ranks_features(
    before: tuple[int, ...],
) -> None:
    """Every split of every dim of `before`, through every reshape to up to 3 dims: where the
    algebra gives a split, the real reshape puts each element where that split says, for
    every tp it allows; it follows at least the reshapes that keep the split dim whole."""
    followed = 0
    for dim, size in enumerate(before):
        for n in _divisors(size):
            for inner in (i for i in range(1, size // n + 1) if (size // n) % i == 0):
                split = _split(dim, size // (n * inner), n, inner)
                for after in (f for k in (1, 2, 3) for f in _factorizations(math.prod(before), k)):
                    try:
                        got = reshape(split, before, after)
                    except SplitEnds:
                        continue
                    followed += 1
                    assert got.outer * got.n * got.inner == after[got.dim]
                    for tp in _divisors(got.n):
                        moved = _ranks(before, split, tp).reshape(after)
                        assert torch.equal(moved, _ranks(after, got, tp)), (split, after, tp)
    assert followed > 20


# ---- carved ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "k", "whole", "expected"),
    [
        ([2, 16, 8, 8], 2, 64, [8, 8]),  # features into (heads, head_dim)
        ([2, 16, 64], 2, 64, [64]),  # kept whole
        ([2, 16, 4, 8, 2], 2, 64, [4, 8, 2]),
        ([2, 16, 3, 64], 2, 192, [3, 64]),  # q|k|v into (3, width)
        ([2, 16, 2, 4, 8], 2, 64, [2, 4, 8]),
        ([2, 16, 8, 8, 1], 2, 64, [8, 8]),  # a trailing 1 is not carved out
        ([2, 16, 1, 64], 2, 64, [1, 64]),
        ([2, 1024], 1, 64, [1024]),  # merged with the sequence: only dim k
        ([2, 16, 8, 16], 2, 64, [8]),  # 8 * 16 overshoots: not carved out of it
        ([4], 0, 4, [4]),
        ([6, 4], 0, 24, [6, 4]),
    ],
)
def test_carved_names_the_dims_a_reshape_cut_out_of_one(
    shape: list[int], k: int, whole: int, expected: list[int]
) -> None:
    assert carved(shape, k, whole) == expected


# ---- merge ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("splits", "dims", "expected"),
    [
        ([_split(1, 1, 8, 1)], [2], _split(2, 1, 8, 1)),  # broadcast to a dim further right
        ([_split(2, 1, 8, 8), _split(2, 1, 64, 1, B)], [2, 2], _split(2, 1, 64, 1, A | B)),
        ([_split(2, 1, 64, 1), _split(2, 1, 8, 8, B)], [2, 2], _split(2, 1, 64, 1, A | B)),
        ([_split(2, 1, 8, 8), _split(2, 1, 8, 8, B)], [2, 2], _split(2, 1, 8, 8, A | B)),
        ([_split(1, 1, 8, 1), _split(2, 1, 8, 1, B)], [2, 2], _split(2, 1, 8, 1, A | B)),
        (
            [_split(0, 1, 4, 2), _split(0, 1, 2, 4, B), _split(0, 1, 8, 1, B)],
            [1, 1, 1],
            _split(1, 1, 8, 1, A | B),
        ),
    ],
)
def test_merge_keeps_the_finest_cut(splits: list[Split], dims: list[int], expected: Split) -> None:
    assert merge(splits, dims) == expected


@pytest.mark.parametrize(
    ("splits", "dims"),
    [
        ([_split(1, 1, 8, 1), _split(2, 1, 8, 1, B)], [1, 2]),  # different dims
        ([_split(1, 2, 4, 1), _split(1, 1, 8, 1, B)], [1, 1]),  # different outer digits
        ([_split(1, 1, 8, 1), _split(1, 1, 4, 1, B)], [1, 1]),  # different widths
    ],
)
def test_merge_of_different_cuts_ends_the_split(splits: list[Split], dims: list[int]) -> None:
    with pytest.raises(SplitEnds, match="different dims or in different ways"):
        merge(splits, dims)


def test_merge_of_an_elementwise_sum_matches_real_broadcasting() -> None:
    """x (2, 16, 64) split on features plus y (64,) split alike: the sum is split like x."""
    x, y = _split(2, 1, 8, 8), _split(0, 1, 64, 1, B)
    got = merge([x, y], [2, 2])
    for tp in (2, 4, 8):
        summed = _ranks((2, 16, 64), x, tp) + 0 * _ranks((64,), y, tp)
        assert torch.equal(summed, _ranks((2, 16, 64), got, tp))


# ---- permutation ----------------------------------------------------------------------------
PERMUTATIONS = [
    ("t", {}, (3, 5), torch.Tensor.t, [1, 0]),
    ("t", {}, (5,), torch.Tensor.t, [0]),  # t of one dim is the tensor as it was
    ("t", {}, (), torch.Tensor.t, []),
    ("transpose", {"dim0": 1, "dim1": 2}, (2, 3, 4, 5), lambda x: x.transpose(1, 2), [0, 2, 1, 3]),
    ("transpose", {"dim0": -1, "dim1": -2}, (2, 3, 4), lambda x: x.transpose(-1, -2), [0, 2, 1]),
    ("transpose", {"dim0": 0, "dim1": -1}, (2, 3, 4), lambda x: x.transpose(0, -1), [2, 1, 0]),
    ("transpose", {"dim0": 1, "dim1": 1}, (2, 3, 4), lambda x: x.transpose(1, 1), [0, 1, 2]),
    ("transpose", {"dim0": 0, "dim1": -1}, (7,), lambda x: x.transpose(0, -1), [0]),
    ("transpose", {"dim0": 0, "dim1": -1}, (), lambda x: x.transpose(0, -1), []),
    (
        "permute",
        {"dims": [0, 2, 1, 3]},
        (2, 3, 4, 5),
        lambda x: x.permute(0, 2, 1, 3),
        [0, 2, 1, 3],
    ),
    ("permute", {"dims": [2, 0, 1]}, (2, 3, 4), lambda x: x.permute(2, 0, 1), [2, 0, 1]),
    ("permute", {"dims": [-1, 0, 1]}, (2, 3, 4), lambda x: x.permute(-1, 0, 1), [2, 0, 1]),
    ("permute", {"dims": [1, -1, 0]}, (2, 3, 4), lambda x: x.permute(1, -1, 0), [1, 2, 0]),
    ("permute", {"dims": [0]}, (6,), lambda x: x.permute(0), [0]),
]


@pytest.mark.parametrize(("name", "args", "shape", "op", "expected"), PERMUTATIONS)
def test_permutation_is_the_order_torch_gives(
    name: str, args: dict[str, object], shape: tuple[int, ...], op: object, expected: list[int]
) -> None:
    order = permutation(name, args, len(shape))
    assert order == expected
    x = torch.empty(shape)
    out = op(x)  # type: ignore[operator]
    assert list(out.shape) == [shape[d] for d in order]
    assert list(out.stride()) == [x.stride(d) for d in order]


@pytest.mark.parametrize(
    ("shape", "dims"), list(itertools.product([(2, 3, 4)], itertools.permutations(range(3))))
)
def test_a_split_moves_where_permute_moves_its_dim(
    shape: tuple[int, ...], dims: tuple[int, ...]
) -> None:
    s = _split(2, 1, 4, 1)
    order = permutation("permute", {"dims": list(dims)}, 3)
    moved = s.at(order.index(s.dim))
    out = _ranks(shape, s, 2).permute(*dims)
    assert torch.equal(out, _ranks(tuple(out.shape), moved, 2))


# ---- every_step (x[..., start::step]) ------------------------------------------------------
@pytest.mark.parametrize(
    ("split", "step", "expected"),
    [
        (_split(1, 1, 64, 1), 2, _split(1, 1, 32, 1)),  # interleaved gate|up of a Linear
        (_split(1, 1, 8, 8), 2, _split(1, 1, 8, 4)),  # every other feature of each head
        (_split(1, 1, 8, 2), 4, _split(1, 1, 4, 1)),
        (_split(1, 1, 8, 4), 4, _split(1, 1, 8, 1)),
        (_split(1, 1, 12, 1), 3, _split(1, 1, 4, 1)),
        (_split(1, 1, 6, 2), 2, _split(1, 1, 6, 1)),
        (_split(1, 1, 3, 1), 2, None),  # three features in steps of two: shards differ
        (_split(1, 1, 8, 3), 2, None),
        (_split(1, 1, 2, 2), 8, None),
    ],
)
def test_every_step_keeps_each_ranks_pick(split: Split, step: int, expected: Split | None) -> None:
    got = every_step(split, step)
    assert got == expected
    if got is None:
        return
    shape = (2, split.outer * split.n * split.inner)
    for tp in _divisors(got.n):
        for start in range(step):
            picked = _ranks(shape, split, tp)[:, start::step]
            assert torch.equal(picked, _ranks(tuple(picked.shape), got, tp)), (tp, start)


# ---- after_reduce ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dims", "keepdim", "dim"),
    [([1], False, 1), ([1], True, 2), ([0, 1], False, 0), ([0, 1], True, 2), ([3], False, 2)],
)
def test_after_reduce_moves_the_split_down_by_the_dims_before_it(
    dims: list[int], keepdim: bool, dim: int
) -> None:
    s, shape = _split(2, 1, 8, 1), (2, 3, 8, 5)
    got = after_reduce(s, dims, keepdim=keepdim)
    assert got == s.at(dim)
    reduced = _ranks(shape, s, 4).amax(dim=dims, keepdim=keepdim)
    assert torch.equal(reduced, _ranks(tuple(reduced.shape), got, 4))


@pytest.mark.parametrize("dims", [[2], [0, 2], [1, 2, 3]])
def test_a_reduction_over_the_split_dim_ends_the_split(dims: list[int]) -> None:
    with pytest.raises(SplitEnds, match="it reduces over the split dim"):
        after_reduce(_split(2, 1, 8, 1), dims, keepdim=False)


# ---- check_broadcast, check_padding -------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "ok"),
    [
        ((64,), False),  # a bias of full width meets every feature: a shard needs its own
        ((1,), True),
        ((), True),  # a scalar
        ((16, 1), True),  # per token, broadcast over the features
        ((2, 16, 1), True),
        ((2, 1, 64), False),
        ((1, 1, 1), True),
        ((16, 64), False),
    ],
)
def test_check_broadcast_lets_an_unsplit_operand_meet_the_split_dim_only_as_size_1(
    shape: tuple[int, ...], ok: bool
) -> None:
    """x (2, 16, 64) split on its features meets an unsplit operand of `shape`."""
    s = _split(2, 1, 64, 1)
    assert torch.broadcast_shapes(shape, (2, 16, 64)) == (2, 16, 64)
    if ok:
        check_broadcast(shape, s, 3)
    else:
        with pytest.raises(SplitEnds, match="unsplit one of full size along the split dim"):
            check_broadcast(shape, s, 3)


@pytest.mark.parametrize(
    ("pad", "ok"),
    [
        ([0, 0], True),
        ([0, 0, 1, 2], True),  # the sequence padded to whole chunks
        ([1, 0], False),  # the last dim, the split one
        ([0, 3], False),
        ([0, 0, 0, 0, 2, 2], True),  # the batch dim
        ([0, 1, 1, 0], False),
    ],
)
def test_check_padding_refuses_padding_on_the_split_dim(pad: list[int], ok: bool) -> None:
    s = _split(2, 1, 8, 1)
    x = _ranks((2, 3, 8), s, 2)
    padded = torch.nn.functional.pad(x, pad, value=-1)
    # padding only other dims keeps the split dim's size, so each rank keeps its features
    assert (padded.shape[2] == 8) is ok
    if ok:
        check_padding(pad, 3, s)
    else:
        with pytest.raises(SplitEnds, match="it pads the split dim"):
            check_padding(pad, 3, s)
