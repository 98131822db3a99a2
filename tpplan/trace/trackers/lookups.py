"""`Lookups`: what a table (an Embedding module) does with the rows it looks up.

Start at `Lookups.on_op`. A vocab-parallel table hands each rank the rows of its own share of
the vocab (zeros elsewhere), summed across ranks after the lookup, so its forward must return
something linear in the looked-up rows, and the ids it looks up must be the model's token ids.
While a table's forward runs (the hooks call `enter` and `leave`), every op is judged so; what
is found goes to the trace's `LookupFacts`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..._runtime.torch_compat import tree_leaves
from ..ops import LINEAR_IN_PARTIAL, METADATA, PASS_THROUGH, Op
from ..record import LookupFacts
from .origins import Origins

__all__ = ["Lookups"]


class Lookups:
    """The tables whose forward is running, innermost last, and their looked-up rows."""

    def __init__(self, facts: LookupFacts, origins: Origins) -> None:
        self.facts = facts
        self.origins = origins
        self.calls: list[str] = []  # the tables whose forward is running
        # ... of those, the ones running nn.Embedding.forward in its place in their class
        # order (`super().forward(ids)`; see hooks.py's `watch_lookup_places`)
        self.places: list[str] = []
        self.own_forward: set[str] = set()  # Embedding subclasses whose forward is their own
        # Per running table forward: the tensors linear in its lookup's rows (id -> tensor),
        # and the first op that was not linear in them.
        self.rows: list[tuple[dict[int, torch.Tensor], list[str]]] = []

    def enter(self, name: str) -> None:
        """A table's forward starts: its lookups are judged as they happen."""
        self.calls.append(name)
        self.rows.append(({}, []))

    def leave(self, name: str, out: Any) -> None:
        """A table's forward returned `out`: not linear in its rows, it is noted so."""
        self.calls.pop()
        rows, not_linear = self.rows.pop()
        if not_linear or not (isinstance(out, torch.Tensor) and rows.get(id(out)) is out):
            self.facts.not_linear.setdefault(name, not_linear[0] if not_linear else "an op")

    def on_op(self, op: Op) -> None:
        """Every op, quiet or not: a lookup, or an op inside a table's forward."""
        if op.func is torch.ops.aten.embedding.default:
            self.note_lookup(op.args[1])
            if self.rows:
                self.rows[-1][0][id(op.out)] = op.out
        elif self.rows:
            self.note_rows(op)

    def note_lookup(self, indices: torch.Tensor) -> None:
        """An embedding's rows are token rows when its lookups read the model's input ids:
        seen at the lookup itself, since an Embedding subclass may look up positions it
        computes from the ids it is given (BART's, Whisper's positional embeddings)."""
        if not self.calls:
            return
        module = self.calls[-1]
        tokens = self.origins.is_input(indices)
        seen = self.facts.token_ids.get(module)
        self.facts.token_ids[module] = tokens if seen is None else seen and tokens
        if module in self.own_forward:
            place = self.facts.at_lookup_place
            place[module] = place.get(module, True) and self.places[-1:] == [module]

    def note_rows(self, op: Op) -> None:
        """Inside a table's forward: is what it returns linear in the looked-up rows?
        A vocab-parallel lookup returns each rank's partial rows, summed after the forward,
        so an op that is not linear (a norm) would see partial rows. A parameter of the
        table written over rows as it is can be split and written as each rank's share."""
        rows, not_linear = self.rows[-1]
        ins, name = op.ins, op.name
        written = self.note_own_params(op)
        mine = [t for t in ins if rows.get(id(t)) is t]
        if written is not None:
            table = self.calls[-1]
            if mine == [ins[0]]:
                self.facts.written_rows.setdefault(table, set()).add(written)
            else:  # written over something other than the rows
                self.facts.used_otherwise.add(f"{table}.{written}".lstrip("."))
        if not mine or not_linear:
            return
        others = [t for t in ins if rows.get(id(t)) is not t and t.is_floating_point()]
        linear = (
            (name in LINEAR_IN_PARTIAL and ins[0] is mine[0] and not others)
            or (name in ("mul", "div") and len(mine) == 1 and (name == "mul" or ins[0] is mine[0]))
            or (written is not None and mine == [ins[0]])
        )
        if not linear and name not in METADATA:
            not_linear.append(name)
            return
        for o in tree_leaves(op.out):
            if isinstance(o, torch.Tensor):
                rows[id(o)] = o

    def note_own_params(self, op: Op) -> str | None:
        """Inside a table's forward: how it uses its own parameters other than the weight.
        Returns the one written over rows by this op (`index_put`, its values the parameter
        as it is), if any; a copy or view of one stands for it, and any other use makes it
        one the split cannot take (`LookupFacts.used_otherwise`)."""
        table = self.calls[-1] if self.calls else None
        if table is None:
            return None
        ins, name, out = op.ins, op.name, op.out
        prefix = f"{table}." if table else ""
        own: list[str] = []
        for t in ins:
            p = self.origins.param_of(t)
            if p is not None and p.startswith(prefix) and "." not in p[len(prefix) :]:
                own.append(p)
        own = [p for p in own if p != f"{prefix}weight"]
        if not own or name in METADATA:
            return None
        if name in PASS_THROUGH and len(ins) == 1 and isinstance(out, torch.Tensor):
            self.origins.alias(out, own[0])
            return None
        if name in ("index_put", "index_put_") and own == [self.origins.param_of(op.args[2])]:
            target, indices, values = op.args[:3]
            if (
                target is not values
                and len(indices) < target.dim()  # whole rows: the features are not indexed
                and values.shape[-1:] == target.shape[-1:]
            ):
                return str(own[0][len(prefix) :])
        self.facts.used_otherwise.update(own)
        return None
