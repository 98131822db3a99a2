"""`Decision`: one module's rule, less its pattern, as the steps of infer_plan decide it.

Every step writes `Decision`s by full module name; api.py groups equal ones into rules with
compact patterns (`Decision.rule`). `Attributes` holds the module attributes a plan divides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..plan.schema import Rule

__all__ = ["NOT_CALLED", "Attributes", "Decision", "Divided"]

NOT_CALLED = "kept whole: it was not called in the traced forward"


@dataclass(frozen=True)
class Divided:
    """Integer attributes of one module a plan divides, by one divisor, and why (an
    attribute rule less its pattern)."""

    attrs: tuple[str, ...]
    why: str
    by: str | None = None
    """None: the tp size; "replicas" or "shards": of the heads of the layer `of`."""
    of: str | None = None


# module -> what its plan divides, one entry per divisor
Attributes = dict[str, tuple[Divided, ...]]


@dataclass(frozen=True)
class Decision:
    """One module's rule, less its pattern; equal decisions share a rule."""

    style: str
    why: str
    head_dim: int | None = None
    output: str | None = None
    parts: tuple[int, ...] | None = None
    transposed: bool = False
    local_output: bool | None = None
    input: str | None = None
    prepared: int | str | None = None  # prepare: the input gathered (index or keyword)
    positional: int = 1  # prepare: the positional inputs the module takes (one layout each)
    mode: str | None = None  # experts
    shard: tuple[tuple[str, int], ...] = ()  # experts, split_params: (parameter, dim)
    fused: tuple[tuple[str, tuple[int, ...]], ...] = ()  # experts: (parameter, pieces)
    after_sum: tuple[str, ...] = ()  # experts
    added_whole: tuple[str, ...] = ()  # experts: submodules whose output is scaled 1/tp
    replicate_heads: bool = False  # colwise: key/value heads shared past their count
    sum_at: str | None = None  # vocab_parallel: "lookup"
    written: tuple[str, ...] = ()  # vocab_parallel: parameters written over rows, split

    def rule(self, match: str) -> Rule:
        extra: dict[str, Any] = {}
        if self.input is not None:
            extra["input"] = self.input
        if self.prepared is not None:
            where = self.prepared
            if isinstance(where, str):
                extra["input_kwargs"] = {where: "shard(1)"}
                extra["desired_input_kwargs"] = {where: "replicate"}
            else:
                rest = [None] * (self.positional - where - 1)  # the others pass as they are
                extra["inputs"] = [None] * where + ["shard(1)", *rest]
                extra["desired_inputs"] = [None] * where + ["replicate", *rest]
            extra["local_input"] = True
        if self.head_dim is not None:
            extra["head_dim"] = self.head_dim
        if self.replicate_heads:
            extra["replicate_heads"] = True
        if self.output is not None:
            extra["output"] = self.output
        if self.parts is not None:
            extra["parts"] = list(self.parts)
        if self.transposed:
            extra["transposed"] = True
        if self.local_output is not None:
            extra["local_output"] = self.local_output
        if self.shard:
            extra["shard"] = dict(self.shard)
        if self.sum_at is not None:
            extra["sum_at"] = self.sum_at
        if self.written:
            extra["written"] = list(self.written)
        if self.mode is not None:
            extra["mode"] = self.mode
            if self.fused:
                extra["fused"] = {k: list(v) for k, v in self.fused}
            if self.after_sum:
                extra["after_sum"] = list(self.after_sum)
            if self.added_whole:
                extra["added_whole"] = list(self.added_whole)
        return Rule(match=match, style=self.style, why=self.why, **extra)
