"""`Split`, where a layer's output features sit in a tensor, and its pure algebra.

Start at `Split`. The functions below say where a Split goes when a tensor is reshaped
(`reshape`), permuted (`permutation`), merged with other split tensors (`merge`), reduced or
sliced with a step; they read shapes and dims only, never a tensor, so the tests check them
against real tensor ops (tests/test_split.py). An op the algebra cannot follow raises
`SplitEnds`, whose message becomes the `why` of the layers behind the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Split",
    "SplitEnds",
    "after_reduce",
    "carved",
    "check_broadcast",
    "check_padding",
    "every_step",
    "merge",
    "norm_dim",
    "permutation",
    "reshape",
    "strides",
]


@dataclass(frozen=True)
class Split:
    """Where some Linear layers' output features sit in a tensor.

    Dim `dim` is read as a mixed-radix index (outer, n, inner): the features are split along
    the middle digit, of size n. A tp-way split of the features is a split of that digit into
    tp contiguous chunks, valid when tp divides n. Right after a Linear it is (1, out, 1);
    after `view(B, S, -1, 8)` it is (1, heads, 1) on the heads dim; merged back by
    `view(B, S, -1)` it is (1, heads, 8) on the feature dim.
    """

    dim: int
    outer: int
    n: int
    inner: int
    sources: frozenset[str]
    """The layers whose output features these are (one, or several joined in a span)."""

    def same_cut(self, other: Split) -> bool:
        """Both describe the same partition of the same dim (up to how finely it may be cut)."""
        return (
            self.dim == other.dim
            and self.outer == other.outer
            and self.n * self.inner == other.n * other.inner
        )

    def at(self, dim: int) -> Split:
        """The same split, found at another dim (an op added or removed dims before it)."""
        return Split(dim, self.outer, self.n, self.inner, self.sources)


class SplitEnds(Exception):
    """An op ends the splits it received; the message says why."""


def norm_dim(d: int, ndim: int) -> int:
    """A dim as torch reads it: negative dims count from the end."""
    return d + ndim if d < 0 else d


def strides(shape: tuple[int, ...] | list[int]) -> list[int]:
    """The strides of a contiguous (row-major) tensor of this shape."""
    out = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        out[k] = out[k + 1] * shape[k + 1]
    return out


def reshape(split: Split, before: tuple[int, ...], after: tuple[int, ...]) -> Split:
    """Follow a split digit through a row-major reshape (views keep the flat order)."""
    st = strides(before)
    low = split.inner * st[split.dim]  # flat stride of the split digit
    top = low * split.n
    st2 = strides(after)
    if split.n == split.inner == split.outer == 1:
        # a dim of one (a single head, viewed so): it has no flat extent, and dims of one
        # added or removed beside it share its stride; it stays the same one of them
        ones = [k for k, size in enumerate(before) if size == 1 and st[k] == low]
        kept = [k for k, size in enumerate(after) if size == 1 and st2[k] == low]
        i = ones.index(split.dim)
        if i < len(kept):
            return Split(kept[i], 1, 1, 1, split.sources)
    for k, size in enumerate(after):
        if st2[k] < top <= st2[k] * size:
            break
    else:
        raise SplitEnds("a reshape scatters the split features")
    if top % st2[k] or (st2[k] * size) % top:
        raise SplitEnds(f"a reshape to {list(after)} cuts across the split features")
    if low >= st2[k]:  # the whole digit lands in dim k
        if low % st2[k]:
            raise SplitEnds(f"a reshape to {list(after)} cuts across the split features")
        inner, n = low // st2[k], split.n
    else:  # the digit spans dim k and lower dims: its top part in dim k is the new split
        if st2[k] % low:
            raise SplitEnds(f"a reshape to {list(after)} cuts across the split features")
        inner, n = 1, top // st2[k]
    return Split(k, size // (n * inner), n, inner, split.sources)


def carved(shape: list[int], k: int, whole: int) -> list[int]:
    """The sizes of the dims from `k` on that a row-major reshape carved out of one input dim
    of size `whole` (just [shape[k]] when dim k merges it with others)."""
    out, product = [], 1
    for size in shape[k:]:
        if product >= whole:
            break
        out.append(size)
        product *= size
    return out if product == whole else out[:1]


def merge(splits: list[Split], dims: list[int]) -> Split:
    """One split from several that must cut the same dim the same way (kept at the finest n):
    the operands of an element-wise op, a concatenation or a stack, each split at `dims`
    (its own dim, broadcast to the output's)."""
    first = None
    for old, d in zip(splits, dims, strict=True):
        s = old.at(d)
        if first is None:
            first = s
            continue
        if not first.same_cut(s):
            raise SplitEnds("it combines tensors split along different dims or in different ways")
        finest = first if first.n >= s.n else s
        first = Split(d, finest.outer, finest.n, finest.inner, first.sources | s.sources)
    assert first is not None  # callers pass at least one split
    return first


def permutation(name: str, args: dict[str, object], nd: int) -> list[int]:
    """The order of dims after `t`, `transpose` or `permute` (named `args`) of an `nd`-dim
    tensor: output dim j is input dim order[j]. A tensor of fewer than two dims comes out
    of `t` or `transpose` as it was (torch's rule), so no dims are swapped there."""
    if name == "permute":
        return [norm_dim(d, nd) for d in args["dims"]]  # type: ignore[attr-defined]
    order = list(range(nd))
    if name == "t":
        d0, d1 = 0, 1
    else:
        d0, d1 = norm_dim(args["dim0"], nd), norm_dim(args["dim1"], nd)  # type: ignore[arg-type]
    if nd >= 2:
        order[d0], order[d1] = order[d1], order[d0]
    return order


def every_step(split: Split, step: int) -> Split | None:
    """The split of every `step`-th feature of the split dim (interleaved gate|up pieces),
    where a rank's shard, its size a multiple of the step, picks its own features alike;
    None where a shard would not."""
    if split.inner % step == 0:
        return Split(split.dim, split.outer, split.n, split.inner // step, split.sources)
    if step % split.inner == 0 and split.n % (step // split.inner) == 0:
        return Split(split.dim, split.outer, split.n // (step // split.inner), 1, split.sources)
    return None


def after_reduce(split: Split, dims: list[int], *, keepdim: bool) -> Split:
    """The split of a reduction over other dims (`dims`, normalized): it moves down by the
    reduced dims before it, unless they are kept (size 1)."""
    if split.dim in dims:
        raise SplitEnds("it reduces over the split dim")
    return split.at(split.dim if keepdim else split.dim - sum(1 for x in dims if x < split.dim))


def check_broadcast(shape: Sequence[int], split: Split, nd: int) -> None:
    """An unsplit operand of this shape may meet a split tensor of `nd` dims only where it
    is broadcast along the split dim (size 1 there, or no dim there at all)."""
    k = split.dim - (nd - len(shape))
    if k >= 0 and shape[k] != 1:
        raise SplitEnds(
            "it combines the split tensor with an unsplit one of full size along the split dim"
        )


def check_padding(pad: Sequence[int], nd: int, split: Split) -> None:
    """`F.pad` pads the last dims, two numbers each, last dim first. Padding dims beside the
    split (a sequence padded to whole chunks) keeps each rank's features where they were;
    padding the split dim itself would add features at the ends of the whole dim, which no
    shard holds."""
    for i in range(0, len(pad), 2):
        if nd - 1 - i // 2 == split.dim and (pad[i] or pad[i + 1]):
            raise SplitEnds("it pads the split dim")
