"""The per-op rules: how each aten op carries split features from its inputs to its outputs.

Start at `follow`. A rule is registered for the ops it serves (`@rule("view", ...)`, in
`RULES`) and is called with the trackers and an `Op` of which at least one input is split; it
returns each output that holds split features with its Split, or raises `SplitEnds` with the
reason the split ends there. Ops with no rule of their own but element-wise (tagged
pointwise) share `elementwise`; any other op ends the split. The shape algebra itself is in
split.py; a rule adds what needs the tensors: which operand is split, which is a parameter,
where a count came from. DTensor keeps its sharding rules apart from its dispatcher the same
way (torch/distributed/tensor/_ops/).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .channels import batch_normed, depthwise, group_normed
from .heads import heads_owners, note_grouped, note_repeat, one_head
from .ops import (
    ELEMENTWISE,
    NORMS,
    REDUCTIONS,
    RESHAPES,
    SAME_SHAPE_OVER_DIM,
    SHARD_SIZED,
    SPLITS,
    Op,
)
from .pieces import as_pieces, cut, piece_indexed, piece_sliced, unstacked
from .split import (
    Split,
    SplitEnds,
    after_reduce,
    check_broadcast,
    check_padding,
    every_step,
    merge,
    norm_dim,
    permutation,
    reshape,
)
from .trackers import Trackers

__all__ = ["RULES", "follow", "side_input", "sized_by_a_shard"]

Followed = list[tuple[torch.Tensor, Split]]
Rule = Callable[[Trackers, Op], Followed]
RULES: dict[str, Rule] = {}


def rule(*names: str) -> Callable[[Rule], Rule]:
    """Register a rule for these ops (one rule per op)."""

    def register(fn: Rule) -> Rule:
        for name in names:
            if name in RULES:
                raise ValueError(
                    f"two rules for aten.{name}: {RULES[name].__name__}, {fn.__name__}"
                )
            RULES[name] = fn
        return fn

    return register


def has_rule(op: Op) -> bool:
    """Whether the tracer knows how `op` treats a split dim: a rule of its own, or an
    element-wise op."""
    return op.name in RULES or op.name in ELEMENTWISE or torch.Tag.pointwise in op.func.tags


def follow(st: Trackers, op: Op) -> Followed:
    """The split outputs of an op with at least one split input, by its rule."""
    found = RULES.get(op.name)
    if found is None and (op.name in ELEMENTWISE or torch.Tag.pointwise in op.func.tags):
        found = elementwise
    if found is None:
        raise SplitEnds("the tracer does not know how this op treats a split dim")
    return found(st, op)


# ---- views --------------------------------------------------------------------------------
@rule(*RESHAPES)
def _reshaped(st: Trackers, op: Op) -> Followed:
    x = op.args[0]
    before = as_pieces(st, op, st.splits.only_split(x))
    s = one_head(st, reshape(before, tuple(x.shape), tuple(op.out.shape)), op.out.shape)
    sizes = op.named.get("size", op.named.get("shape"))
    piece = st.splits.piece_of(x)
    st.reads.viewing = piece or None
    try:
        st.reads.check_count(
            sizes,
            s,
            before,
            x,
            op.out.shape,
            width=x.shape[before.dim] // before.outer,
            counted=heads_owners(st, s),
        )
    finally:
        st.reads.viewing = None
    if st.reads.summed or (st.reads.summed == 0 and piece is False):
        # a view of the heads counted as a sum (or by -1, of every fused piece side by side)
        st.splits.fixed_ends[id(op.out)] = (op.out, st.reads.summed)
    if id(op.out) not in st.splits.stacked:
        unstacked(st, op, s.dim)
    return [(op.out, s)]


@rule("transpose", "t", "permute")
def _permuted(st: Trackers, op: Op) -> Followed:
    t = op.args[0]
    s = st.splits.only_split(t)
    return [(op.out, s.at(permutation(op.name, op.named, t.dim()).index(s.dim)))]


@rule("view_as_complex", "view_as_real")
def _complex(st: Trackers, op: Op) -> Followed:
    s = st.splits.only_split(op.args[0])
    if s.dim == op.args[0].dim() - 1 and op.name == "view_as_complex":
        raise SplitEnds("it pairs up the split features as complex numbers")
    return [(op.out, s)]  # a trailing pair of reals <-> one complex number


@rule("expand")
def _expanded(st: Trackers, op: Op) -> Followed:
    x, out = op.args[0], op.out
    s = st.splits.only_split(x)
    d = s.dim + out.dim() - x.dim()
    if out.shape[d] != x.shape[s.dim]:
        raise SplitEnds("it expands the split dim")
    after = s.dim + 1
    if after < x.dim() and x.shape[after] == 1 and out.shape[d + 1] > 1:
        # each head repeated side by side (`repeat_kv`), if a merge follows
        times = out.shape[d + 1]
        note_repeat(st, s.sources, times, "an expand repeats the heads", needed=True, at=d + 1)
    return [(out, s.at(d))]


@rule("slice", "select", "narrow")
def _sliced(st: Trackers, op: Op) -> Followed:
    name, a, t, out = op.name, op.named, op.args[0], op.out
    s = st.splits.only_split(t)
    d = norm_dim(a.get("dim", 0), t.dim())
    if d == s.dim:
        if name != "select" and out.shape[d] == t.shape[d]:
            return [(out, s)]  # a full slice, `x[..., :n]` with n the whole size
        step = a.get("step", 1) if name == "slice" else 1
        start = a.get("start") or 0
        if step > 1 and 0 <= start < step and out.shape[d] == -(-(t.shape[d] - start) // step):
            # every step-th feature (interleaved gate/up): on a shard whose size is a
            # multiple of the step, the same pick of the shard's own features
            picked = every_step(s, step)
            if picked is not None:
                return [(out, picked)]
        if name == "slice" and step == 1:
            return [piece_sliced(st, op, s, d)]
        raise SplitEnds("it takes part of the split dim")
    if name == "select" and d < s.dim:
        return [(out, s.at(s.dim - 1))]
    return [(out, s)]


@rule("index")
def _indexed(st: Trackers, op: Op) -> Followed:
    """`x[:, :, :, [-2]]`: index tensors picking along dims other than the split one (Falcon's
    k and v taken out of each group of q|k|v heads). The split dim is indexed by None (kept
    whole); the picked dims, adjacent, are replaced in place by the index's shape, so the
    split dim moves only by the dims they add or remove before it."""
    x, out = op.args[0], op.out
    s = st.splits.only_split(x)
    indices = list(op.named.get("indices", op.args[1] if len(op.args) > 1 else []))
    picked = [i for i, t in enumerate(indices) if t is not None]
    if picked == [s.dim]:
        return [piece_indexed(st, op, s, s.dim)]
    if not picked or (s.dim < len(indices) and indices[s.dim] is not None):
        raise SplitEnds("it picks along the split dim")
    if any(st.splits.split_of(indices[i]) is not None for i in picked):
        raise SplitEnds("it picks with split indices")
    if any(indices[i].dtype in (torch.bool, torch.uint8) and indices[i].dim() != 1 for i in picked):
        raise SplitEnds("it picks with a mask over several dims")
    if picked != list(range(picked[0], picked[-1] + 1)):
        raise SplitEnds("it picks along dims apart from each other, which moves them first")
    if s.dim < picked[0]:
        return [(out, s)]
    added = out.dim() - x.dim()
    return [(out, s.at(s.dim + added))]


@rule("constant_pad_nd")
def _padded(st: Trackers, op: Op) -> Followed:
    t = op.args[0]
    s = st.splits.only_split(t)
    check_padding(op.named["pad"], t.dim(), s)
    return [(op.out, s)]


# ---- joining and cutting ------------------------------------------------------------------
@rule("cat")
def _concatenated(st: Trackers, op: Op) -> Followed:
    tensors = [t for t in op.named["tensors"] if t.numel() or t.dim() > 1]
    nd = tensors[0].dim()
    d = norm_dim(op.named.get("dim", 0), nd)
    splits = [s for s in (st.splits.split_of(t) for t in tensors) if s is not None]
    merged = merge(splits, [s.dim for s in splits])
    if merged.dim == d:
        raise SplitEnds("it concatenates along the split dim")
    for t in tensors:
        # an unsplit part is fine only as a vector split alike (GPT-OSS's sinks, one per
        # head, joined to the attention logits along the keys)
        if st.splits.split_of(t) is None and not st.vectors.split_alike(t, merged, nd):
            raise SplitEnds("it joins split and unsplit tensors")
    return [(op.out, merged)]


@rule("stack")
def _stacked(st: Trackers, op: Op) -> Followed:
    """Tensors of one shape stacked along a new dim (a rotary's `stack((-x2, x1), -1)`):
    split alike, they stay split, the new dim moving the split one up when it comes before;
    an unsplit one among them would have the whole size where the others have a shard's."""
    tensors = op.named["tensors"]
    splits = [s for s in (st.splits.split_of(t) for t in tensors) if s is not None]
    if len(splits) != len(tensors):
        raise SplitEnds("it stacks split and unsplit tensors")
    merged = merge(splits, [s.dim for s in splits])
    d = norm_dim(op.named.get("dim", 0), op.out.dim())
    return [(op.out, merged.at(merged.dim + 1 if d <= merged.dim else merged.dim))]


@rule(*SPLITS)
def _split_apart(st: Trackers, op: Op) -> Followed:
    t = op.args[0]
    s = st.splits.only_split(t)
    d = norm_dim(op.named.get("dim", 0), t.dim())
    if d == s.dim:
        return cut(st, op, s)
    dim = s.dim - 1 if op.name == "unbind" and d < s.dim else s.dim  # unbind drops its dim
    unstacked(st, op, d)
    return [(o, s.at(dim)) for o in op.out]


@rule("glu")
def _glu(st: Trackers, op: Op) -> Followed:
    """`glu(x, dim)`: x cut into two equal halves along `dim`, one gating the other. Along
    the split dim the halves are fused pieces (gate|up, `parts` in the plan) cut by count,
    as `chunk(2)` cuts them; along another dim the split passes as element-wise."""
    x = op.args[0]
    s = st.splits.only_split(x)
    d = norm_dim(op.named.get("dim", -1), x.dim())
    if d != s.dim:
        return [(op.out, s)]
    halves = Op(torch.ops.aten.split.Tensor, (x, x.shape[d] // 2, d), {}, [op.out, op.out])
    st.reads.chunking += 1
    try:
        ((_, first), _) = cut(st, halves, s)
    finally:
        st.reads.chunking -= 1
    return [(op.out, first)]


# ---- reductions and norms -----------------------------------------------------------------
@rule(*SAME_SHAPE_OVER_DIM)
def _over_dim(st: Trackers, op: Op) -> Followed:
    s = st.splits.only_split(op.args[0])
    if norm_dim(op.named["dim"], op.args[0].dim()) == s.dim:
        raise SplitEnds("it normalizes over the split dim")
    return [(op.out, s)]


@rule("topk", "sort", "cummax", "cummin")
def _ordered(st: Trackers, op: Op) -> Followed:
    """Ops that order or pick along one dim (values and their indices): along another dim
    than the split one, each row is ordered on its own rank, and both outputs keep the
    split; along the split dim they would compare features ranks do not share."""
    x = op.args[0]
    s = st.splits.only_split(x)
    if norm_dim(op.named.get("dim", -1), x.dim()) == s.dim:
        raise SplitEnds("it orders or picks along the split dim")
    return [(o, s) for o in op.outs]  # values and indices, of the input's dims


@rule(*REDUCTIONS)
def _reduced(st: Trackers, op: Op) -> Followed:
    t = op.args[0]
    s = st.splits.only_split(t)
    dims = op.named.get("dim")
    if dims is None or dims == []:
        raise SplitEnds("it reduces the whole tensor, split dim included")
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = [norm_dim(d, t.dim()) for d in dims]
    result = after_reduce(s, dims, keepdim=bool(op.named.get("keepdim", False)))
    return [(o, result) for o in op.outs]


@rule(*NORMS)
def _normed(st: Trackers, op: Op) -> Followed:
    x, a, out = op.args[0], op.named, op.out
    s = st.splits.only_split(x)
    if s.dim >= x.dim() - len(a["normalized_shape"]):
        raise SplitEnds("it normalizes over the split features")
    first = out[0] if isinstance(out, (tuple, list)) else out
    for key in ("weight", "bias"):  # the affine parameters, broadcast over the split dim
        if isinstance(a.get(key), torch.Tensor):
            check_broadcast(a[key].shape, s, first.dim())
    return [(first, s)]


# a GroupNorm, a BatchNorm and a grouped convolution: the channels, a group (or channel) at a time
rule("native_group_norm")(group_normed)
rule(
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional",
)(batch_normed)
rule("convolution")(depthwise)


# ---- products and element-wise ops --------------------------------------------------------
@rule("mm", "bmm", "addmm", "baddbmm")
def _multiplied(st: Trackers, op: Op) -> Followed:
    """mm/bmm (and addmm/baddbmm): batch dims must be split alike, rows or columns may be
    split against an unsplit other side; a split contracted dim is a Linear's job."""
    name, a = op.name, op.named
    x, y = {
        "mm": ("self", "mat2"),
        "bmm": ("self", "mat2"),
        "addmm": ("mat1", "mat2"),
        "baddbmm": ("batch1", "batch2"),
    }[name]
    sx, sy = st.splits.split_of(a[x]), st.splits.split_of(a[y])
    batched = name in ("bmm", "baddbmm")
    row, col = (1, 2) if batched else (0, 1)
    if sx is not None and sy is not None:
        if not (batched and sx.dim == 0 and sy.dim == 0):
            raise SplitEnds("it contracts split operands outside a Linear")
        result = merge([sx, sy], [0, 0])
        if sx.n != sy.n and sx.same_cut(sy):
            # eager grouped-query attention: heads against repeated key/value heads
            (wide, narrow), tensors = (
                ((sx, sy), [a[x], a[y]]) if sx.n > sy.n else ((sy, sx), [a[y], a[x]])
            )
            if narrow.inner > 1:
                note_grouped(st, wide, [narrow], tensors)
    elif sx is not None and sx.dim == row:
        result = sx
        side_input(st, a[y], sx, "it")
    elif sy is not None and sy.dim == col:
        result = sy
        side_input(st, a[x], sy, "it")
    else:
        raise SplitEnds("it contracts or batches over the split dim against an unsplit operand")
    if name in ("addmm", "baddbmm"):
        bias = a["self"]
        if st.splits.split_of(bias) is not None:
            raise SplitEnds("it adds a split bias to a matrix product")
        check_broadcast(bias.shape, result, op.out.dim())
    return [(op.out, result)]


def elementwise(st: Trackers, op: Op) -> Followed:
    """Split operands must be split alike where they meet (broadcasting moves their dims
    right); an unsplit one must be broadcast along the split dim, or be split alike itself
    (a per-expert bias, a per-head vector)."""
    outs = op.outs
    shape = outs[0].shape
    nd = len(shape)
    pairs = [(t, st.splits.split_of(t)) for t in op.ins]
    split_pairs = [(t, s) for t, s in pairs if s is not None]
    dims = [s.dim + nd - t.dim() for t, s in split_pairs]
    for (t, s), d in zip(split_pairs, dims, strict=True):
        if t.shape[s.dim] != shape[d]:
            raise SplitEnds("the split dim is broadcast")
    result = merge([s for _, s in split_pairs], dims)
    for t, maybe in pairs:
        if (
            maybe is None
            and not st.experts.bias_alike(t, result, nd)
            and not st.vectors.split_alike(t, result, nd)
        ):
            st.vectors.note_whole(t)
            check_broadcast(t.shape, result, nd)
            side_input(st, t, result, "it")
    if op.func._schema.is_mutable and st.splits.split_of(op.args[0]) is None:
        raise SplitEnds("it writes split values into an unsplit tensor in place")
    return [(o, result) for o in outs if o.dim() == nd]


def side_input(st: Trackers, t: torch.Tensor, s: Split, op: str) -> None:
    """An unsplit tensor computed from the weights (not a parameter: those get rules of their
    own) meeting split features inside a span, broadcast across them: on each rank its
    gradient sums over that rank's features only, and no collective adds the ranks' partial
    sums, so the weights behind it would train wrong. Experts modules are exempt: their
    style sums the gradients of everything they are given."""
    origins = st.origins
    if not origins.carries(t) or origins.param_of(t) is not None or st.vectors.view_of(t):
        return
    if any(src in origins.expert_params for src in s.sources):
        return
    raise SplitEnds(
        f"{op} meets an unsplit tensor computed from the weights (broadcast over the split "
        "dim): its gradient would be each rank's partial sum, with nothing to add them up"
    )


# ---- new tensors sized by a shard ---------------------------------------------------------
def sized_by_a_shard(st: Trackers, op: Op) -> bool:
    """A tensor made to the size of a split dim read just before (`x.shape[1]`), with values
    that are the same along that dim: a new buffer (`x.new_empty(*x.shape[:-1], d)`, filled
    in afterwards) or an unsplit tensor broadcast to it (`k.expand(-1, x.shape[1], -1, -1)`).
    On each rank it takes the shard's size, and any slice of it along that dim is the rank's
    own: it is split like the tensor read. True when the op was judged so."""
    name, ins, outs, reads = op.name, op.ins, op.outs, st.reads
    if name not in SHARD_SIZED or len(outs) != 1 or not reads.shape_splits:
        return False
    out = outs[0]
    if name == "expand":
        grown = [
            d
            for d in range(out.dim())
            # dims the expand adds in front are grown too, but have no size to read
            if d - out.dim() + ins[0].dim() >= 0
            and ins[0].shape[d - out.dim() + ins[0].dim()] == 1
            and out.shape[d] != 1
        ]
    else:
        grown = list(range(out.dim()))
    # a size some attribute read in forward also holds may be that attribute (T5's
    # `zeros((1, self.n_heads, ...))`, whole on every rank) rather than the shard's
    read = reads.values_read()
    dims = [d for d in grown if out.shape[d] in reads.shape_splits and out.shape[d] not in read]
    if len(dims) != 1:
        return False  # no size read off a split, or ambiguous: leave it whole
    (d,) = dims
    s = reads.shape_splits[out.shape[d]]
    if name == "expand" and st.origins.carries(ins[0]) and st.origins.param_of(ins[0]) is None:
        # each rank would broadcast it over its own share only: its gradient is partial
        st.trace.spans.break_(
            s.sources,
            "expand: it broadcasts an unsplit tensor computed from the weights to the split "
            "size; its gradient would be each rank's partial sum, with nothing to add them up",
        )
        return True
    st.splits.mark(out, s.at(d), name)
    return True
