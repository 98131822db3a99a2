"""`Rule`, the base of the ten style classes (styles/), and how a rule finds its class.

Start at `Rule`. A rule maps a module-name pattern to a style; every style is a class of its
own (styles/) that holds only the fields that style takes, its checks, the schema version
each of its fields came in, and the pure facts about it. `Rule(style=..., ...)` and
`Rule.parse(data)` give an instance of the style's class; a plan's `rules` are read the same
way (`AnyRule`, a union tagged by `style`). No torch here.
"""

from __future__ import annotations

from collections.abc import Collection
from functools import cache
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    field_validator,
    model_validator,
)

from ..errors import did_you_mean

__all__ = [
    "STYLE_CLASSES",
    "Rule",
    "Strict",
    "WeightKind",
    "any_rule",
    "rule_class",
    "style_names",
]


class Strict(BaseModel):
    """A plan's every part: unknown keys refused, frozen, field docs in its JSON Schema."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, use_attribute_docstrings=True
    )


WeightKind = Literal["linear", "conv", "embedding"]
"""What holds a weight a style splits: an nn.Linear (or a layer with a Linear's weight, as
GPT-2's Conv1D with `transposed`), a convolution, an nn.Embedding."""

# style name -> its class, in the order the styles are listed (filled as styles/ defines them)
STYLE_CLASSES: dict[str, type[Rule]] = {}

_EVERY_RULE = ("match", "style", "why")  # the fields every rule has, whatever its style


def style_names() -> tuple[str, ...]:
    return tuple(STYLE_CLASSES)


def rule_class(style: Any) -> type[Rule] | None:
    """The class of the style `style` names; None when it names none."""
    return STYLE_CLASSES.get(style) if isinstance(style, str) else None


class Rule(Strict):
    """One pattern -> style mapping, with the layouts it uses and the reason for it.

    The base of one class per style: `Rule(match=..., style="colwise", why=...)` builds a
    `ColwiseRule`, and `Rule.parse(data)` reads one from plain data. A rule whose style is
    unknown is refused with the styles there are."""

    match: str = Field(min_length=1)
    """Dotted module-name pattern; each segment is an fnmatch pattern over one child name
    (`model.layers.*.mlp.up_proj`), exactly as parallelize_module matches."""
    style: str
    """The parallel style; each style's own fields are listed under it."""
    why: str = Field(min_length=1)
    """The evidence for this rule, in words a reviewer can check."""

    # the schema version that added the style, and each of its fields that came later
    since: ClassVar[int] = 1
    field_since: ClassVar[dict[str, int]] = {}
    """field -> the version that added the field to the schema."""
    style_field_since: ClassVar[dict[str, int]] = {}
    """field -> the version in which this style took a field older than that."""

    def __new__(cls, *args: Any, **data: Any) -> Rule:
        # Rule(style="colwise", ...) is a ColwiseRule; an unknown style stays a Rule, whose
        # own validation refuses it with the styles there are
        if cls is Rule:
            cls = rule_class(data.get("style")) or Rule
        return super().__new__(cls)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        default = cls.model_fields["style"].default
        if isinstance(default, str):
            STYLE_CLASSES[default] = cls

    @classmethod
    def parse(cls, data: Any) -> Rule:
        """The rule `data` (a mapping with a `style`) describes, as its style's class."""
        return Rule.model_validate(data)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:
        """As pydantic's; on `Rule` itself, a rule of the class its style names (`parse`)."""
        if cls is Rule:
            return _adapter().validate_python(obj, **kwargs)
        return super().model_validate(obj, **kwargs)

    @classmethod
    def own_fields(cls) -> frozenset[str]:
        """The optional fields this style takes (every rule also has match, style, why)."""
        return frozenset(cls.model_fields) - set(_EVERY_RULE)

    @field_validator("style", mode="before")
    @classmethod
    def _known_style(cls, v: Any) -> Any:
        names = style_names()
        if not isinstance(v, str):
            quoted = [repr(n) for n in names]
            raise ValueError(
                f"Input should be {', '.join(quoted[:-1])} or {quoted[-1]} (got {v!r})."
            )
        if v not in STYLE_CLASSES:
            raise ValueError(
                f"'{v}' is not a style.{did_you_mean(v, names)} Styles: {', '.join(names)}."
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _fields_fit_style(cls, data: Any) -> Any:
        """A field of another style on this one: what this style takes instead. Fields no
        style has are left to pydantic (unknown field)."""
        if not isinstance(data, dict):
            return data
        every = set().union(*(c.own_fields() for c in STYLE_CLASSES.values()))
        if cls is Rule:  # an unknown style: its error alone, not one per field it may take
            return {k: v for k, v in data.items() if k not in every}
        extra = sorted((set(data) & every) - cls.own_fields())
        if extra:
            ok = ", ".join(sorted(cls.own_fields())) or "none"
            raise ValueError(
                f"style '{data.get('style', cls.model_fields['style'].default)}' takes no "
                f"{', '.join(extra)}; its optional fields are: {ok}."
            )
        return data

    def newer_than(self, version: int) -> list[tuple[int, int, str]]:
        """What in this rule a file of schema `version` cannot say: (the version it needs,
        its kind's place in the message, the words after `rules[i].`)."""
        given = self.model_fields_set
        out = [(v, 0, f) for f, v in self.field_since.items() if f in given and v > version]
        out += [
            (v, 1, f"{f} (style {self.style})")
            for f, v in self.style_field_since.items()
            if f in given and v > version
        ]
        out += [(v, 2, text) for v, text in self.omissions(given) if v > version]
        if self.since > version:
            out.append((self.since, 3, f"style {self.style}"))
        return out

    def omissions(self, given: Collection[str]) -> list[tuple[int, str]]:
        """(version, words) for each field given without one an older version needed."""
        return []

    # ---- the facts the rest of tpplan asks of a style (each class answers for its own) ----
    splits: ClassVar[bool] = True
    """The style splits something over the ranks (replicate keeps the module whole)."""
    sized: ClassVar[bool] = False
    """It may leave sizes to the model (`model_sizes`), which check reads from a trace."""
    inside: ClassVar[str | None] = None
    """Why a module inside one of this style takes no rule of its own (None: it may)."""

    def weight_dim(self, kind: WeightKind) -> int | None:
        """The dim of the module's weight this rule splits, for a weight held by `kind`
        (linear, conv, embedding); None where it keeps the weight whole."""
        return None

    def bias_dim(self, kind: WeightKind) -> int | None:
        """The dim of the module's bias this rule splits; None where it keeps it whole."""
        return None

    def input_layout(self) -> str | None:
        """The layout its module's input arrives in, the style's default where the rule
        gives none (None: the style takes no input layout)."""
        return None

    def output_layout(self) -> str | None:
        """The layout its module's output is turned into, the style's default where the rule
        gives none (None: the style takes no output layout)."""
        return None

    def opens_split(self) -> bool:
        """It splits a layer's output features and leaves them split: a split the layers
        after it continue opens here."""
        return False

    def closes_split(self) -> bool:
        """It takes its input split on the features it contracts: a split closes here."""
        return False

    def lora_split(self, role: str) -> bool:
        """Whether a LoRA adapter of a base layer this rule styles is split as its base is:
        `role` "a" for lora_A (in -> r), "b" for lora_B (r -> out). The wrapper adds
        `lora_B(lora_A(x))` to the base's output, so the pair must add tensors split alike
        with no collective of its own; every other adapter stays whole."""
        return False

    # the sizes a rule states, whatever its style calls them (None or empty: none stated)
    def head_size(self) -> int | None:
        """The head size it states (`head_dim`)."""
        return None

    def part_sizes(self) -> list[int] | None:
        """The fused pieces of its split features it states (`parts`)."""
        return None

    def fused_sizes(self) -> dict[str, list[int]]:
        """Each expert parameter's fused pieces it states (`fused`)."""
        return {}

    def stored_transposed(self) -> bool:
        """Its layer's weight is stored (in, out) (`transposed`)."""
        return False

    def shares_heads(self) -> bool:
        """Whole heads are shared among ranks past their count (`replicate_heads`)."""
        return False

    def splits_unevenly(self) -> bool:
        """The ranks may hold unequal shares of the dim it splits (`uneven`)."""
        return False

    def may_split_unevenly(self) -> bool:
        """It could take `uneven: true` (a vocab, or features gathered right after)."""
        return False

    def uneven_group(self) -> int | None:
        """With heads tp does not divide split unevenly (`uneven` with head_dim): the query
        heads one key/value head serves (`group`, 1 by default); None otherwise."""
        return None

    def states_sizes(self) -> bool:
        """It states a size of the model's (a head_dim, fused parts or pieces), which the
        model must show alike."""
        return bool(self.head_size() or self.part_sizes() or self.fused_sizes())

    def model_sizes(self, *, in_region: bool, stated: bool) -> list[tuple[str, str | None]]:
        """The sizes this rule may leave to the model, which check reads from it: (field,
        expert parameter or None). `in_region`: its layers lie in a DTensor region (whose
        code states its sizes); `stated`: also those the rule states (checked against the
        model's)."""
        return []

    def needs_head_dim(self) -> bool:
        """It needs a head_dim the rule leaves out (read from the model, or a problem)."""
        return False

    def hands_dtensors(self) -> bool:
        """It hands DTensors on rather than plain local tensors (`local_output: false`)."""
        return getattr(self, "local_output", None) is False


def _style_of(value: Any) -> str:
    """The tag of a rule in a plan's rules: its style, or "?" for one no class takes (read
    as the base `Rule`, which refuses it with the styles there are)."""
    style = value.get("style") if isinstance(value, dict) else getattr(value, "style", None)
    return style if isinstance(style, str) and rule_class(style) is not None else "?"


def any_rule() -> Any:
    """The type of a rule in a plan: one of every style's class, picked by its `style` (a
    union tagged by it); a style no class takes is read as the base `Rule` to be refused."""
    choices = [Annotated[c, Tag(name)] for name, c in STYLE_CLASSES.items()]
    choices.append(Annotated[Rule, Tag("?")])
    return Annotated[Union[tuple(choices)], Discriminator(_style_of)]  # noqa: UP007


@cache
def _adapter() -> TypeAdapter[Any]:
    return TypeAdapter(any_rule())
