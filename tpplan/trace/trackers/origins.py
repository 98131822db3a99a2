"""Where a tensor comes from: a parameter, the model's input, or a computation on parameters.

Start at `Origins.param_of`. A parameter keeps its name through views and copies, and through
ops on it alone (`1 + weight`); where it meets split tensors outside any Linear is recorded in
the trace's `ParamFacts`, since its gradient is then right only if the plan shards it alike.
`Vectors` follows 1-D parameters (vectors: biases, norm weights, per-head sinks) through views,
keeping which dim holds their entries.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops import METADATA, PASS_THROUGH, RESHAPES, Op
from ..record import LayerFacts, ParamFacts
from ..split import Split, SplitEnds, norm_dim, permutation, reshape

__all__ = ["Origins", "Vectors"]


class Origins:
    """Tensors that are (views or copies of) a parameter or the model's input, and tensors
    computed from parameters. Tensors are held so that their ids stay unique while traced."""

    def __init__(self, facts: ParamFacts, params: dict[int, str]) -> None:
        self.facts = facts
        # id -> (the tensor, or None for the parameter itself, parameter name)
        self.params: dict[int, tuple[Any, str]] = {i: (None, n) for i, n in params.items()}
        # Tensors computed from parameters (id -> tensor): in training they carry a gradient
        # back to the weights (see `carries`).
        self.carrying: dict[int, torch.Tensor] = {}
        self.inputs: dict[int, torch.Tensor] = {}
        # Parameters (2-D or 3-D) of modules that hold 3-D expert weights: the Experts
        # tracker follows them, so they are nobody else's.
        self.expert_params: set[str] = set()
        self.held: list[torch.Tensor] = []  # tensors whose ids the trace records
        # id -> name of each buffer of the traced copy (a BatchNorm's running statistics),
        # looked up by the rules that may split them; no other tracker reads them
        self.buffers: dict[int, str] = {}

    def param_of(self, t: Any) -> str | None:
        """The parameter `t` is (or is a view, copy or function of alone)."""
        entry = self.params.get(id(t))
        return entry[1] if entry is not None and (entry[0] is None or entry[0] is t) else None

    def param_itself(self, t: Any) -> str | None:
        """The parameter `t` is, itself (not a view or copy of it)."""
        entry = self.params.get(id(t))
        return entry[1] if entry is not None and entry[0] is None else None

    def is_input(self, t: Any) -> bool:
        """`t` is the model's input (or a view of it): token ids, when they are integers."""
        return id(t) in self.inputs and self.inputs[id(t)] is t

    def carries(self, t: Any) -> bool:
        """True when `t` is computed from parameters, so that training sends a gradient
        through it to the weights (the trace itself runs without autograd)."""
        if not isinstance(t, torch.Tensor):
            return False
        entry = self.carrying.get(id(t))
        return (entry is not None and entry is t) or self.param_of(t) is not None

    def alias(self, t: torch.Tensor, name: str) -> None:
        """`t` stands for parameter `name` from now on (a view or copy of it)."""
        self.params[id(t)] = (t, name)

    def computed(self, t: torch.Tensor) -> None:
        """`t` was computed from parameters (a layer's output)."""
        self.carrying[id(t)] = t

    def note_carrying(self, op: Op) -> None:
        """What an op computes from parameters carries a gradient to them too."""
        if op.name not in METADATA and any(self.carries(t) for t in op.ins):
            for o in op.outs:
                if o.is_floating_point():
                    self.carrying[id(o)] = o

    def note_params(self, op: Op, sources: frozenset[str]) -> None:
        """Which parameters meet split tensors (of `sources`), and which tensors are still
        the model input."""
        ins, outs = op.ins, op.outs
        used = [
            p
            for p in (self.param_of(t) for t in ins)
            if p is not None and p not in self.expert_params
        ]
        if op.name in PASS_THROUGH and len(ins) == 1 and len(outs) == 1:
            if used:
                self.alias(outs[0], used[0])
                return
            if self.is_input(ins[0]):
                self.inputs[id(outs[0])] = outs[0]
        looked_up = op.name == "index" and used and self.param_of(ins[0]) and len(outs) == 1
        if looked_up and all(not t.is_floating_point() for t in ins[1:]):
            # rows of one parameter looked up by integer indices (a relative position bias
            # table): still that parameter where they meet other tensors
            self.alias(outs[0], used[0])
            return
        if len(set(used)) == 1 and len(used) == len(ins) and len(outs) == 1 and not sources:
            # computed from one parameter alone (`1 + weight`, `softplus(alpha)`): still that
            # parameter where it meets other tensors, so its gradient is judged there
            self.alias(outs[0], used[0])
            return
        if not outs:
            return  # a query (`weight.device`, a size) computes nothing a gradient flows through
        for p in used:
            if sources:
                self.facts.in_span.setdefault(p, set()).update(sources)
            else:
                self.facts.outside.add(p)


def _kept_whole(vd: int, before: Any, after: Any) -> int | None:
    """The dim of `after` that a reshape moves dim `vd` of `before` to whole, if it does."""
    n = before[vd]
    try:
        moved = reshape(Split(vd, 1, n, 1, frozenset()), tuple(before), tuple(after))
    except SplitEnds:
        return None
    whole = moved.outer == 1 and moved.inner == 1 and moved.n == n
    return moved.dim if whole and after[moved.dim] == n else None


class Vectors:
    """Views of vectors (`sinks.view(1, -1, 1)`): id -> (view, parameter, the dim of the view
    holding the parameter's entries)."""

    def __init__(self, facts: ParamFacts, layers: LayerFacts, origins: Origins) -> None:
        self.facts = facts
        self.layers = layers
        self.origins = origins
        self.views: dict[int, tuple[torch.Tensor, str, int]] = {}
        self.dims: dict[str, int] = {}  # parameter -> its dim holding the entries

    def view_of(self, t: Any) -> tuple[str, int] | None:
        """(vector, the dim of `t` holding its entries) when `t` is one, a view of one, or
        computed from one alone (`sinks.float()`)."""
        if not isinstance(t, torch.Tensor):
            return None
        view = self.views.get(id(t))
        if view is not None and view[0] is t:
            return view[1], view[2]
        name = self.origins.param_of(t)
        if name is None or t.dim() != 1 or name in self.origins.expert_params:
            return None
        return name, 0

    def note(self, op: Op) -> None:
        """Follow views of vectors, keeping which dim holds their entries."""
        ins, outs, name = op.ins, op.outs, op.name
        if len(outs) != 1 or not ins:
            return
        if name == "index":
            self._looked_up(op)
            return
        found = self.view_of(ins[0])
        if found is None:
            return
        pname, vd = found
        t, out = ins[0], outs[0]
        new: int | None = None
        if name == "unsqueeze":
            new = vd + (1 if norm_dim(op.named["dim"], out.dim()) <= vd else 0)
        elif name == "expand":
            new = vd + out.dim() - t.dim()
        elif name in ("t", "transpose", "permute"):
            new = permutation(name, op.named, t.dim()).index(vd)
        elif name in RESHAPES:
            # a view that keeps the entries in one dim: all others of size 1, or (rows of a
            # table looked up) the entries' dim carried whole to a dim of its own
            big = [d for d, n in enumerate(out.shape) if n != 1]
            new = big[0] if len(big) == 1 else _kept_whole(vd, t.shape, out.shape)
        elif out.shape == t.shape and (
            name in PASS_THROUGH or (len(ins) == 1 and torch.Tag.pointwise in op.func.tags)
        ):
            new = vd  # a copy, a cast, or `1 + sinks`
        if new is not None and 0 <= new < out.dim() and out.shape[new] == t.shape[vd]:
            self.views[id(out)] = (out, pname, new)

    def _looked_up(self, op: Op) -> None:
        """Rows of a 2-D parameter looked up by one index tensor (`table[index]`): the
        columns, one per head in a relative position bias table, are the entries, in the
        output's last dim."""
        t, out = op.ins[0], op.outs[0]
        name = self.origins.param_of(t)
        indices = op.named.get("indices")
        if name is None or t.dim() != 2 or name in self.origins.expert_params:
            return
        if not isinstance(indices, (list, tuple)) or len(indices) != 1 or indices[0] is None:
            return
        self.views[id(out)] = (out, name, out.dim() - 1)
        self.dims[name] = 1

    def split_alike(self, t: torch.Tensor, s: Split, nd: int, at: int | None = None) -> bool:
        """A vector (or a view of one) with one entry per element of the split dim, met
        element by element by the split tensor: a per-head attention sink. It can be split
        alike (each rank holds its own contiguous share), so the split goes on. `at`: the
        dim of the split tensor its entries meet, where not broadcast from the right (a
        GroupNorm's weight meets the channels, dim 1)."""
        found = self.view_of(t)
        if found is None or s.outer != 1:
            return False
        pname, vd = found
        lands = vd + nd - t.dim() if at is None else at
        if lands != s.dim or t.shape[vd] != s.n * s.inner:
            return False
        if pname.rpartition(".")[0] in self.layers.linears:
            return False  # a Linear's own bias used elsewhere: not the Linear's rule to make
        self.facts.split_vectors.setdefault(pname, set()).update(s.sources)
        self.facts.vector_dims[pname] = self.dims.get(pname, 0)
        return True

    def note_whole(self, t: torch.Tensor) -> None:
        """`t`, unsplit, met a split tensor: if it is a vector, it is met whole."""
        vector = self.view_of(t)
        if vector is not None:
            self.facts.whole_vectors.add(vector[0])
