"""The ops that take split channels one group (or one channel) at a time: a GroupNorm whose
groups each rank holds whole, a BatchNorm, and a grouped (or depthwise) convolution. Each
keeps the split and has the plan split its per-channel parameters (and a BatchNorm's running
statistics) with the channels; the GroupNorm and the convolution also have it divide their
group count. Start at `group_normed`; rules.py registers all three as rules of aten ops.
"""

from __future__ import annotations

import torch

from .ops import Op
from .record import ChannelUse
from .split import Split, SplitEnds, reshape
from .trackers import Trackers

__all__ = ["batch_normed", "depthwise", "group_normed"]

Followed = list[tuple[torch.Tensor, Split]]


def group_normed(st: Trackers, op: Op) -> Followed:
    """A GroupNorm over split channels (dim 1): each group's statistics read its own
    channels only, so where every rank's channels are whole groups (tp divides the group
    count) each rank normalizes its own groups with no collective. The count, an attribute
    the forward read (`self.num_groups`), is divided by the plan, and the per-channel weight
    and bias are split alike (each rank holds its own channels' entries)."""
    x, a = op.args[0], op.named
    s = st.splits.only_split(x)
    if s.dim != 1:
        raise SplitEnds("it normalizes groups of channels (dim 1), and the split is elsewhere")
    n, c, size, groups = a["N"], a["C"], a["HxW"], a["group"]
    grouped = reshape(s, (n, c, size), (n, groups, c // groups * size))
    if grouped.dim != 1:
        raise SplitEnds(
            f"it normalizes each group of {c // groups} channels over all of them, and the "
            "split cuts inside a group"
        )
    _count_channels(st, s, groups, "norm", "it normalizes the split channels in groups, counted")
    st.splits.note_units(grouped)
    for src in s.sources:
        st.trace.spans.groups.setdefault(src, grouped.n)
    _affine_alike(st, a, s, x, "norm")
    return [(op.outs[0], s)]


def batch_normed(st: Trackers, op: Op) -> Followed:
    """A BatchNorm over split channels (dim 1): each channel is normalized alone, by its own
    statistics over the batch and positions (training) or its own running ones (eval), so
    each rank normalizes its own channels with no collective. Its weight and bias and its
    running mean and variance (buffers, updated in place while training) hold one entry per
    channel: the plan splits them alike, each rank its own channels' entries."""
    x, a = op.named["input"], op.named
    s = st.splits.only_split(x)
    if s.dim != 1:
        raise SplitEnds("it normalizes each channel (dim 1), and the split is elsewhere")
    if s.outer != 1:
        raise SplitEnds(
            "it normalizes fused pieces of channels, each rank a slice of each, which its "
            "per-channel entries split in one contiguous share would not match"
        )
    _affine_alike(st, a, s, x, "batch")
    for key in ("running_mean", "running_var"):
        t = a.get(key)
        if not isinstance(t, torch.Tensor):
            continue
        name = st.origins.buffers.get(id(t))
        if name is None or t.shape != (x.shape[1],):
            raise SplitEnds(f"its {key} is not a buffer of one entry per channel")
        _split_with_channels(st, name, s, "batch")
    return [(op.outs[0], s)]


def depthwise(st: Trackers, op: Op) -> Followed:
    """A grouped convolution over split channels: each group of output channels reads its
    own group of input channels only, so where every rank holds whole groups (tp divides
    the group count) each rank convolves its own groups with their own kernels, no
    collective. A depthwise convolution (one group per channel: Mamba's short convolution,
    MobileNet's 3x3 between its 1x1 convolutions) is the case of one channel per group, with
    or without a channel multiplier; ResNeXt's 3x3 of 32 groups another. The weight (one
    kernel per output channel) and bias are split with the channels, and the group count,
    an attribute the forward read (`self.groups`), is divided. A convolution of one group
    mixes every channel: a layer of its own (`channel_conv`), not an op on a split."""
    a = op.named
    x, w = a["input"], a["weight"]
    s = st.splits.split_of(x)
    if s is None or st.splits.split_of(w) is not None:
        raise SplitEnds("it convolves with a kernel computed from split features")
    channels, groups, out_channels = x.shape[1], a["groups"], w.shape[0]
    if s.dim != 1 or a["transposed"] or groups == 1:
        raise SplitEnds(
            f"it convolves {channels} channels in {groups} groups into {out_channels}, mixing "
            "channels across the split (only a grouped convolution, each group of channels "
            "alone, follows a split)"
        )
    if s.outer != 1:
        raise SplitEnds(
            "it convolves fused pieces of channels, each rank a slice of each, which its "
            "kernels split in one contiguous share would not match"
        )
    out = _grouped(st, s, channels // groups, out_channels // groups, groups)
    use: ChannelUse = "depthwise" if groups == channels else "grouped"
    _count_channels(st, s, groups, use, "it convolves each group of split channels alone, counted")
    for key in ("weight", "bias"):
        t = a.get(key)
        if not isinstance(t, torch.Tensor):
            continue
        name = st.origins.param_of(t)
        if name is None or t.shape[0] != out_channels:
            raise SplitEnds(f"its {key} is not a parameter of one entry per output channel")
        _split_with_channels(st, name, s, use)
    return [(op.out, out)]


def _grouped(st: Trackers, s: Split, group_in: int, group_out: int, groups: int) -> Split:
    """The split of a grouped convolution's output channels, from its input's `s`: groups
    of `group_in` channels in, `group_out` out. Where the split's units hold whole groups
    (one channel per unit or group: depthwise) they go on, each a unit of its groups'
    outputs; where groups hold whole units, each rank must hold whole groups (noted: tp
    must divide their count) and the output channels go on one by one. Units and groups
    cutting across each other end the split."""
    if s.inner % group_in == 0:
        return Split(s.dim, 1, s.n, s.inner // group_in * group_out, s.sources)
    if group_in % s.inner == 0:
        st.splits.note_units(Split(s.dim, 1, groups, group_in, s.sources))
        return Split(s.dim, 1, groups * group_out, 1, s.sources)
    raise SplitEnds(
        f"it convolves groups of {group_in} channels, which the split's units of {s.inner} "
        "channels cut across"
    )


def _affine_alike(
    st: Trackers, a: dict[str, object], s: Split, x: torch.Tensor, use: ChannelUse
) -> None:
    """A norm's weight and bias (`a`'s, where given), one entry per channel met along the
    split dim itself, split alike with the channels."""
    for key in ("weight", "bias"):
        t = a.get(key)
        if not isinstance(t, torch.Tensor):
            continue
        if not st.vectors.split_alike(t, s, x.dim(), at=1):
            raise SplitEnds(f"its {key} (one entry per channel) cannot be split with the channels")
        st.vectors.facts.channel_vectors[st.vectors.view_of(t)[0]] = use  # type: ignore[index]


def _split_with_channels(st: Trackers, name: str, s: Split, use: ChannelUse) -> None:
    """The parameter or buffer `name`, one entry per channel along its dim 0, is split with
    the channels of `s`."""
    st.vectors.facts.split_vectors.setdefault(name, set()).update(s.sources)
    st.vectors.facts.vector_dims[name] = 0
    st.vectors.facts.channel_vectors[name] = use


def _count_channels(st: Trackers, s: Split, count: int, use: ChannelUse, doing: str) -> None:
    """`count`, groups of the split channels an op was given, must be an attribute the
    forward read: the plan divides it by tp."""
    held = st.reads.attribute_holding(count, doing)
    for src in s.sources:
        st.trace.reads.counts.setdefault(src, set()).add(held)
    st.trace.reads.groups[held[:2]] = use
