"""Attention heads a tp size does not divide (28 query heads at tp 8, 14 at tp 4, a model's
25 heads at tp 2): each rank takes whole heads, as evenly as they go, and only the heads
of its own key/value heads.

Start at `head_shares`. With H query heads in K groups of g = H/K (each group served by one
key/value head; g = 1 without grouping):
- tp at most K: the groups go whole to the ranks, as evenly as they go (the first ranks one
  more), so rank r holds whole groups: its query heads and their key/value heads;
- tp a multiple of K: each key/value head goes whole to the tp/K ranks sharing its group
  (as colwise `replicate_heads` gives it, shared_heads.py), and the group's g query heads
  are split among those ranks as evenly as they go (the first ones more). 28 heads in 4
  groups at tp 8: 4, 3, 4, 3, ... query heads; 14 in 2 at tp 4: 4, 3, 4, 3.
Anything else (tp above K and no multiple of it, a group of fewer query heads than ranks
sharing it) has no split in whole heads of one group each: refused, with the sizes that do.

The parameters stay plain `Shard`s of the original (their full tensor is the original, so
state dicts and checkpoints at any tp size see the unsplit model), and each rank computes
with a working copy of its own heads' rows (own_rows.py, as a fused layer of unequal pieces
does): colwise layers of their output rows, the rowwise layer closing the heads of its
input columns. The attributes the module's forward reads (`num_key_value_groups`, a head
count) become each rank's own value (`own_value`): on real ranks a number, on simulated
ranks (all in one process) a `SymInt` holding each rank's own, which their shapes follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DeviceMesh

from ..errors import TpplanError

__all__ = [
    "HeadShare",
    "even_sizes",
    "head_shares",
    "own_share",
    "own_tensor",
    "own_value",
    "share_rows",
    "uneven_rows",
]


def even_sizes(n: int, ways: int) -> list[int]:
    """`n` things in `ways` runs as even as they go, the first ones one more."""
    return [n // ways + (1 if i < n % ways else 0) for i in range(ways)]


@dataclass(frozen=True)
class HeadShare:
    """One rank's heads: query heads [first, first + count), key/value heads [kv_first,
    kv_first + kv_count) (a head shared with other ranks counted here too)."""

    first: int
    count: int
    kv_first: int
    kv_count: int


def head_shares(heads: int, group: int, tp: int) -> list[HeadShare]:
    """Per rank, its whole heads of `heads` query heads in groups of `group` (the query heads
    one key/value head serves), as the module docstring lays them out. Raises a TpplanError
    naming the sizes where there is no such split."""
    if group < 1 or heads % group:
        raise TpplanError(
            f"{heads} query heads do not form groups of {group}; group is the number of query "
            "heads one key/value head serves (1 without grouping)."
        )
    kv = heads // group
    if tp <= kv:
        out, first = [], 0
        for n in even_sizes(kv, tp):
            out.append(HeadShare(first * group, n * group, first, n))
            first += n
        return out
    if tp % kv == 0 and group >= tp // kv:
        out = []
        for head in range(kv):
            first = head * group
            for n in even_sizes(group, tp // kv):
                out.append(HeadShare(first, n, head, 1))
                first += n
        return out
    fits = [t for t in range(2, 2 * heads + 1) if t <= kv or (t % kv == 0 and group >= t // kv)]
    raise TpplanError(
        f"{heads} query heads in {kv} key/value groups have no split into whole heads at tp "
        f"{tp}: every rank needs whole query heads of whole or shared key/value heads. Use a "
        f"tp size among {', '.join(map(str, fits[:12]))}, or keep the attention replicated."
    )


def own_share(share: HeadShare, by: str, heads: int, group: int) -> tuple[int, int]:
    """(own, whole): a count read in forward becomes `value * own / whole` on the rank of
    `share`, by what its attribute rule divides it by: `tp` its share of the `heads` query
    heads, `shards` of the key/value heads, `replicas` the query heads each of its key/value
    heads serves."""
    return {
        "tp": (share.count, heads),
        "shards": (share.kv_count, heads // group),
        "replicas": (share.count, share.kv_count * group),
    }[by]


def share_rows(shares: Sequence[HeadShare], head_dim: int, *, kv: bool = False) -> list[list[int]]:
    """Per rank, the rows (a colwise weight's output rows, a rowwise one's input columns) of
    its query heads, or with `kv` of its key/value heads, in order."""
    out = []
    for s in shares:
        first, count = (s.kv_first, s.kv_count) if kv else (s.first, s.count)
        out.append(list(range(first * head_dim, (first + count) * head_dim)))
    return out


def uneven_rows(pieces: Sequence[int], head_dim: int, group: int, tp: int) -> list[list[int]]:
    """Per rank, the rows it computes with of a layer whose features are `pieces` laid end
    to end (one piece where nothing is fused), each of whole heads of `head_dim`: in a piece
    of the most heads (H, the query heads) the rank's query heads, in one of H/group (the
    key/value heads of fused q|k|v) its key/value heads. A TpplanError naming the sizes
    where there is no such split."""
    heads = max(pieces) // head_dim
    shares = head_shares(heads, group, tp)
    out: list[list[int]] = [[] for _ in range(tp)]
    start = 0
    for size in pieces:
        n = size // head_dim
        if size % head_dim or n not in (heads, heads // group):
            raise TpplanError(
                f"a piece of {size} features is neither the {heads} query heads of {head_dim} "
                f"nor their {heads // group} key/value heads; fix the rule's parts, head_dim "
                "or group."
            )
        for r, rows in enumerate(share_rows(shares, head_dim, kv=n != heads)):
            out[r].extend(start + i for i in rows)
        start += size
    return out


def _coordinates(mesh: DeviceMesh) -> int | dict[int, int]:
    """This rank's index on the 1-D `mesh`; on simulated ranks (one process runs them all,
    the coordinate a SymInt of each rank's own) {global rank: its index}."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # a rank applying a plan is on its mesh
    rank = coordinate[0]
    if isinstance(rank, int):
        return rank
    found: dict[int, int] = rank.node._local_ints
    return found


def own_value(mesh: DeviceMesh, values: Sequence[int]) -> int | torch.SymInt:
    """This rank's entry of `values` (one per rank of the 1-D `mesh`): a number on a real
    (or fake) rank; on simulated ranks a SymInt of each rank's own value, which the shapes
    computed with it follow."""
    rank = _coordinates(mesh)
    if isinstance(rank, int):
        return values[rank]
    if len({values[c] for c in rank.values()}) == 1:
        return values[next(iter(rank.values()))]
    from .._runtime.torch_compat import LocalIntNode

    return torch.SymInt(LocalIntNode({g: values[c] for g, c in rank.items()}))


def own_tensor(mesh: DeviceMesh, values: Sequence[Sequence[int]], device: torch.device) -> Any:
    """This rank's entry of `values` as a 1-D int64 tensor (lists of any lengths); on
    simulated ranks one holding each rank's own."""
    rank = _coordinates(mesh)
    if isinstance(rank, int):
        return torch.tensor(values[rank], dtype=torch.long, device=device)
    from .._runtime.torch_compat import local_tensor_mode

    mode = local_tensor_mode()
    assert mode is not None  # simulated ranks run inside it
    return mode.rank_map(lambda g: torch.tensor(values[rank[g]], dtype=torch.long, device=device))
