"""`WholeOutputs`: outputs an experts module adds to its partial sums whole.

Start at `WholeOutputs.note_output`. A parameter-free submodule of a module holding 3-D expert
weights (an identity expert, which hands its tokens back) makes its output without the split
weights, so every rank computes it whole. Added to the experts' partial sums, it would be
counted tp times by the all-reduce, unless the plan scales it by 1/tp on each rank
(`added_whole`); that is right only when every use of the output is linear and ends in that
sum, so any other use is recorded (`ExpertFacts.whole_used_otherwise`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..._runtime.torch_compat import tree_leaves
from ..ops import ADDS, METADATA, Op, linear_in
from ..record import ExpertFacts
from .dense import DenseSplits

__all__ = ["WholeOutputs"]


class WholeOutputs:
    """Whole outputs of parameter-free submodules of experts modules, and what is linear in
    them: id -> (tensor, the submodules)."""

    def __init__(self, facts: ExpertFacts, splits: DenseSplits) -> None:
        self.facts = facts
        self.splits = splits
        self.tensors: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}
        self.owner: dict[str, str] = {}  # submodule -> its experts module

    def of(self, t: Any) -> frozenset[str] | None:
        """The submodules whose whole output `t` is (or is linear in)."""
        entry = self.tensors.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is t else None

    def note_output(
        self, name: str, owner: str, args: Any, kwargs: dict[str, Any], out: Any
    ) -> torch.Tensor | None:
        """Submodule `name` of experts module `owner` returned `out`: made whole (not split,
        not another's whole output), it is followed; returns what the forward should return
        instead, if anything."""
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(self.of(t) is not None for t in ins):
            return None  # made from another's whole output: that one is scaled already
        if self.splits.split_of(out) is not None:
            return None
        if any(out is t for t in ins):
            # an identity hands back its input: mark a view of it, so that other uses of
            # the input are not taken for uses of this output
            out = out.view_as(out)
        self.tensors[id(out)] = (out, frozenset({name}))
        self.owner[name] = owner
        return out

    def follow(self, op: Op) -> None:
        """Whole outputs stay such through ops linear in them (a view, the routing weight),
        until added to the partial sums (`Experts.follow_partial`); any other use is noted."""
        if op.name in METADATA or op.func.namespace == "prim":
            return
        floats = [t for t in op.ins if t.is_floating_point()]
        mine = [t for t in floats if self.of(t) is not None]
        others = [t for t in floats if self.of(t) is None]
        children = frozenset().union(*(self.of(t) or () for t in mine))
        ok = linear_in(op.name, op.ins, mine, others, self._unsplit)
        if ok is None:
            ok = op.name in ADDS and not others
        if not ok:
            self.used_otherwise([children], f"{op.name} takes it")
            return
        for o in op.outs:
            if o.is_floating_point():
                self.tensors[id(o)] = (o, children)

    def used_otherwise(self, outputs: list[frozenset[str] | None], why: str) -> None:
        """These whole outputs are used other than added to the partial sums."""
        for w in outputs:
            for child in w or ():
                self.facts.whole_used_otherwise.setdefault(child, why)

    def drop_owned_by(self, owner: str) -> None:
        """`owner`'s forward returned: its sum is whole again, and so is all it held."""
        for k, (_, children) in list(self.tensors.items()):
            if any(self.owner.get(c) == owner for c in children):
                del self.tensors[k]

    def _unsplit(self, t: torch.Tensor) -> bool:
        return self.splits.split_of(t) is None
