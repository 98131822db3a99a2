"""The plan file: pydantic models for a tensor-parallel plan, and its YAML/JSON forms.

Start at `Plan`. A plan is an ordered list of `Rule`s, each mapping a module-name pattern to
a parallel style, with the layouts it uses and a `why`. This module imports no torch, so
reading, printing and validating a plan file is instant; tpplan/compile/ turns a plan into
torch's styles.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import PlanFileError, did_you_mean

__all__ = [
    "SCHEMA_VERSION",
    "STYLES",
    "AttributeRule",
    "ModelInfo",
    "Options",
    "Plan",
    "Rule",
    "load_plan",
    "parse_layout",
    "plan_json_schema",
]

SCHEMA_VERSION = 7
# Older versions whose files this tpplan still reads unchanged (each is a subset of the next).
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
# What each version added: a file naming any of these needs at least that version.
_ADDED_FIELDS = {
    2: ("parts", "transposed"),
    3: ("mode", "shard", "fused", "after_sum"),
    5: ("added_whole",),
    6: ("sum_at",),
    7: ("written",),
}
_ADDED_STYLES = {3: ("experts",), 4: ("split_params",)}
_ADDED_MODEL_FIELDS = {4: ("command",)}

Style = Literal[
    "colwise",
    "rowwise",
    "vocab_parallel",
    "sequence_parallel",
    "prepare",
    "replicate",
    "replicate_grad_sum",
    "experts",
    "split_params",
]
STYLES: tuple[str, ...] = Style.__args__  # type: ignore[attr-defined]

# Which optional fields each style accepts; anything else on a rule of that style is an error.
_STYLE_FIELDS: dict[str, frozenset[str]] = {
    "colwise": frozenset({"input", "output", "local_output", "head_dim", "parts", "transposed"}),
    "rowwise": frozenset({"input", "output", "local_output", "head_dim", "transposed"}),
    "vocab_parallel": frozenset({"input", "output", "local_output", "sum_at", "written"}),
    "sequence_parallel": frozenset({"input", "local_output"}),
    "prepare": frozenset(
        {
            "inputs",
            "desired_inputs",
            "input_kwargs",
            "desired_input_kwargs",
            "outputs",
            "desired_outputs",
            "local_input",
            "local_output",
        }
    ),
    "replicate": frozenset(),
    "replicate_grad_sum": frozenset(),
    "experts": frozenset({"mode", "shard", "fused", "after_sum", "added_whole"}),
    "split_params": frozenset({"shard"}),
}

_LAYOUT_RE = re.compile(r"^(replicate|partial|shard\((-?\d+)\))$")
LAYOUT_HELP = "replicate, partial, or shard(DIM) with DIM an integer such as shard(-1) or shard(1)"


def parse_layout(text: str) -> tuple[str, int | None]:
    """('shard', dim) / ('replicate', None) / ('partial', None) for a valid layout string."""
    m = _LAYOUT_RE.match(text)
    if not m:
        raise ValueError(f"'{text}' is not a layout; layouts are {LAYOUT_HELP}.")
    if m.group(2) is not None:
        return "shard", int(m.group(2))
    return m.group(1), None


def _check_layout(value: Any) -> Any:
    if isinstance(value, str):
        parse_layout(value)
    return value


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


Layout = str
"""replicate | partial | shard(DIM)."""


class Rule(_Strict):
    """One pattern -> style mapping, with the layouts it uses and the reason for it."""

    match: str = Field(min_length=1)
    """Dotted module-name pattern; each segment is an fnmatch pattern over one child name
    (`model.layers.*.mlp.up_proj`), exactly as parallelize_module matches."""
    style: Style
    """colwise | rowwise | vocab_parallel | sequence_parallel | prepare | replicate |
    replicate_grad_sum | experts | split_params."""
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
    heads, so the head count must divide by the tp size."""
    parts: list[Annotated[int, Field(gt=0)]] | None = Field(default=None, min_length=2)
    """colwise: the output features are several tensors laid end to end (fused q|k|v, or
    gate|up), of these sizes in order. Each part is split across the ranks on its own, and a
    rank holds its slice of every part, in order, so it gets its own q, k and v heads (or its
    gate slice and the matching up slice) rather than a contiguous slice that mixes them."""
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
    each rank holds its slice of every piece, as `parts` does for colwise."""
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

    @field_validator("style", mode="before")
    @classmethod
    def _known_style(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in STYLES:
            raise ValueError(
                f"'{v}' is not a style.{did_you_mean(v, STYLES)} Styles: {', '.join(STYLES)}."
            )
        return v

    @field_validator("input", "output")
    @classmethod
    def _layout(cls, v: Any) -> Any:
        return _check_layout(v)

    @field_validator("inputs", "desired_inputs", "outputs", "desired_outputs")
    @classmethod
    def _layout_list(cls, v: Any) -> Any:
        for item in v or ():
            _check_layout(item)
        return v

    @field_validator("input_kwargs", "desired_input_kwargs")
    @classmethod
    def _layout_dict(cls, v: Any) -> Any:
        for item in (v or {}).values():
            _check_layout(item)
        return v

    @model_validator(mode="after")
    def _fields_fit_style(self) -> Rule:
        allowed = _STYLE_FIELDS[self.style]
        given = {k for k in self.model_fields_set if k not in ("match", "style", "why")}
        extra = sorted(given - allowed)
        if extra:
            ok = ", ".join(sorted(allowed)) or "none"
            raise ValueError(
                f"style '{self.style}' takes no {', '.join(extra)}; its optional fields are: {ok}."
            )
        if self.style == "sequence_parallel" and self.input is not None:
            kind, _ = parse_layout(self.input)
            if kind != "shard":
                raise ValueError(
                    f"sequence_parallel needs input shard(DIM) naming the sequence dim, not '{self.input}'."
                )
        if self.style == "prepare":
            _check_prepare(self)
        if self.style == "experts":
            _check_experts(self)
        if self.style == "split_params" and not self.shard:
            raise ValueError(
                "split_params needs shard: {parameter: dim} naming the module's own parameters "
                "it splits (e.g. {sinks: 0})."
            )
        if self.sum_at is not None and (
            (self.input or "replicate") != "replicate"
            or (self.output or "replicate") != "replicate"
            or self.local_output is False
        ):
            raise ValueError(
                "vocab_parallel with sum_at: lookup takes the token ids as they are and sums "
                "the rows inside the module's forward, so its input and output are whole, plain "
                "tensors; drop input, output and local_output, or drop sum_at."
            )
        if self.written is not None and (
            self.sum_at is not None
            or (self.input or "replicate") != "replicate"
            or self.output == "partial"
        ):
            raise ValueError(
                "vocab_parallel with written takes the token ids as they are and sums the "
                "rows as its forward returns (output replicate or shard(DIM)); drop sum_at, "
                "input and output partial, or drop written."
            )
        if self.style == "colwise" and "partial" in (self.input, self.output):
            raise ValueError(
                "style 'colwise' cannot take or give layout 'partial'; use replicate or shard(DIM)."
            )
        return self


def _check_experts(rule: Rule) -> None:
    if not rule.shard:
        raise ValueError(
            "experts needs shard: {parameter: dim} naming the expert weights it splits "
            "(e.g. {gate_up_proj: 1, down_proj: 2} for mode tensor, dim 0 for mode expert)."
        )
    for field in ("fused", "after_sum"):
        named = getattr(rule, field) or ()
        stray = sorted(
            set(named) - set(rule.shard) if field == "fused" else set(named) & set(rule.shard)
        )
        if stray:
            what = "is not in shard" if field == "fused" else "is also in shard"
            raise ValueError(
                f"experts: {field} names {', '.join(stray)}, which {what}; "
                + (
                    "fused pieces are cut along a split dim."
                    if field == "fused"
                    else "a parameter added after the sum is whole on every rank."
                )
            )
    if rule.mode == "expert" and (
        rule.fused or rule.after_sum or rule.added_whole or set(rule.shard.values()) != {0}
    ):
        raise ValueError(
            "experts with mode expert splits every expert weight on dim 0 (the experts) and "
            "takes no fused, after_sum or added_whole; use shard: {name: 0} for each."
        )


def _check_prepare(rule: Rule) -> None:
    pairs = [
        ("inputs", "desired_inputs"),
        ("input_kwargs", "desired_input_kwargs"),
        ("outputs", "desired_outputs"),
    ]
    given = 0
    for have, want in pairs:
        a, b = getattr(rule, have), getattr(rule, want)
        if (a is None) != (b is None):
            raise ValueError(
                f"prepare needs both {have} and {want} (as they arrive, as wanted); only "
                f"{have if a is not None else want} is given."
            )
        if a is not None:
            given += 1
            if len(a) != len(b) or (isinstance(a, dict) and a.keys() != b.keys()):
                raise ValueError(f"prepare: {have} and {want} must name the same inputs.")
    if not given:
        raise ValueError(
            "prepare needs at least one pair of layouts: inputs/desired_inputs, "
            "input_kwargs/desired_input_kwargs or outputs/desired_outputs."
        )


class AttributeRule(_Strict):
    """Integer attributes divided by the tp size on matched modules after sharding, for
    models whose forward reshapes with stored counts (`view(B, T, self.n_head, hd)`)."""

    match: str = Field(min_length=1)
    """Dotted module-name pattern, as in rules."""
    divide: list[str] = Field(min_length=1)
    """Names of integer attributes to divide by the tp size on every matched module."""
    why: str = Field(min_length=1)
    """Which reshape reads them."""


class Plan(_Strict):
    """A tensor-parallel plan: which modules are split how, and why."""

    tpplan: Literal[1, 2, 3, 4, 5, 6, 7] = 7  # SCHEMA_VERSION
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

    @model_validator(mode="after")
    def _fields_fit_version(self) -> Plan:
        for version in sorted({*_ADDED_FIELDS, *_ADDED_MODEL_FIELDS}, reverse=True):
            if self.tpplan >= version:
                break
            newer = [
                f"model.{f}"
                for f in _ADDED_MODEL_FIELDS.get(version, ())
                if self.model is not None and f in self.model.model_fields_set
            ]
            newer += [
                f"rules[{i}].{f}"
                for i, r in enumerate(self.rules)
                for f in _ADDED_FIELDS.get(version, ())
                if f in r.model_fields_set
            ]
            newer += [
                f"rules[{i}].style {r.style}"
                for i, r in enumerate(self.rules)
                if r.style in _ADDED_STYLES.get(version, ())
            ]
            if newer:
                raise ValueError(
                    f"{', '.join(newer)} need schema version {version}; change the first line "
                    f"to 'tpplan: {version}'."
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
        if "tpplan" not in data:
            raise PlanFileError(
                source,
                [
                    f"not a tpplan plan: the top-level key 'tpplan: {SCHEMA_VERSION}' (the schema version) is missing."
                ],
            )
        version = data["tpplan"]
        if version not in READABLE_VERSIONS:
            raise PlanFileError(
                source,
                [
                    f"schema version {version!r} is not one this tpplan reads (it reads versions "
                    f"{', '.join(map(str, READABLE_VERSIONS))}). Upgrade tpplan (pip install -U tpplan) if the file is newer, "
                    "or regenerate it with `tpplan infer`."
                ],
            )
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise PlanFileError(source, _explain(e, text)) from None

    @classmethod
    def from_yaml(cls, text: str, *, source: str = "plan") -> Plan:
        """Parse a plan from YAML (JSON is YAML too)."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            problem = getattr(e, "problem", None) or str(e)
            raise PlanFileError(source, [f"{where}malformed YAML: {problem}."]) from None
        return cls.from_data(_whys_from_comments(data, text), source=source, text=text)

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
        if not data["attributes"]:
            del data["attributes"]
        return data

    def to_yaml(self) -> str:
        """YAML text, each rule's `why` a comment above it; byte-stable:
        from_yaml(p.to_yaml()).to_yaml() == p.to_yaml()."""
        data = self.to_data()
        whys: dict[str, list[str | None]] = {}
        for key in _COMMENTED:
            whys[key] = [
                item.pop("why") if _fits_comment(item["why"]) else None
                for item in data.get(key, [])
            ]
        text = yaml.dump(
            data,
            Dumper=_Dumper,
            sort_keys=False,
            default_flow_style=False,
            width=10_000,
            allow_unicode=True,
        )
        return _with_why_comments(text, whys)

    def to_json(self) -> str:
        """JSON text with the same key order as the YAML form."""
        return json.dumps(self.to_data(), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        """Write the plan; `.json` files get JSON, anything else YAML."""
        path = Path(path)
        path.write_text(self.to_json() if path.suffix == ".json" else self.to_yaml())


class _Dumper(yaml.SafeDumper):
    """Block style with lists indented under their key; lists of layouts stay on one line."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flat = all(not isinstance(x, (dict, list)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    # pyyaml writes the Unicode line breaks NEL, LS and PS raw inside single quotes, which
    # does not read back as written ('\x85' comes back as ' '); double quotes escape them.
    style = '"' if any(c in data for c in "\x85\u2028\u2029") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(str, _represent_str)


# ---- `why` as a YAML comment ------------------------------------------------------------
# In YAML each rule's `why` is the comment block right above the rule, read like a code
# comment; JSON keeps it as a key. pyyaml drops comments, so they are placed and found by
# line: yaml.compose gives the start line of every item of `rules:` and `attributes:`, both
# in the fixed shape we write and in hand-edited files. A `why:` key still works, and wins.
_COMMENTED = ("rules", "attributes")
_COMMENT_WIDTH = 100  # columns of a comment line, its indent and "# " included
_OWN_LINE = re.compile(r"^[ \t]*(-[ \t]+)*$")


def _fits_comment(why: str) -> bool:
    """Whether comment lines give `why` back exactly: they are re-joined with single spaces,
    so line breaks, tabs, runs of spaces and outer spaces would be lost (such a `why` is
    written as a key instead)."""
    return why.isprintable() and why == why.strip() and "  " not in why


def _comment_lines(why: str, indent: str) -> list[str]:
    """`why` wrapped at single spaces into `# ` lines of at most _COMMENT_WIDTH columns (a
    longer word gets a line of its own)."""
    width = _COMMENT_WIDTH - len(indent) - 2
    lines: list[str] = []
    line = ""
    for word in why.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return [f"{indent}# {chunk}" for chunk in lines]


def _item_lines(text: str) -> dict[str, list[int | None]]:
    """0-based start line of each item of the top-level `rules` and `attributes` lists; None
    for an item sharing its line with something before it (`rules: [{...}, {...}]`), whose
    comments above belong to that something."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    if not isinstance(root, yaml.MappingNode):
        return {}
    lines = text.splitlines()
    out: dict[str, list[int | None]] = {}
    for key, value in root.value:
        if key.value in _COMMENTED and isinstance(value, yaml.SequenceNode):
            out[key.value] = [
                m.line if _OWN_LINE.match(lines[m.line][: m.column]) else None
                for m in (item.start_mark for item in value.value)
            ]
    return out


def _with_why_comments(text: str, whys: dict[str, list[str | None]]) -> str:
    """Dumped YAML with each given `why` as comment lines above its item."""
    lines = text.splitlines(keepends=True)
    above: dict[int, str] = {}
    for key, starts in _item_lines(text).items():
        for why, start in zip(whys.get(key, []), starts, strict=True):
            if why is None:
                continue
            if start is None:  # _Dumper writes every item on a line of its own
                raise RuntimeError(f"tpplan bug: a {key} item shares its line in:\n{text}")
            line = lines[start]
            indent = line[: len(line) - len(line.lstrip(" "))]
            above[start] = "".join(f"{c}\n" for c in _comment_lines(why, indent))
    return "".join(above.get(i, "") + line for i, line in enumerate(lines))


def _comment_above(lines: list[str], line: int) -> str | None:
    """The contiguous `#` lines right above `line`, joined with single spaces."""
    parts: list[str] = []
    i = line - 1
    while i >= 0 and lines[i].lstrip().startswith("#"):
        parts.append(lines[i].strip()[1:].strip())
        i -= 1
    return " ".join(p for p in reversed(parts) if p) or None


def _whys_from_comments(data: Any, text: str) -> Any:
    """Parsed YAML with the comment block above each rule (or attribute rule) that has no
    `why:` key as its `why`; a rule with neither is left for the "missing why" message."""
    if not isinstance(data, dict):
        return data
    wanting = [
        key
        for key in _COMMENTED
        if isinstance(data.get(key), list)
        and any(isinstance(item, dict) and "why" not in item for item in data[key])
    ]
    if not wanting:
        return data
    lines = text.splitlines()
    for key, starts in _item_lines(text).items():
        items = data.get(key)
        if key not in wanting or not isinstance(items, list) or len(items) != len(starts):
            continue
        for item, start in zip(items, starts, strict=True):
            if isinstance(item, dict) and "why" not in item and start is not None:
                why = _comment_above(lines, start)
                if why is not None:
                    item["why"] = why
    return data


def plan_json_schema() -> dict[str, Any]:
    """The JSON Schema of plan files, as checked in under plans/schema.json."""
    schema = Plan.model_json_schema(by_alias=True)
    schema["title"] = f"tpplan plan file, schema version {SCHEMA_VERSION}"
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def load_plan(path: str | Path) -> Plan:
    """Read a plan file (YAML, or JSON for `.json`), or a plan shipped with tpplan by its
    name (`load_plan("llama")`) when no file of that name exists."""
    from .shipped import shipped_plan, unknown_plan_hint

    path = Path(path)
    bare = len(path.parts) == 1 and not path.suffix
    if bare and not path.exists():
        shipped = shipped_plan(str(path))
        if shipped is None:
            raise PlanFileError(str(path), [unknown_plan_hint(str(path))])
        path = shipped
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PlanFileError(str(path), [f"cannot read the file: {e.strerror}."]) from None
    text = _utf8(data, str(path))
    if path.suffix == ".json":
        return Plan.from_json(text, source=str(path))
    return Plan.from_yaml(text, source=str(path))


def _utf8(data: bytes, source: str) -> str:
    """A plan file's text; YAML and JSON plan files are UTF-8, whatever the locale says."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - data.rfind(b"\n", 0, e.start)
        where = f"byte 0x{data[e.start]:02x} at line {line}, column {column}"
        issue = (
            f"a binary file, not a YAML or JSON plan ({where} is not UTF-8). Fix: check that "
            "PLAN names a plan file."
            if b"\0" in data
            else f"{where} is not UTF-8; plan files are UTF-8 text. Fix: save the file as UTF-8."
        )
        raise PlanFileError(source, [issue]) from None


# ---- turning pydantic errors into sentences ---------------------------------------------
def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "plan"


def _line_of(text: str | None, loc: tuple[Any, ...]) -> int | None:
    """1-based YAML line of the node at `loc`, when the text is at hand."""
    if text is None:
        return None
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = node.start_mark.line if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if k.value == part), None)
            key = next((k for k, _ in node.value if k.value == part), None)
            if nxt is None:
                break
            line = key.start_mark.line if key is not None else nxt.start_mark.line
            node = nxt
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
        ):
            node = node.value[part]
            line = node.start_mark.line
        else:
            break
    return None if line is None else line + 1


def _explain(err: ValidationError, text: str | None) -> list[str]:
    issues = []
    for e in err.errors():
        loc = tuple(e["loc"])
        kind = e["type"]
        if kind == "extra_forbidden":
            field = loc[-1]
            parent = _loc(loc[:-1])
            msg = f"unknown field '{field}' in {parent}; remove it or check its spelling."
        elif kind == "missing":
            field = loc[-1]
            parent = _loc(loc[:-1])
            hint = (
                " Every rule says why it exists, in words a reviewer can check."
                if field == "why"
                else ""
            )
            msg = f"{parent} is missing the required field '{field}'.{hint}"
        elif kind == "value_error":
            msg = f"{_loc(loc)}: {e['ctx']['error']}"
        else:
            msg = f"{_loc(loc)}: {e['msg']} (got {e.get('input')!r})."
        line = _line_of(text, loc)
        issues.append(f"line {line}: {msg}" if line else msg)
    return issues
