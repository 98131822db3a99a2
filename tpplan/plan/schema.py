"""The plan schema: pydantic models of a tensor-parallel plan, and its YAML/JSON forms.

Start at `Plan`. A plan is an ordered list of rules, each mapping a module-name pattern to
a parallel style, with the layouts it uses and a `why`; each rule is an instance of its
style's class (styles/, on rule.py's `Rule`), read by its `style`. Every field's docstring
becomes its description in the JSON Schema (plans/schema.json, `tpplan schema`: one entry
per style). The checks across a rule's fields are its class's; layouts.py and versions.py
check the rest, messages.py words pydantic's errors and comments.py writes and reads the YAML
with each `why` as a comment. This module imports no torch, so reading,
printing and validating a plan file is instant; tpplan/compile/ turns a plan into torch's
styles, and tpplan/plan/load.py reads plan files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError, model_validator

from ..errors import PlanFileError
from .comments import read_yaml, write_yaml
from .messages import explain
from .rule import STYLE_CLASSES, Rule, Strict, any_rule
from .styles import (
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
from .versions import SCHEMA_VERSION, check_fields_fit_version, version_problem

__all__ = [
    "AnyRule",
    "AttributeRule",
    "ModelInfo",
    "Options",
    "Plan",
    "RegionRule",
    "Rule",
    "plan_json_schema",
]


class ModelInfo(Strict):
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


class Options(Strict):
    """Plan-wide options."""

    loss_parallel: bool = False
    """The output head keeps logits sharded over the vocab; compute the loss inside
    torch.distributed.tensor.parallel.loss_parallel()."""
    sequence_parallel: bool = False
    """Activations between blocks are sharded over the sequence dim (norms and dropout run
    on a sequence shard), trading each all-reduce for a reduce-scatter and an all-gather."""


if TYPE_CHECKING:  # what a plan's rules hold once read: a rule of one of the styles
    AnyRule = (
        ColwiseRule
        | RowwiseRule
        | VocabParallelRule
        | SequenceParallelRule
        | PrepareRule
        | ReplicateRule
        | ReplicateGradSumRule
        | ExpertsRule
        | SplitParamsRule
        | HeadsRule
    )
else:
    AnyRule = any_rule()
"""A rule of a plan, read as its style's class (a union tagged by `style`)."""


class AttributeRule(Strict):
    """Integer attributes divided by the tp size on matched modules after sharding, for
    models whose forward reshapes with stored counts (`view(B, T, self.n_head, hd)`)."""

    match: str = Field(min_length=1)
    """Dotted module-name pattern, as in rules."""
    divide: list[str] = Field(min_length=1)
    """Names of integer attributes to divide by the tp size on every matched module; a dotted
    name (`config.num_attention_heads`) names one of an object the module holds (a config
    the layers share), which the module gets a copy of first, so that other modules still
    read the whole value."""
    by: Literal["tp", "replicas", "shards"] | None = None
    """What the attributes are divided by: the tp size (`tp`, the default); `replicas`, the number of
    ranks sharing each head of the layer `of` (tp / its heads, at least 1: the query heads
    per key head of grouped-query attention, `num_key_value_groups`); `shards`, the number
    of groups its heads are split into (min(tp, its heads): `num_key_value_heads`)."""
    of: str | None = None
    """by replicas or shards: the module, by its dotted name under the matched one, whose
    rule has replicate_heads (`k_proj`); its heads are counted on the model."""
    uneven: str | None = None
    """The query layer, by its dotted name under the matched module, whose heads tp does not
    divide and are split unevenly (its rule: colwise with uneven and head_dim, schema 17).
    Each rank's attributes are then its own: an attribute divided by tp becomes its share of
    the rank's query heads (v x own query heads / all of them), by shards of its key/value
    heads, by replicas the query heads each of its key/value heads serves on it."""

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


class RegionRule(Strict):
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


class Plan(Strict):
    """A tensor-parallel plan: which modules are split how, and why."""

    tpplan: Literal[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18] = (
        18  # SCHEMA_VERSION
    )
    """Schema version of this file (version 1 files are read as they are; writing gives the
    current version)."""
    model: ModelInfo | None = None
    """The model the plan was written for."""
    options: Options = Field(default_factory=Options)
    """Plan-wide options."""
    rules: list[AnyRule] = Field(default_factory=list)
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
            rules=[r.newer_than(self.tpplan) for r in self.rules],
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
    """The JSON Schema of plan files, as checked in under plans/schema.json: a rule is one of
    the styles' entries, picked by its `style` (each with its own fields and their docs)."""
    schema = Plan.model_json_schema(by_alias=True)
    schema["title"] = f"tpplan plan file, schema version {SCHEMA_VERSION}"
    defs = schema["$defs"]
    # the base Rule only reads a rule whose style no class takes, to refuse it: not a choice
    del defs["Rule"]
    mapping = {}
    for name, cls in STYLE_CLASSES.items():
        entry = defs[cls.__name__]
        entry["required"] = sorted({*entry.get("required", ()), "style"})
        mapping[name] = f"#/$defs/{cls.__name__}"
    items = schema["properties"]["rules"]["items"]
    items["oneOf"] = [{"$ref": ref} for ref in mapping.values()]
    items["discriminator"] = {"propertyName": "style", "mapping": mapping}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
