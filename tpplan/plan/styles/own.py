"""The five styles of tpplan's own, which torch's ParallelStyles do not say: a module kept
whole (replicate, replicate_grad_sum), a mixture of experts' weights (experts), parameters
split in place (split_params) and heads cut inside a module's own code (heads). Listed
after torch's five (styles/__init__.py).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from ..rule import Rule

__all__ = ["ExpertsRule", "HeadsRule", "ReplicateGradSumRule", "ReplicateRule", "SplitParamsRule"]


class ReplicateRule(Rule):
    """Keep the module whole on every rank (every rank computes it on the same input); the
    rule's `why` says why it is not split."""

    style: Literal["replicate"] = "replicate"

    splits: ClassVar[bool] = False


class ReplicateGradSumRule(Rule):
    """Keep the module's parameters whole on every rank, and sum their gradients over the
    ranks: each rank computes the module on its share of something split (a norm on split
    features, a bias after a partial sum), so each gradient is a partial one."""

    style: Literal["replicate_grad_sum"] = "replicate_grad_sum"

    splits: ClassVar[bool] = False


_Shard = dict[str, Annotated[int, Field(ge=0)]]
_Fused = dict[str, list[Annotated[int, Field(gt=0)]]]


def _stray_fused(style: str, fused: _Fused | None, shard: _Shard) -> None:
    """Refuse fused pieces of a parameter `shard` does not split."""
    stray = sorted(set(fused or ()) - set(shard))
    if stray:
        raise ValueError(
            f"{style}: fused names {', '.join(stray)}, which is not in shard; fused pieces "
            "are cut along a split dim."
        )


class ExpertsRule(Rule):
    """Split a mixture of experts' expert weights, by tensor (each expert split like a dense
    MLP) or by expert (each rank holds whole experts); one all-reduce sums the output."""

    style: Literal["experts"] = "experts"
    mode: Literal["tensor", "expert"] | None = None
    """`tensor` (default) splits every expert's own weights like a dense MLP (gate/up by
    output features, down by input features) and sums the experts' partial outputs with one
    all-reduce; `expert` gives each rank num_experts/tp whole experts, each rank computes the
    tokens routed to its own experts, and one all-reduce sums them."""
    shard: _Shard | None = None
    """Parameter of the matched module (by its own name, or a child's by its dotted name
    under the module) -> the dim it is split on; the module's other parameters are
    replicated."""
    fused: _Fused | None = None
    """Parameter -> sizes of the pieces laid end to end along its split dim (gate|up); each
    rank holds its slice of every piece, as `parts` does for colwise. A parameter left out
    is read from the model where its forward cuts it into pieces (schema 12)."""
    after_sum: list[str] | None = None
    """Mode tensor: parameters added to the experts' output after the down projection's
    partial sum (its bias): each rank adds its 1/tp share, so the all-reduce adds it once."""
    added_whole: list[str] | None = None
    """Mode tensor: submodules of the matched module (by their dotted names under it) whose
    output its forward adds whole to the experts' partial sums, made the same on every rank
    without the split weights (an identity expert passing its tokens through): each rank
    scales their output by 1/tp, so the all-reduce adds it once."""

    since: ClassVar[int] = 3
    sized: ClassVar[bool] = True
    inside: ClassVar[str | None] = (
        "whose forward runs on each rank's local tensors with its other parameters whole"
    )
    field_since: ClassVar[dict[str, int]] = {
        "mode": 3,
        "shard": 3,
        "fused": 3,
        "after_sum": 3,
        "added_whole": 5,
    }

    def fused_sizes(self) -> dict[str, list[int]]:
        return self.fused or {}

    def model_sizes(self, *, in_region: bool, stated: bool) -> list[tuple[str, str | None]]:
        if self.mode == "expert":  # whole experts take no pieces
            return []
        return [("fused", p) for p in {**(self.shard or {}), **(self.fused or {})}]

    @model_validator(mode="after")
    def _check(self) -> ExpertsRule:
        shard = self.shard
        if not shard:
            raise ValueError(
                "experts needs shard: {parameter: dim} naming the expert weights it splits "
                "(e.g. {gate_up_proj: 1, down_proj: 2} for mode tensor, dim 0 for mode expert)."
            )
        _stray_fused("experts", self.fused, shard)
        stray = sorted(set(self.after_sum or ()) & set(shard))
        if stray:
            raise ValueError(
                f"experts: after_sum names {', '.join(stray)}, which is also in shard; a "
                "parameter added after the sum is whole on every rank."
            )
        if self.mode == "expert" and (
            self.fused or self.after_sum or self.added_whole or set(shard.values()) != {0}
        ):
            raise ValueError(
                "experts with mode expert splits every expert weight on dim 0 (the experts) "
                "and takes no fused, after_sum or added_whole; use shard: {name: 0} for each."
            )
        return self


class SplitParamsRule(Rule):
    """Split parameters a module uses element by element on split features (one attention
    sink per head): each rank holds, and its forward uses, its own contiguous share."""

    # `shard` may also name the module's own buffers (a BatchNorm's running statistics):
    # they split alike and stay buffers

    style: Literal["split_params"] = "split_params"
    shard: _Shard | None = None
    """Parameter of the matched module (by its own name) -> the dim it is split on."""
    fused: _Fused | None = None
    """Parameter -> sizes of the pieces of one size laid end to end along its split dim (a
    raw q|k|v weight used in the module's own einsum): each rank holds its slice of every
    piece, as `parts` does for colwise."""

    since: ClassVar[int] = 4
    field_since: ClassVar[dict[str, int]] = {"fused": 13}

    def fused_sizes(self) -> dict[str, list[int]]:
        return self.fused or {}

    @model_validator(mode="after")
    def _check(self) -> SplitParamsRule:
        if not self.shard:
            raise ValueError(
                "split_params needs shard: {parameter: dim} naming the module's own parameters "
                "it splits (e.g. {sinks: 0})."
            )
        _stray_fused("split_params", self.fused, self.shard)
        unequal = sorted(n for n, sizes in (self.fused or {}).items() if len(set(sizes)) > 1)
        if unequal:
            raise ValueError(
                f"split_params: fused {', '.join(unequal)} has pieces of several sizes; a "
                "parameter split in place takes pieces of one size (keep it whole with "
                "style: replicate)."
            )
        return self


class HeadsRule(Rule):
    """Split torch's nn.MultiheadAttention by heads: its fused input projection by q, k and v
    heads, its output projection by input features, one all-reduce after it."""

    style: Literal["heads"] = "heads"
    head_dim: int | None = Field(default=None, gt=0)
    """The size of one head (read from the module when left out)."""

    since: ClassVar[int] = 10
    inside: ClassVar[str | None] = "which splits its out_proj itself"

    def head_size(self) -> int | None:
        return self.head_dim
