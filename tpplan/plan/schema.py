"""The plan schema: pydantic models of a tensor-parallel plan, and its YAML/JSON forms.

Start at `Plan`. A plan is an ordered list of `Rule`s, each mapping a module-name pattern to
a parallel style, with the layouts it uses and a `why`. Every field's docstring becomes its
description in the JSON Schema (plans/schema.json, `tpplan schema`). The checks the models
run are plain functions elsewhere in this package: styles.py (a rule's fields against its
style), layouts.py, versions.py; messages.py words pydantic's errors and comments.py writes
and reads the YAML with each `why` as a comment. This module imports no torch, so reading,
printing and validating a plan file is instant; tpplan/compile/ turns a plan into torch's
styles, and tpplan/plan/load.py reads plan files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import PlanFileError
from .comments import read_yaml, write_yaml
from .layouts import Layout, check_layout, check_layouts
from .messages import explain
from .styles import Style, check_fields_fit_style, check_style
from .versions import SCHEMA_VERSION, check_fields_fit_version, version_problem

__all__ = [
    "AttributeRule",
    "ModelInfo",
    "Options",
    "Plan",
    "RegionRule",
    "Rule",
    "plan_json_schema",
]


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, use_attribute_docstrings=True
    )


class ModelInfo(_Strict):
    """Which model the plan was written for."""

    class_: str = Field(alias="class")
    """The model's class name, e.g. LlamaForCausalLM."""
    fingerprint: str | None = None
    """sha256 over the model's parameter names and shapes; when set, applying the plan to a
    model with other names or shapes is refused. Delete it to use the plan for any model
    whose module names match (e.g. other sizes of one family)."""
    parameters: dict[str, str] | None = None
    """Parameter shapes, collapsed over repeated layers ("(64, 128) x2"); used only to say
    what differs when the fingerprint does not match."""
    command: str | None = None
    """The command that inferred this plan (`tpplan infer MODEL ...`). Rerun it to see
    whether tpplan still infers the same plan; the shipped plans are tested that way."""


class Options(_Strict):
    """Plan-wide options."""

    loss_parallel: bool = False
    """The output head keeps logits sharded over the vocab; compute the loss inside
    torch.distributed.tensor.parallel.loss_parallel()."""
    sequence_parallel: bool = False
    """Activations between blocks are sharded over the sequence dim (norms and dropout run
    on a sequence shard), trading each all-reduce for a reduce-scatter and an all-gather."""


class Rule(_Strict):
    """One pattern -> style mapping, with the layouts it uses and the reason for it."""

    match: str = Field(min_length=1)
    """Dotted module-name pattern; each segment is an fnmatch pattern over one child name
    (`model.layers.*.mlp.up_proj`), exactly as parallelize_module matches."""
    style: Style
    """colwise | rowwise | vocab_parallel | sequence_parallel | prepare | replicate |
    replicate_grad_sum | experts | split_params | heads."""
    why: str = Field(min_length=1)
    """The evidence for this rule, in words a reviewer can check."""
    input: Layout | None = None
    """Layout of the module's input as it arrives (colwise default replicate, rowwise
    default shard(-1), vocab_parallel default replicate, sequence_parallel default shard(1))."""
    output: Layout | None = None
    """Layout the output is turned into (colwise default shard(-1), replicate gathers it;
    rowwise and vocab_parallel default replicate, an all-reduce; shard(1) reduce-scatters
    over the sequence)."""
    local_output: bool | None = None
    """Hand plain local tensors to the next module (default true, false for
    sequence_parallel and prepare inputs)."""
    head_dim: int | None = Field(default=None, gt=0)
    """The sharded features are attention heads of this size; every rank must get whole
    heads, so the head count must divide by the tp size. Left out, it is read from the
    model where its forward views the features as heads (schema 12), so that one plan
    serves every head size of a family."""
    replicate_heads: bool | None = None
    """colwise with head_dim (a key or value projection of grouped-query attention): at a tp
    size that is a multiple of its head count, each head goes whole to tp/heads consecutive
    ranks (the ranks whose query heads it serves) instead of tp having to divide the heads.
    The weight is a DTensor on the tp axis viewed as (heads, tp/heads), split over the first
    and replicated over the second, so its full tensor is the original; the gradient of a
    shared head is summed over the ranks that share it. At a tp size dividing the head count
    the layer is split as plain colwise. Its head_dim may be left out (schema 12)."""
    parts: list[Annotated[int, Field(gt=0)]] | None = Field(default=None, min_length=2)
    """colwise: the output features are several tensors laid end to end (fused q|k|v, or
    gate|up), of these sizes in order. Each part is split across the ranks on its own, and a
    rank holds its slice of every part, in order, so it gets its own q, k and v heads (or its
    gate slice and the matching up slice) rather than a contiguous slice that mixes them.
    rowwise: the input features are such pieces, all of one size (attention heads and MLP
    features joined by `cat` before one projection, Flux's single-stream `proj_out`), and
    each rank contracts its slice of every piece. Left out on a colwise layer, it is read
    from the model where its forward cuts the features into pieces (schema 12)."""
    transposed: bool | None = None
    """The weight is stored (in_features, out_features), as in GPT-2's Conv1D, so colwise
    splits its dim 1 and rowwise its dim 0."""
    inputs: list[Layout | None] | None = None
    """prepare: layouts of the positional inputs as they arrive (null: not a tensor, left alone)."""
    desired_inputs: list[Layout | None] | None = None
    """prepare: layouts the positional inputs are redistributed to."""
    input_kwargs: dict[str, Layout] | None = None
    """prepare: layouts of keyword inputs as they arrive."""
    desired_input_kwargs: dict[str, Layout] | None = None
    """prepare: layouts the keyword inputs are redistributed to."""
    outputs: list[Layout | None] | None = None
    """prepare: layouts of the outputs as they leave the module."""
    desired_outputs: list[Layout | None] | None = None
    """prepare: layouts the outputs are redistributed to."""
    local_input: bool | None = None
    """prepare: hand the module plain local tensors instead of DTensors (default false)."""
    mode: Literal["tensor", "expert"] | None = None
    """experts: `tensor` (default) splits every expert's own weights like a dense MLP
    (gate/up by output features, down by input features) and sums the experts' partial
    outputs with one all-reduce; `expert` gives each rank num_experts/tp whole experts, each
    rank computes the tokens routed to its own experts, and one all-reduce sums them."""
    shard: dict[str, Annotated[int, Field(ge=0)]] | None = None
    """experts, split_params: parameter of the matched module (by its own name; for experts
    also a child's, by its dotted name under the module) -> the dim it is split on; for
    experts, the module's other parameters are replicated. split_params
    splits parameters used element by element on split features (one attention sink per
    head): each rank holds, and its forward uses, its own contiguous share."""
    fused: dict[str, list[Annotated[int, Field(gt=0)]]] | None = None
    """experts: parameter -> sizes of the pieces laid end to end along its split dim (gate|up);
    each rank holds its slice of every piece, as `parts` does for colwise. A parameter left
    out is read from the model where its forward cuts it into pieces (schema 12)."""
    after_sum: list[str] | None = None
    """experts, mode tensor: parameters added to the experts' output after the down
    projection's partial sum (its bias): each rank adds its 1/tp share, so the all-reduce
    adds it once."""
    added_whole: list[str] | None = None
    """experts, mode tensor: submodules of the matched module (by their dotted names under
    it) whose output its forward adds whole to the experts' partial sums, made the same on
    every rank without the split weights (an identity expert passing its tokens through):
    each rank scales their output by 1/tp, so the all-reduce adds it once."""
    sum_at: Literal["lookup"] | None = None
    """vocab_parallel: where each rank's partial rows are summed. By default at the module's
    output, after its forward. `lookup`: right where nn.Embedding's own lookup hands them
    back, inside the forward of an Embedding subclass that goes on to do with the rows what
    is not linear in them (a norm, rows overwritten), so the rest of its forward sees whole
    rows; its output is then whole and plain."""
    written: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    """vocab_parallel: parameters of the module (by their own names) that its forward writes
    over some of the looked-up rows, as they are (`rows[ids == eoi] = self.eoi_embedding`).
    Each is split along its last dim (the rows' features). The forward then runs on each
    rank's partial rows as plain tensors, each rank writing its share of such a parameter
    padded with zeros, so the one sum as the forward returns (an all-reduce, or a
    reduce-scatter with output shard(1)) adds up the whole parameter where it was written."""

    # Each check is a plain function (styles.py, layouts.py); these only hand them the fields.
    @field_validator("style", mode="before")
    @classmethod
    def _known_style(cls, v: Any) -> Any:
        return check_style(v)

    @field_validator("input", "output")
    @classmethod
    def _layout(cls, v: Any) -> Any:
        return check_layout(v)

    @field_validator(
        "inputs",
        "desired_inputs",
        "outputs",
        "desired_outputs",
        "input_kwargs",
        "desired_input_kwargs",
    )
    @classmethod
    def _layouts(cls, v: Any) -> Any:
        return check_layouts(v)

    @model_validator(mode="after")
    def _fields_fit_style(self) -> Rule:
        check_fields_fit_style(self.style, {k: getattr(self, k) for k in self.model_fields_set})
        return self


class AttributeRule(_Strict):
    """Integer attributes divided by the tp size on matched modules after sharding, for
    models whose forward reshapes with stored counts (`view(B, T, self.n_head, hd)`)."""

    match: str = Field(min_length=1)
    """Dotted module-name pattern, as in rules."""
    divide: list[str] = Field(min_length=1)
    """Names of integer attributes to divide by the tp size on every matched module."""
    by: Literal["tp", "replicas", "shards"] | None = None
    """What the attributes are divided by: the tp size (`tp`, the default); `replicas`, the number of
    ranks sharing each head of the layer `of` (tp / its heads, at least 1: the query heads
    per key head of grouped-query attention, `num_key_value_groups`); `shards`, the number
    of groups its heads are split into (min(tp, its heads): `num_key_value_heads`)."""
    of: str | None = None
    """by replicas or shards: the module, by its dotted name under the matched one, whose
    rule has replicate_heads (`k_proj`); its heads are counted on the model."""

    @model_validator(mode="after")
    def _of_fits_by(self) -> AttributeRule:
        by_tp = self.by in (None, "tp")
        if by_tp != (self.of is None):
            raise ValueError(
                f"attributes: by {self.by or 'tp'} {'takes no' if by_tp else 'needs'} of; "
                "by replicas or shards names the layer whose heads are shared (of: k_proj)."
            )
        return self

    why: str = Field(min_length=1)
    """Which reshape reads them."""


class RegionRule(_Strict):
    """A module whose forward runs on DTensors: the split layers inside it hand DTensors on
    (their rules say `local_output: false`) instead of local shards, so its own code sees
    global shapes, and DTensor's sharding propagation carries the split through its views,
    rotary embeddings and attention to the rowwise layers that end it. Plain tensors it meets
    (rotary tables, masks) are whole on every rank and are treated as replicated."""

    match: str = Field(min_length=1)
    """Dotted module-name pattern, as in rules."""
    why: str = Field(min_length=1)
    """The evidence: which layers open and close the split, and what the proof run saw."""
    stream: bool = False
    """A module of the sequence-parallel stream rather than a split region: its own code
    meets the sequence-split stream (a DTensor) with whole tensors, which are lifted the same
    way. Collectives inside it (its submodules gathering their inputs) are expected, so
    `check` does not hold it to running without them."""


class Plan(_Strict):
    """A tensor-parallel plan: which modules are split how, and why."""

    tpplan: Literal[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] = 12  # SCHEMA_VERSION
    """Schema version of this file (version 1 files are read as they are; writing gives the
    current version)."""
    model: ModelInfo | None = None
    """The model the plan was written for."""
    options: Options = Field(default_factory=Options)
    """Plan-wide options."""
    rules: list[Rule] = Field(default_factory=list)
    """Pattern -> style rules; a module may be matched by one rule only."""
    attributes: list[AttributeRule] = Field(default_factory=list)
    """Attribute fixes applied after sharding."""
    regions: list[RegionRule] = Field(default_factory=list)
    """Modules whose forward runs on DTensor activations (schema 8; rowwise `parts`,
    schema 9)."""

    @model_validator(mode="after")
    def _fields_fit_version(self) -> Plan:
        check_fields_fit_version(
            self.tpplan,
            model_fields=self.model.model_fields_set if self.model is not None else (),
            rules=[(r.style, r.model_fields_set) for r in self.rules],
            regions=bool(self.regions),
            attributes=[a.model_fields_set for a in self.attributes],
        )
        return self

    # ---- reading -----------------------------------------------------------------------
    @classmethod
    def from_data(cls, data: Any, *, source: str = "plan", text: str | None = None) -> Plan:
        """Validate parsed YAML/JSON data; every problem is reported at once."""
        if not isinstance(data, dict):
            raise PlanFileError(
                source,
                [
                    f"a plan is a mapping with keys tpplan, model, options, rules; got {type(data).__name__}."
                ],
            )
        problem = version_problem(data)
        if problem is not None:
            raise PlanFileError(source, [problem])
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise PlanFileError(source, explain(e, text)) from None

    @classmethod
    def from_yaml(cls, text: str, *, source: str = "plan") -> Plan:
        """Parse a plan from YAML (JSON is YAML too); each rule's `why` may be the comment
        above it."""
        return cls.from_data(read_yaml(text, source=source), source=source, text=text)

    @classmethod
    def from_json(cls, text: str, *, source: str = "plan") -> Plan:
        """Parse a plan from JSON."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanFileError(
                source, [f"line {e.lineno}, column {e.colno}: malformed JSON: {e.msg}."]
            ) from None
        return cls.from_data(data, source=source)

    # ---- writing -----------------------------------------------------------------------
    def to_data(self) -> dict[str, Any]:
        """Plain data in the file's fixed key order, without unset optional fields."""
        data = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        for key in ("attributes", "regions"):
            if not data[key]:
                del data[key]
        return data

    def to_yaml(self) -> str:
        """YAML text, each rule's `why` a comment above it; byte-stable:
        from_yaml(p.to_yaml()).to_yaml() == p.to_yaml()."""
        return write_yaml(self.to_data())

    def to_json(self) -> str:
        """JSON text with the same key order as the YAML form."""
        return json.dumps(self.to_data(), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        """Write the plan; `.json` files get JSON, anything else YAML."""
        path = Path(path)
        path.write_text(
            self.to_json() if path.suffix == ".json" else self.to_yaml(), encoding="utf-8"
        )


def plan_json_schema() -> dict[str, Any]:
    """The JSON Schema of plan files, as checked in under plans/schema.json."""
    schema = Plan.model_json_schema(by_alias=True)
    schema["title"] = f"tpplan plan file, schema version {SCHEMA_VERSION}"
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
