"""check_plan's messages, whole, one per kind of problem, on hand-written modules of a few
layers built on the meta device: no model library, and a dry run on fake ranks that takes a
fraction of a second. tests/test_check.py holds the cases that need a real model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.check import SOUND, Tiny, Untraceable, make_rule, on_meta, problems_said
from torch import nn

from tpplan import Plan, Rule, check_plan
from tpplan._runtime.facts import fingerprint, parameter_shapes
from tpplan.plan import AttributeRule, ModelInfo

pytestmark = pytest.mark.unit


class _Experts(nn.Module):
    """Four experts' fused gate|up weights (4, 16, 48), a router and a parameter-free
    submodule; nothing here runs (its forward takes no input tpplan can make up)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 16, 48))
        self.gate = nn.Linear(16, 4)
        self.skip = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = _Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


class _NormedEmbedding(nn.Embedding):
    """Normalises its looked-up rows in its own forward: not linear in them."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(super().forward(ids), (self.embedding_dim,))


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = _NormedEmbedding(12, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(input_ids))


@pytest.fixture(scope="module")
def tiny() -> nn.Module:
    return on_meta(Tiny)


def _edited(**changes: Any) -> Plan:
    """SOUND with rules changed by match: fields to change, a rule in its place, or None to
    drop it."""
    rules = []
    for r in SOUND:
        change = changes.get(r.match, {})
        if isinstance(change, Rule):
            rules.append(change)
        elif change is not None:
            rules.append(r.model_copy(update=change))
    return Plan(rules=rules)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_sound_plan_has_no_problem(tiny: nn.Module, tp: int) -> None:
    assert problems_said(Plan(rules=SOUND), tiny, tp) == []


# ---- each rule on the modules it matches (rules.py, sizes.py)


def test_a_pattern_matching_nothing_suggests_the_nearest(tiny: nn.Module) -> None:
    assert problems_said(Plan(rules=[make_rule("mlp.dwn", "replicate")]), tiny) == [
        (
            "no_match",
            "rules[0] (match: mlp.dwn): the pattern matches no module of the model. Did you "
            "mean 'mlp.down'? Fix: correct the pattern (segments are matched one by one, `*` "
            "never crosses a dot) or delete the rule.",
        )
    ]


def test_a_module_two_rules_match(tiny: nn.Module) -> None:
    plan = Plan(rules=[make_rule("attn.[qk]", "replicate"), make_rule("attn.q", "replicate")])
    assert problems_said(plan, tiny) == [
        (
            "overlap",
            "rules[1] (match: attn.q), module attn.q: the module is also matched by rules[0] "
            "(match: attn.[qk]); a module takes one style. Fix: narrow one of the two patterns.",
        )
    ]


def test_a_style_the_module_cannot_take(tiny: nn.Module) -> None:
    assert problems_said(Plan(rules=[make_rule("norm", "vocab_parallel")]), tiny) == [
        (
            "module_type",
            "rules[0] (match: norm), module norm: style 'vocab_parallel' applies to "
            "nn.Embedding, not to LayerNorm. Fix: match the layers inside this module instead, "
            "or use another style.",
        )
    ]


def test_sequence_parallel_on_an_embedding(tiny: nn.Module) -> None:
    assert problems_said(Plan(rules=[make_rule("embed", "sequence_parallel")]), tiny) == [
        (
            "module_type",
            "rules[0] (match: embed), module embed: style 'sequence_parallel' takes a "
            "module's input as this rank's share of the sequence, but an nn.Embedding's input "
            "is the token ids, which every rank holds whole: its rows would be read as 1/tp of "
            "a sequence tp times as long. Fix: use vocab_parallel (`output: shard(1)` starts a "
            "sequence-parallel region, as `tpplan infer --sequence-parallel` writes it) or "
            "replicate.",
        )
    ]


def test_transposed_on_a_module_without_a_2d_weight(tiny: nn.Module) -> None:
    assert problems_said(Plan(rules=[make_rule("norm", "colwise", transposed=True)]), tiny) == [
        (
            "module_type",
            "rules[0] (match: norm), module norm: transposed: true needs a module with a 2-D "
            "weight stored (in, out); LayerNorm has none. Fix: remove transposed, or match the "
            "layer that holds the weight.",
        )
    ]


def test_replicate_grad_sum_on_a_module_without_parameters(tiny: nn.Module) -> None:
    assert problems_said(Plan(rules=[make_rule("act", "replicate_grad_sum")]), tiny) == [
        (
            "module_type",
            "rules[0] (match: act), module act: style 'replicate_grad_sum' needs a module with "
            "parameters of its own. Fix: match the module that holds the parameters.",
        )
    ]


def test_sizes_tp_does_not_divide_list_the_legal_sizes(tiny: nn.Module) -> None:
    """One problem per rule, its modules listed; the heads check by data flow does not tell
    the same modules again."""
    assert problems_said(Plan(rules=SOUND), tiny, tp=8) == [
        (
            "divisibility",
            "rules[0] (match: embed), module embed: num_embeddings (the vocab) = 12 does not "
            "divide by tp size 8. Fix: use a tp size among 1, 2, 3, 4, 6, 12, or keep this "
            "module replicated, or set uneven: true (each rank then holds DTensor's share, the "
            "last ones less).",
        ),
        (
            "divisibility",
            "rules[1] (match: attn.[qkv]), module attn.q, attn.k, attn.v: 4 heads (of head_dim "
            "4) do not split evenly over tp size 8; every rank must hold whole heads. Fix: use a "
            "tp size among 1, 2, 4, or keep this module replicated.",
        ),
        (
            "divisibility",
            "rules[2] (match: attn.o), module attn.o: 4 heads (of head_dim 4) do not split "
            "evenly over tp size 8; every rank must hold whole heads. Fix: use a tp size among "
            "1, 2, 4, or keep this module replicated.",
        ),
        (
            "divisibility",
            "rules[5] (match: head), module head: out_features = 12 does not divide by tp size "
            "8. Fix: use a tp size among 1, 2, 3, 4, 6, 12, or keep this module replicated, or "
            "set uneven: true (each rank then holds DTensor's share, the last ones less).",
        ),
    ]


def test_a_head_dim_the_width_is_no_whole_number_of(tiny: nn.Module) -> None:
    """The wrong head_dim is the one problem: that 16 features are no whole number of heads
    of 5 follows from it, and is not told again."""
    plan = Plan(rules=[make_rule("attn.q", "colwise", head_dim=5, output="replicate")])
    assert problems_said(plan, tiny) == [
        (
            "head_dim",
            "rules[0] (match: attn.q), module attn.q: the rule states head_dim 5, but the "
            "model's head_dim is 4 (it views its 16 output features as 4 heads of 4). Fix: set "
            "head_dim: 4 in the rule, or infer the plan again for this model (`tpplan infer`).",
        ),
    ]


def test_parts_that_do_not_add_up(tiny: nn.Module) -> None:
    assert problems_said(_edited(**{"mlp.gate_up": {"parts": [16, 16]}}), tiny) == [
        (
            "parts",
            "rules[3] (match: mlp.gate_up), module mlp.gate_up: parts [16, 16] add up to 32, "
            "but the out_features is 48. Fix: list the sizes of the fused pieces (e.g. q, k, v) "
            "in order; they must add up to the whole.",
        )
    ]


def test_written_naming_no_parameter_as_wide_as_the_rows(tiny: nn.Module) -> None:
    """The rule's own check first; the trace then sees nothing written over the rows."""
    assert problems_said(_edited(embed={"written": ["weight"]}), tiny) == [
        (
            "module_type",
            "rules[0] (match: embed), module embed: written names weight, not a parameter of "
            "Embedding as wide as its rows (16); its parameters: weight (12, 16). Fix: name "
            "the parameters its forward writes over looked-up rows.",
        ),
        (
            "lookup",
            "rules[0] (match: embed), module embed: written names weight, but its forward "
            "writes no parameter of its own over the looked-up rows. Fix: drop written from "
            "the rule.",
        ),
    ]


# ---- across rules: tied parameters, experts


def test_a_tied_weight_split_two_ways(tiny: nn.Module) -> None:
    assert problems_said(_edited(head=make_rule("head", "replicate")), tiny) == [
        (
            "tied",
            "rules[0] (match: embed), module embed: it shares a parameter with other modules "
            "(tied), which the plan splits differently (embed.weight: dim 0, head.weight: "
            "whole); sharded, they would stop being one tensor. Fix: give every module holding "
            "the tied parameter a style that splits it the same way (vocab_parallel input "
            "embedding with a colwise head), or keep them all replicated.",
        )
    ]


def _experts(**fields: object) -> Rule:
    return make_rule("moe", "experts", **fields)


def test_a_rule_inside_an_experts_module() -> None:
    plan = Plan(rules=[_experts(shard={"w": 0}), make_rule("moe.gate", "replicate_grad_sum")])
    assert problems_said(plan, on_meta(_Moe)) == [
        (
            "overlap",
            "rules[1] (match: moe.gate), module moe.gate: it is inside moe, matched by rules[0] "
            "(style experts), whose forward runs on each rank's local tensors with its other "
            "parameters whole. Fix: drop this rule, or keep the module whole (style: "
            "replicate).",
        )
    ]


@pytest.mark.parametrize(
    ("fields", "tp", "said"),
    [
        (
            {"shard": {"v": 0}},
            2,
            (
                "module_type",
                "experts names v, which _Experts does not hold (its parameters: w (4, 16, 48), "
                "gate.weight (4, 16), gate.bias (4,)). Fix: name the module's own parameters (a "
                "child's by its dotted name) in shard and after_sum.",
            ),
        ),
        (
            {"shard": {"w": 3}},
            2,
            (
                "module_type",
                "shard: w: 3, but w has 3 dims (4, 16, 48). Fix: give a dim of the parameter "
                "(0 is the experts).",
            ),
        ),
        (
            {"shard": {"w": 2}, "fused": {"w": [16, 16]}},
            2,
            (
                "parts",
                "fused w [16, 16] add up to 32, but w dim 2 is 48. Fix: list the sizes of the "
                "fused pieces (gate, up) in order; they must add up to the whole.",
            ),
        ),
        (
            {"shard": {"w": 0}},
            8,
            (
                "divisibility",
                "w dim 0 (the number of experts) = 4 does not divide by tp size 8. Fix: use a "
                "tp size among 1, 2, 4, or keep this module replicated.",
            ),
        ),
        (
            {"shard": {"w": 0}, "added_whole": ["skp"]},
            2,
            (
                "module_type",
                "added_whole names skp, which _Experts does not hold (its submodules: gate, "
                "skip). Fix: name submodules of the matched module by their dotted names under "
                "it.",
            ),
        ),
    ],
    ids=["a parameter it lacks", "a dim it lacks", "fused pieces", "experts", "added_whole"],
)
def test_an_experts_rule_on_its_own_parameters(
    fields: dict[str, object], tp: int, said: tuple[str, str]
) -> None:
    kind, message = said
    where = "rules[0] (match: moe), module moe: "
    assert problems_said(Plan(rules=[_experts(**fields)]), on_meta(_Moe), tp) == [
        (kind, where + message)
    ]


# ---- by the traced data flow (flow.py and the checks it runs)


def test_a_region_left_open(tiny: nn.Module) -> None:
    assert problems_said(_edited(**{"mlp.down": None}), tiny) == [
        (
            "unclosed_region",
            "rules[3] (match: mlp.gate_up), module mlp.gate_up: its output is contracted by "
            "mlp.down, which the plan does not make rowwise, so that layer would read a shard "
            "as if it were the whole tensor. Fix: make those layers rowwise, or gather this "
            "output with `output: replicate`.",
        )
    ]


def test_a_region_never_opened(tiny: nn.Module) -> None:
    assert problems_said(_edited(**{"mlp.gate_up": None}), tiny) == [
        (
            "unopened_region",
            "rules[3] (match: mlp.down), module mlp.down: its input comes from mlp.gate_up, "
            "which the plan does not make colwise. Fix: make those layers colwise too, or "
            "declare `input: replicate`.",
        )
    ]


def test_a_split_that_reaches_the_models_output(tiny: nn.Module) -> None:
    assert problems_said(Plan(rules=[make_rule("head", "colwise")]), tiny) == [
        (
            "unclosed_region",
            "rules[0] (match: head), module head: its output stays sharded (shard(-1)) up to "
            "the model's output. Fix: gather it with `output: replicate`, or set "
            "options.loss_parallel and compute the loss under "
            "torch.distributed.tensor.parallel.loss_parallel().",
        )
    ]


def test_an_embedding_split_by_columns(tiny: nn.Module) -> None:
    assert problems_said(Plan(rules=[make_rule("embed", "colwise")]), tiny) == [
        (
            "unclosed_region",
            "rules[0] (match: embed), module embed: colwise on an nn.Embedding gives each rank "
            "a slice of every looked-up row's features and leaves its output split "
            "(shard(-1)), but the layers after a lookup take whole rows. Fix: colwise on an "
            "Embedding: use vocab_parallel (each rank holds a share of the vocab; one "
            "all-reduce) or replicate, or gather its rows with `output: replicate`.",
        )
    ]


def test_heads_the_tp_size_would_cut(tiny: nn.Module) -> None:
    """No head_dim in the rules: 16 features divide by 8, but the model's 4 heads do not;
    the head_dim left out is the model's (check/complete.py), told on each rule as a
    stated one would be."""
    plan = Plan(rules=[make_rule("attn.[qkv]", "colwise"), make_rule("attn.o", "rowwise")])
    told = (
        "4 heads (of head_dim 4) do not split evenly over tp size 8; every rank must hold "
        "whole heads. Fix: use a tp size among 1, 2, 4, or keep this module replicated."
    )
    assert problems_said(plan, tiny, tp=8) == [
        ("divisibility", f"rules[0] (match: attn.[qkv]), module attn.q, attn.k, attn.v: {told}"),
        ("divisibility", f"rules[1] (match: attn.o), module attn.o: {told}"),
    ]


def test_a_head_dim_other_than_the_models(tiny: nn.Module) -> None:
    plan = _edited(**{"attn.[qkv]": {"head_dim": 8}, "attn.o": {"head_dim": 8}})
    assert problems_said(plan, tiny) == [
        (
            "head_dim",
            "rules[1] (match: attn.[qkv]), module attn.q, attn.k, attn.v: the rule states "
            "head_dim 8, but the model's head_dim is 4 (it views its 16 output features as 4 "
            "heads of 4). Fix: set head_dim: 4 in the rule, or infer the plan again for this "
            "model (`tpplan infer`).",
        ),
        (
            "head_dim",
            "rules[2] (match: attn.o), module attn.o: the rule states head_dim 8, but the "
            "model's head_dim is 4 (its 16 input features arrive as 4 heads of 4). Fix: set "
            "head_dim: 4 in the rule, or infer the plan again for this model (`tpplan infer`).",
        ),
    ]


def test_fused_parts_other_than_the_models(tiny: nn.Module) -> None:
    assert problems_said(_edited(**{"mlp.gate_up": {"parts": [16, 32]}}), tiny) == [
        (
            "parts",
            "rules[3] (match: mlp.gate_up), module mlp.gate_up: the rule states parts [16, 32], "
            "but the model cuts its 48 output features into the pieces [24, 24]. Fix: set "
            "parts: [24, 24] in the rule, or infer the plan again for this model (`tpplan "
            "infer`).",
        )
    ]


def test_a_vocab_parallel_embedding_whose_forward_is_not_linear_in_its_rows() -> None:
    plan = Plan(rules=[make_rule("embed", "vocab_parallel")])
    assert problems_said(plan, on_meta(_Normed)) == [
        (
            "lookup",
            "rules[0] (match: embed), module embed: its forward applies native_layer_norm to "
            "the looked-up rows, which is not linear in them, but a vocab-parallel lookup's "
            "partial rows are summed only after the forward, so it would act on partial rows. "
            "Fix: add `sum_at: lookup` to the rule.",
        )
    ]


def test_regions_by_module_structure_where_no_trace_can_be_made() -> None:
    model = on_meta(Untraceable)
    assert problems_said(Plan(rules=[make_rule("up", "colwise")]), model) == [
        (
            "unclosed_region",
            "rules[0] (match: up), module up: its output stays sharded (shard(-1)) but no "
            "rowwise module under the model (top level) takes it back to a full tensor. Fix: "
            "add a rowwise rule for the layer that consumes it, or gather the output with "
            "`output: replicate`.",
        )
    ]
    assert problems_said(Plan(rules=[make_rule("down", "rowwise")]), model) == [
        (
            "unopened_region",
            "rules[0] (match: down), module down: it expects a sharded input (shard(-1)) but no "
            "colwise module under the model (top level) produces one. Fix: add colwise rules "
            "for the layers that feed it, or declare `input: replicate`.",
        )
    ]


# ---- the plan's attribute fixes and its model


def _divide(match: str, *attrs: str) -> AttributeRule:
    return AttributeRule(match=match, divide=list(attrs), why="a test")


@pytest.mark.parametrize(
    ("attributes", "tp", "said"),
    [
        (
            [_divide("atn", "head_dim")],
            2,
            (
                "no_match",
                "attributes[0] (match: atn): the pattern matches no module of the model. Did "
                "you mean 'attn'? Fix: correct the pattern or delete the entry.",
            ),
        ),
        (
            [_divide("attn", "nope")],
            2,
            (
                "attribute",
                "attributes[0] (match: attn), module attn: the module has no integer attribute "
                "'nope' (found None). Fix: name an integer attribute the module's forward reads.",
            ),
        ),
        (
            [_divide("attn", "heads")],
            3,
            (
                "divisibility",
                "attributes[0] (match: attn), module attn: heads = 4 does not divide by tp "
                "size 3. Fix: use a tp size among 1, 2, 4.",
            ),
        ),
        (
            [_divide("attn", "head_dim")],
            2,
            (
                "attribute",
                "attributes[0] (match: attn), module attn: its forward reads head_dim, but not "
                "as a count of the split features' heads: its views read no count for that "
                "(they size the split with -1 or off the tensor). Divided, head_dim would "
                "shrink a size every rank keeps whole. Fix: remove head_dim from divide (the "
                "attributes `tpplan infer` writes are the ones to divide).",
            ),
        ),
    ],
    ids=["no match", "no integer", "not divided by tp", "no count the views read"],
)
def test_attribute_fixes(
    tiny: nn.Module, attributes: list[AttributeRule], tp: int, said: tuple[str, str]
) -> None:
    """In a plan of attribute fixes alone, so that nothing else is at fault."""
    assert problems_said(Plan(attributes=attributes), tiny, tp) == [said]


def test_a_plan_for_another_model_says_what_differs(tiny: nn.Module) -> None:
    other = on_meta(Tiny, vocab=8)
    info = ModelInfo(
        class_="Tiny", fingerprint=fingerprint(other), parameters=parameter_shapes(other)
    )
    (problem,) = check_plan(Plan(rules=SOUND, model=info), tiny, tp_size=2)
    assert (problem.kind, problem.rule, problem.module) == ("fingerprint", "model", None)
    assert problem.message == (
        f"the plan was written for another model (fingerprint {fingerprint(other)}, this model "
        f"has {fingerprint(tiny)}). What differs: embed.weight was (8, 16), is (12, 16)."
    )
    assert problem.fix == (
        "regenerate the plan with `tpplan infer`, or delete model.fingerprint to use the plan "
        "for any model whose module names match."
    )


# ---- the dry run, for a plan every check above passes


def test_a_plan_that_does_not_run(tiny: nn.Module) -> None:
    """A hand-made sequence-parallel boundary in a plan that is not sequence-parallel: the
    MLP's whole input is taken for a shard of the sequence and gathered to twice its length.
    torch's own words after its error's type are torch's to change."""
    prepare = make_rule(
        "mlp",
        "prepare",
        inputs=["shard(1)"],
        desired_inputs=["replicate"],
        local_input=True,
    )
    (problem,) = check_plan(Plan(rules=[*SOUND, prepare]), tiny, tp_size=2)
    assert (problem.kind, problem.rule, problem.module) == (
        "dry_run",
        "rules[6] (match: mlp)",
        "mlp",
    )
    assert problem.message.startswith(
        "a forward on a copy sharded over 2 fake ranks (fake tensors, no weights) fails in the "
        "model, which takes the output of mlp: RuntimeError: "
    )
    assert problem.fix == (
        "give the rule a style or layouts (input, output) that what follows can take, or keep "
        "the module whole (style: replicate); `tpplan verify` compares every module with the "
        "unsharded model."
    )
