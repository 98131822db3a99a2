"""The five styles that say what torch's own ParallelStyles say: colwise, rowwise,
vocab_parallel, sequence_parallel (each with input and output layouts) and prepare (layouts
alone). The order of the classes here is the order styles are listed in (styles/__init__.py).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from ..layouts import Layout, check_layout, check_layouts, parse_layout
from ..rule import Rule, WeightKind

__all__ = [
    "ColwiseRule",
    "PrepareRule",
    "RowwiseRule",
    "SequenceParallelRule",
    "VocabParallelRule",
]

_Layout = Annotated[Layout, AfterValidator(check_layout)]
"""replicate | partial | shard(DIM)."""


class _Layouts(Rule):
    """The base of the styles that take input and output layouts."""


class ColwiseRule(_Layouts):
    """Split a layer's output features (a Linear's rows, a convolution's output channels,
    an Embedding's features): each rank computes its share of the outputs from the whole
    input, which opens a split the layers after it continue."""

    style: Literal["colwise"] = "colwise"
    input: _Layout | None = None
    """Layout of the input as it arrives (default replicate; shard(1) gathers a
    sequence-split input first)."""
    output: _Layout | None = None
    """Layout the output is turned into (default shard(-1): each rank keeps its features;
    replicate gathers them)."""
    local_output: bool | None = None
    """Hand plain local tensors to the next module (default true; false hands DTensors on,
    to the code of a DTensor region)."""
    head_dim: int | None = Field(default=None, gt=0)
    """The split features are attention heads of this size; every rank must get whole heads,
    so the head count must divide by the tp size. Left out, it is read from the model where
    its forward views the features as heads (schema 12), so that one plan serves every head
    size of a family."""
    replicate_heads: bool | None = None
    """A key or value projection of grouped-query attention: at a tp size that is a multiple
    of its head count, each head goes whole to tp/heads consecutive ranks (the ranks whose
    query heads it serves) instead of tp having to divide the heads. The weight is a DTensor
    on the tp axis viewed as (heads, tp/heads), split over the first and replicated over the
    second, so its full tensor is the original; the gradient of a shared head is summed over
    the ranks that share it. At a tp size dividing the head count the layer is split as plain
    colwise. Its head_dim may be left out (schema 12). With `parts` (q|k|v in one Linear),
    each part of fewer whole heads than ranks (the keys', the values') is shared so, and the
    others split as parts are: the weight stays a plain shard of the original, and each rank
    computes with a copy of its own rows (its query heads, its key/value head). With
    `local_output: false` (inside a DTensor region, schema 18), the region's code sees the
    layer's whole output, every head's place holding the rank's own head: a region whose
    code reads only the head its query heads use, which check proves on fake ranks at a tp
    size of one head per rank."""
    parts: list[Annotated[int, Field(gt=0)]] | None = Field(default=None, min_length=2)
    """The output features are several tensors laid end to end (fused q|k|v, or gate|up), of
    these sizes in order. Each part is split across the ranks on its own, and a rank holds
    its slice of every part, in order, so it gets its own q, k and v heads (or its gate slice
    and the matching up slice) rather than a contiguous slice that mixes them. Left out, it
    is read from the model where its forward cuts the features into pieces (schema 12)."""
    transposed: bool | None = None
    """The weight is stored (in_features, out_features), as in GPT-2's Conv1D, so the split
    is of its dim 1."""
    uneven: bool | None = None
    """The output features need not divide by the tp size. With output replicate (gathered
    right after, so what follows sees the unsplit output: GPT-2's vocab of 50257), the ranks
    hold DTensor's shares of them (torch.chunk's sizes, the first ranks ceil(n/tp) each and
    the last ranks what is left). With head_dim (schema 17), the features are heads tp does
    not divide (28 query heads at tp 8): each rank takes whole heads, as evenly as they go,
    of its own key/value heads (`group`), and computes with a copy of their rows; the weight
    stays a plain shard of the original. Either way the full tensor is the original. Without
    it, a size tp does not divide is refused."""
    group: int | None = Field(default=None, gt=0)
    """With uneven heads: the query heads one key/value head serves (grouped-query
    attention's num_attention_heads / num_key_value_heads; 1, the default, for key/value
    layers and attention without grouping). Ranks take whole groups while there are at least
    as many as ranks; past that each key/value head is shared (its layer's rule says
    replicate_heads) and its group's query heads split among the ranks sharing it (schema 17)."""

    field_since: ClassVar[dict[str, int]] = {
        "parts": 2,
        "transposed": 2,
        "replicate_heads": 11,
        "uneven": 14,
        "group": 17,
    }
    sized: ClassVar[bool] = True

    @model_validator(mode="after")
    def _check(self) -> ColwiseRule:
        if "partial" in (self.input, self.output):
            raise ValueError(
                "style 'colwise' cannot take or give layout 'partial'; use replicate or shard(DIM)."
            )
        # its head_dim may be left out: the check reads it from the model (check/complete.py)
        given = self.model_fields_set
        if self.replicate_heads and any(
            f in given and getattr(self, f) for f in ("transposed", "output")
        ):
            raise ValueError(
                "colwise with replicate_heads (whole key/value heads shared among ranks) takes "
                "no transposed or output."
            )
        heads = self.uneven and self.head_dim is not None and self.output != "replicate"
        if (
            self.uneven
            and not heads
            and (self.output != "replicate" or self.parts or self.replicate_heads)
        ):
            raise ValueError(
                "colwise with uneven splits features tp need not divide, which only a layer "
                "whose output is gathered right after can take (output: replicate, no parts "
                "or replicate_heads), or heads of a head_dim: the layers after it see the "
                "unsplit output, or whole heads."
            )
        _check_uneven_heads(self, bool(heads))
        return self

    def omissions(self, given: Collection[str]) -> list[tuple[int, str]]:
        # version 12 reads the sizes a rule leaves out from the model; its files are refused
        # by a tpplan that would shard a fused layer without its parts
        out = []
        if "replicate_heads" in given and "head_dim" not in given:
            out.append((12, "replicate_heads without head_dim"))
        if self.replicate_heads and self.parts and "parts" in given:
            # a tpplan before 15 would refuse it: shared heads took no fused pieces
            out.append((15, "replicate_heads with parts"))
        if self.local_output is False and "parts" in given and len(set(self.parts or ())) > 1:
            # a tpplan before 16 would refuse it: a DTensor region took fused pieces of one
            # size only
            out.append((16, "local_output: false with parts of unequal sizes"))
        if self.replicate_heads and self.local_output is False and "local_output" in given:
            # a tpplan before 18 would refuse it: shared heads handed on no DTensors
            out.append((18, "replicate_heads with local_output: false"))
        if self.uneven_group() is not None and "uneven" in given:
            # a tpplan before 17 would refuse it: uneven took gathered outputs only
            out.append((17, "uneven with head_dim (heads split unevenly)"))
        return out

    def splits_unevenly(self) -> bool:
        return bool(self.uneven) and self.uneven_group() is None

    def uneven_group(self) -> int | None:
        if self.uneven and self.head_dim is not None and self.output != "replicate":
            return self.group or 1
        return None

    def may_split_unevenly(self) -> bool:
        # only where gathered right after (its own _check refuses the rest)
        return self.output == "replicate" and not self.parts and not self.replicate_heads

    def weight_dim(self, kind: WeightKind) -> int | None:
        if kind == "embedding":
            return 1
        return 1 if self.transposed and kind == "linear" else 0

    def bias_dim(self, kind: WeightKind) -> int | None:
        return None if kind == "embedding" else 0

    def input_layout(self) -> str | None:
        return self.input or "replicate"

    def output_layout(self) -> str | None:
        return self.output or "shard(-1)"

    def opens_split(self) -> bool:
        return parse_layout(self.output_layout() or "")[0] == "shard"

    def lora_split(self, role: str) -> bool:
        return role == "b"  # lora_B's output is added to this layer's split output

    def needs_head_dim(self) -> bool:
        return bool(self.replicate_heads) and self.head_dim is None

    def head_size(self) -> int | None:
        return self.head_dim

    def part_sizes(self) -> list[int] | None:
        return self.parts

    def stored_transposed(self) -> bool:
        return bool(self.transposed)

    def shares_heads(self) -> bool:
        return bool(self.replicate_heads)

    def model_sizes(self, *, in_region: bool, stated: bool) -> list[tuple[str, str | None]]:
        out = _head_dim_size(self, in_region=in_region, stated=stated)
        # pieces left out in a DTensor region mean a contiguous cut, which check proves or
        # refuses; a layer sharing whole heads among ranks takes none
        if not self.replicate_heads and (not in_region or (stated and self.parts is not None)):
            out.append(("parts", None))
        return out


class RowwiseRule(_Layouts):
    """Split a layer's input features (a Linear's columns, a convolution's input
    channels): each rank contracts its share of the features, and one all-reduce sums the
    partial outputs, which closes the split the layers before it opened."""

    style: Literal["rowwise"] = "rowwise"
    input: _Layout | None = None
    """Layout of the input as it arrives (default shard(-1): the features the layers before
    it split)."""
    output: _Layout | None = None
    """Layout the output is turned into (default replicate, an all-reduce; shard(1)
    reduce-scatters over the sequence; partial leaves the sum to a later layer)."""
    local_output: bool | None = None
    """Hand plain local tensors to the next module (default true)."""
    head_dim: int | None = Field(default=None, gt=0)
    """The split input features are attention heads of this size: every rank must get whole
    heads. Left out, it is read from the model (schema 12)."""
    parts: list[Annotated[int, Field(gt=0)]] | None = Field(default=None, min_length=2)
    """The input features are pieces of one size laid end to end (attention heads and MLP
    features joined by `cat` before one projection, Flux's single-stream `proj_out`), and
    each rank contracts its slice of every piece (schema 9)."""
    transposed: bool | None = None
    """The weight is stored (in_features, out_features), as in GPT-2's Conv1D, so the split
    is of its dim 0."""
    uneven: bool | None = None
    """With head_dim: the input features are heads tp does not divide, split as the colwise
    layers opening them split theirs (whole heads per rank, as evenly as they go, `group`);
    each rank contracts a copy of its heads' columns, and the weight stays a plain shard of
    the original (schema 17)."""
    group: int | None = Field(default=None, gt=0)
    """With uneven: the query heads one key/value head serves, as on the colwise query
    layer's rule (1, the default, without grouping)."""

    field_since: ClassVar[dict[str, int]] = {
        "parts": 2,
        "transposed": 2,
        "uneven": 17,
        "group": 17,
    }
    sized: ClassVar[bool] = True
    style_field_since: ClassVar[dict[str, int]] = {"parts": 9}

    @model_validator(mode="after")
    def _check(self) -> RowwiseRule:
        if self.parts and len(set(self.parts)) != 1:
            raise ValueError(
                f"style 'rowwise' takes parts of one size only (each rank contracts its slice "
                f"of every piece, a layout only equal pieces have); {list(self.parts)} are not. "
                "Give the pieces as equal ones (64 and 256 are 5 pieces of 64), or drop parts."
            )
        if self.uneven and self.head_dim is None:
            raise ValueError(
                "rowwise with uneven takes heads tp does not divide, so it needs their "
                "head_dim; add head_dim to the rule."
            )
        _check_uneven_heads(self, bool(self.uneven))
        return self

    def uneven_group(self) -> int | None:
        return (self.group or 1) if self.uneven else None

    def weight_dim(self, kind: WeightKind) -> int | None:
        if kind == "embedding":
            return 0
        return 0 if self.transposed and kind == "linear" else 1

    def input_layout(self) -> str | None:
        return self.input or "shard(-1)"

    def output_layout(self) -> str | None:
        return self.output or "replicate"

    def closes_split(self) -> bool:
        return parse_layout(self.input_layout() or "")[0] == "shard"

    def lora_split(self, role: str) -> bool:
        return role == "a"  # lora_A contracts the same split input, a partial sum

    def model_sizes(self, *, in_region: bool, stated: bool) -> list[tuple[str, str | None]]:
        return _head_dim_size(self, in_region=in_region, stated=stated)

    def head_size(self) -> int | None:
        return self.head_dim

    def part_sizes(self) -> list[int] | None:
        return self.parts

    def stored_transposed(self) -> bool:
        return bool(self.transposed)


def _check_uneven_heads(rule: ColwiseRule | RowwiseRule, heads: bool) -> None:
    """Heads split unevenly (`uneven` with head_dim) run on local shards, of the layer's
    own rows: a group only with them, and no fused parts, DTensor outputs or layouts."""
    name = rule.style
    if rule.group is not None and not heads:
        raise ValueError(
            f"{name} takes group with uneven heads only (uneven: true and head_dim); drop "
            "group, or add them."
        )
    if heads and (
        (rule.parts and isinstance(rule, RowwiseRule))
        or rule.local_output is False
        or rule.input is not None
        or (rule.output is not None and isinstance(rule, ColwiseRule))
        or (isinstance(rule, RowwiseRule) and rule.output not in (None, "replicate"))
        or getattr(rule, "replicate_heads", None)
    ):
        raise ValueError(
            f"{name} with uneven heads computes whole heads of its own rows on local shards, "
            "so it takes no input or output layouts, replicate_heads or local_output: false "
            "(nor parts, rowwise); drop them, or uneven."
        )


def _head_dim_size(
    rule: ColwiseRule | RowwiseRule, *, in_region: bool, stated: bool
) -> list[tuple[str, str | None]]:
    """A split layer's head_dim, where check reads it from the model: where the split opens
    or closes on local shards (inside a DTensor region the plan states its sizes: nothing
    there needs one), or where the rule states one."""
    local = (rule.opens_split() or rule.closes_split()) and not in_region
    return [("head_dim", None)] if local or (stated and rule.head_dim is not None) else []


class VocabParallelRule(_Layouts):
    """Split an embedding's rows (the vocab): each rank looks up the ids in its own rows,
    zeros for the others, and one sum gives every rank the whole rows."""

    style: Literal["vocab_parallel"] = "vocab_parallel"
    input: _Layout | None = None
    """Layout of the token ids as they arrive (default replicate)."""
    output: _Layout | None = None
    """Layout the rows are turned into (default replicate, an all-reduce; shard(1)
    reduce-scatters over the sequence)."""
    local_output: bool | None = None
    """Hand plain local tensors to the next module (default true)."""
    sum_at: Literal["lookup"] | None = None
    """Where each rank's partial rows are summed. By default at the module's output, after its
    forward. `lookup`: right where nn.Embedding's own lookup hands them back, inside the
    forward of an Embedding subclass that goes on to do with the rows what is not linear in
    them (a norm, rows overwritten), so the rest of its forward sees whole rows; its output
    is then whole and plain."""
    uneven: bool | None = None
    """The vocab (the rows) need not divide by the tp size (GPT-2's vocab of 50257): the ranks hold
    DTensor's shares of them (torch.chunk's sizes, the first ranks ceil(n/tp) each and the last ranks
    what is left), and the full tensor is the original. Without it, a size tp does not divide
    is refused."""
    written: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    """Parameters of the module (by their own names) that its forward writes over some of the
    looked-up rows, as they are (`rows[ids == eoi] = self.eoi_embedding`). Each is split
    along its last dim (the rows' features). The forward then runs on each rank's partial
    rows as plain tensors, each rank writing its share of such a parameter padded with
    zeros, so the one sum as the forward returns (an all-reduce, or a reduce-scatter with
    output shard(1)) adds up the whole parameter where it was written."""

    field_since: ClassVar[dict[str, int]] = {"sum_at": 6, "written": 7, "uneven": 14}

    @model_validator(mode="after")
    def _check(self) -> VocabParallelRule:
        whole_in = (self.input or "replicate") == "replicate"
        if self.sum_at is not None and (
            not whole_in
            or (self.output or "replicate") != "replicate"
            or self.local_output is False
        ):
            raise ValueError(
                "vocab_parallel with sum_at: lookup takes the token ids as they are and sums "
                "the rows inside the module's forward, so its input and output are whole, plain "
                "tensors; drop input, output and local_output, or drop sum_at."
            )
        if self.written is not None and (
            self.sum_at is not None or not whole_in or self.output == "partial"
        ):
            raise ValueError(
                "vocab_parallel with written takes the token ids as they are and sums the "
                "rows as its forward returns (output replicate or shard(DIM)); drop sum_at, "
                "input and output partial, or drop written."
            )
        return self

    def splits_unevenly(self) -> bool:
        return bool(self.uneven)

    def may_split_unevenly(self) -> bool:
        return True

    def weight_dim(self, kind: WeightKind) -> int | None:
        return 0 if kind == "embedding" else None

    def input_layout(self) -> str | None:
        return self.input or "replicate"

    def output_layout(self) -> str | None:
        return self.output or "replicate"


class SequenceParallelRule(_Layouts):
    """Run a module (a norm, dropout) on each rank's share of the sequence, between the
    blocks whose collectives reduce-scatter into it and all-gather out of it."""

    style: Literal["sequence_parallel"] = "sequence_parallel"
    input: _Layout | None = None
    """The sequence dim, as shard(DIM) (default shard(1))."""
    local_output: bool | None = None
    """Hand plain local tensors to the next module (default false: the stream stays a
    DTensor)."""

    def input_layout(self) -> str | None:
        return self.input or "shard(1)"

    @model_validator(mode="after")
    def _check(self) -> SequenceParallelRule:
        if self.input is not None and parse_layout(self.input)[0] != "shard":
            raise ValueError(
                f"sequence_parallel needs input shard(DIM) naming the sequence dim, not "
                f"'{self.input}'."
            )
        return self


_LayoutList = list[Layout | None]  # each checked by PrepareRule._layouts


class PrepareRule(Rule):
    """Redistribute a module's inputs or outputs (torch's PrepareModuleInput/Output): each
    pair of lists says the layouts as they arrive and as they are wanted, in order."""

    style: Literal["prepare"] = "prepare"
    local_output: bool | None = None
    """Hand plain local tensors on from the outputs (default false)."""
    inputs: _LayoutList | None = None
    """Layouts of the positional inputs as they arrive (null: not a tensor, left alone)."""
    desired_inputs: _LayoutList | None = None
    """Layouts the positional inputs are redistributed to."""
    input_kwargs: dict[str, Layout] | None = None
    """Layouts of keyword inputs as they arrive."""
    desired_input_kwargs: dict[str, Layout] | None = None
    """Layouts the keyword inputs are redistributed to."""
    outputs: _LayoutList | None = None
    """Layouts of the outputs as they leave the module."""
    desired_outputs: _LayoutList | None = None
    """Layouts the outputs are redistributed to."""
    local_input: bool | None = None
    """Hand the module plain local tensors instead of DTensors (default false)."""

    @field_validator(
        "inputs",
        "desired_inputs",
        "outputs",
        "desired_outputs",
        "input_kwargs",
        "desired_input_kwargs",
    )
    @classmethod
    def _layouts(cls, v: object) -> object:
        return check_layouts(v)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _check(self) -> PrepareRule:
        given = 0
        for have, want in (
            ("inputs", "desired_inputs"),
            ("input_kwargs", "desired_input_kwargs"),
            ("outputs", "desired_outputs"),
        ):
            a, b = getattr(self, have), getattr(self, want)
            if a is None and b is None:
                continue
            if a is None or b is None:
                raise ValueError(
                    f"prepare needs both {have} and {want} (as they arrive, as wanted); only "
                    f"{have if a is not None else want} is given."
                )
            given += 1
            if len(a) != len(b) or (isinstance(a, dict) and a.keys() != b.keys()):
                raise ValueError(f"prepare: {have} and {want} must name the same inputs.")
        if not given:
            raise ValueError(
                "prepare needs at least one pair of layouts: inputs/desired_inputs, "
                "input_kwargs/desired_input_kwargs or outputs/desired_outputs."
            )
        return self
