"""What `tpplan show` draws, as plain data: a `Picture` of `Group`s of `Layer`s, each layer
with its `Kind` (how the plan treats it), its rule's reason, the collectives its forward
runs and its parameter bytes per rank. Built by measure.py, drawn by svg.py; no torch here,
so the picture can be tested apart from the drawing and the drawing apart from any model.

Start at `Picture`. A group is one block of the model (`model.layers.*`) standing for every
layer that the plan treats alike, or the modules outside the repeated blocks; its layers are
in the order the model's forward calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..plan.rule import Rule
from ..plan.styles import (
    ColwiseRule,
    ExpertsRule,
    HeadsRule,
    PrepareRule,
    ReplicateGradSumRule,
    ReplicateRule,
    RowwiseRule,
    SequenceParallelRule,
    SplitParamsRule,
    VocabParallelRule,
)

__all__ = ["OUTSIDE", "Collective", "Group", "Kind", "Layer", "Picture", "Region", "kind_of"]

OUTSIDE = "outside the repeated blocks"
"""The name of the group of modules no repeated block holds (embeddings, the head)."""


class Kind(Enum):
    """How a drawn box is treated: one per style, a colwise layer gathered right after
    split apart from one left split, a module no rule matches, and a DTensor region (drawn
    as a frame round its layers). The value is the legend's words."""

    COLWISE = "colwise: output features split"
    GATHERED = "colwise, then gathered (output replicate)"
    ROWWISE = "rowwise: input features split, output summed"
    VOCAB_PARALLEL = "vocab_parallel: embedding rows split"
    SEQUENCE_PARALLEL = "sequence_parallel: on a share of the sequence"
    PREPARE = "prepare: inputs or outputs redistributed"
    REPLICATE = "replicate: kept whole"
    REPLICATE_GRAD_SUM = "replicate_grad_sum: whole, gradients summed"
    EXPERTS = "experts: mixture-of-experts weights split"
    SPLIT_PARAMS = "split_params: parameters split in place"
    HEADS = "heads: nn.MultiheadAttention split by heads"
    NO_RULE = "no rule: whole on every rank"
    REGION = "DTensor region: its code runs on DTensors"


# one entry per style class: a style added to the schema without a kind here fails a test
KIND_OF_STYLE: dict[type[Rule], Kind] = {
    ColwiseRule: Kind.COLWISE,
    RowwiseRule: Kind.ROWWISE,
    VocabParallelRule: Kind.VOCAB_PARALLEL,
    SequenceParallelRule: Kind.SEQUENCE_PARALLEL,
    PrepareRule: Kind.PREPARE,
    ReplicateRule: Kind.REPLICATE,
    ReplicateGradSumRule: Kind.REPLICATE_GRAD_SUM,
    ExpertsRule: Kind.EXPERTS,
    SplitParamsRule: Kind.SPLIT_PARAMS,
    HeadsRule: Kind.HEADS,
}


def kind_of(rule: Rule | None) -> Kind:
    """The box kind of a module `rule` treats (None: no rule matches it)."""
    if rule is None:
        return Kind.NO_RULE
    if isinstance(rule, ColwiseRule) and rule.output_layout() == "replicate":
        return Kind.GATHERED  # split, then its features gathered: what follows sees them whole
    return KIND_OF_STYLE[type(rule)]


@dataclass(frozen=True)
class Collective:
    """Collectives of one kind that a module's forward ran, counted once per call."""

    kind: str
    """all-reduce, all-gather, reduce-scatter, all-to-all (torch's op, in words)."""
    count: int

    def __str__(self) -> str:
        return self.kind if self.count == 1 else f"{self.count}x {self.kind}"


@dataclass(frozen=True)
class Layer:
    """One box: a module (or like modules, `experts.*.w1`) of a group's block."""

    name: str
    """Its name under the block (`self_attn.q_proj`); the full name in the outside group."""
    kind: Kind
    rule: str | None
    """The match pattern of the rule that treats it; None where no rule does."""
    reason: str
    """The rule's `why`; for a module no rule matches, why that leaves it whole."""
    collectives: tuple[Collective, ...]
    """What its forward ran (its drawn submodules' own left out), after it in the drawing."""
    bytes_per_rank: int
    """Bytes of its parameters one rank holds, its like modules together."""
    bytes_total: int
    """The same unsharded."""
    copies: int = 1
    """How many modules of one block the box stands for (8 experts' `w1`)."""


@dataclass(frozen=True)
class Region:
    """A DTensor region: a module whose own code runs on DTensors (the plan's `regions`)."""

    name: str
    """Its name under the block, as `Layer.name`."""
    reason: str


@dataclass(frozen=True)
class Group:
    """A block drawn once for every block the plan treats alike, or the outside modules."""

    name: str
    """The block's pattern (`model.layers.*`), or OUTSIDE."""
    indices: tuple[int, ...]
    """The layer indices of the blocks it stands for (empty for OUTSIDE)."""
    stack_size: int
    """How many blocks the stack holds (a stack the plan treats in two ways is two groups)."""
    layers: tuple[Layer, ...]
    regions: tuple[Region, ...]
    own_collectives: tuple[Collective, ...]
    """What one block's own code ran outside its drawn layers (a region's gathers, say)."""
    bytes_per_rank: int
    """Parameter bytes of one block on one rank (for OUTSIDE, of all its modules)."""
    bytes_total: int


@dataclass(frozen=True)
class Picture:
    """A plan on a model at one tp size, as `tpplan show` draws it."""

    model: str
    """The model's class name."""
    tp_size: int
    groups: tuple[Group, ...]
    """In the order the forward reaches them."""
    bytes_per_rank: int
    """Parameter bytes one rank holds once the plan is applied (as `plan_stats` counts)."""
    bytes_total: int
    """Parameter bytes of the unsharded model."""
    note: str | None = None
    """Why the collectives are not drawn, where the forward could not be run to count them."""

    @property
    def fraction(self) -> float:
        """Parameters per rank as a fraction of the unsharded model."""
        return self.bytes_per_rank / max(1, self.bytes_total)
