"""complete_plan: the sizes a plan's rules leave out (head_dim, fused parts) read from the
model, as the shipped plans leave them; a stated size the model contradicts told once per
rule; a size that cannot be read where the style needs it told, never guessed."""

from __future__ import annotations

import pytest
import torch
from support.check import SOUND, Attention, Tiny, Untraceable, make_rule, on_meta, problems_said
from torch import nn

from tpplan import Plan, Rule, check_plan
from tpplan.check import complete_plan
from tpplan.check.complete import leave_out_sizes

pytestmark = pytest.mark.unit

# SOUND without the sizes the model shows: heads of 4 on attn.[qkv] and attn.o, the pieces
# 24 | 24 of mlp.gate_up
FAMILY = Plan(
    rules=[
        Rule.model_validate(r.model_dump(exclude_unset=True, exclude={"head_dim", "parts"}))
        for r in SOUND
    ]
)


@pytest.fixture(scope="module")
def tiny() -> nn.Module:
    return on_meta(Tiny)


def test_sizes_a_plan_leaves_out_are_read_from_the_model(tiny: nn.Module) -> None:
    assert Plan(rules=SOUND) != FAMILY
    assert complete_plan(FAMILY, tiny, tp_size=2) == (Plan(rules=SOUND), [])
    assert check_plan(FAMILY, tiny, tp_size=2) == []


def test_sizes_a_plan_states_are_kept(tiny: nn.Module) -> None:
    assert complete_plan(Plan(rules=SOUND), tiny, tp_size=4) == (Plan(rules=SOUND), [])


def test_leave_out_sizes_drops_what_the_model_gives_back(tiny: nn.Module) -> None:
    assert leave_out_sizes(Plan(rules=SOUND), tiny) == FAMILY


def test_a_wrong_head_dim_is_one_problem_per_rule(tiny: nn.Module) -> None:
    """At tp 4, heads of 8 would also be 2 heads that tp 4 does not divide: that follows
    from the wrong head_dim, so only the head_dim is told, once per rule."""
    plan = Plan(
        rules=[
            r.model_copy(update={"head_dim": 8}) if r.head_size() is not None else r for r in SOUND
        ]
    )
    said = problems_said(plan, tiny, tp=4)
    # the messages test_check_messages pins at tp 2, one per rule, and nothing more at tp 4,
    # where heads of 8 would not divide and the attribute checks would complain too
    assert [kind for kind, _ in said] == ["head_dim", "head_dim"]
    assert said == problems_said(plan, tiny, tp=2)


def test_a_true_problem_after_a_completed_size_is_still_told(tiny: nn.Module) -> None:
    """4 heads at tp 8 do not split, whether the plan states head_dim or leaves it out."""
    assert [p.kind for p in check_plan(FAMILY, tiny, tp_size=8)] == [
        p.kind for p in check_plan(Plan(rules=SOUND), tiny, tp_size=8)
    ]
    assert "divisibility" in {p.kind for p in check_plan(FAMILY, tiny, tp_size=8)}


class _TwoSizes(nn.Module):
    """Two attentions of 16 features, one after the other: 4 heads of 4 (a1), 2 heads of
    8 (a2)."""

    def __init__(self) -> None:
        super().__init__()
        self.a1, self.a2 = Attention(), Attention()
        self.a2.head_dim = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a2(self.a1(x))


def test_one_rule_over_modules_of_two_head_sizes() -> None:
    plan = Plan(rules=[make_rule("a?.[qkv]", "colwise"), make_rule("a?.o", "rowwise")])
    said = problems_said(plan, on_meta(_TwoSizes))
    assert said[0] == (
        "head_dim",
        "rules[0] (match: a?.[qkv]), module a1.q, a1.k, a1.v, a2.q, a2.k, a2.v: the rule "
        "leaves head_dim out, and the modules it matches show different ones: 4 (a1.q); 8 "
        "(a2.q). Fix: split the rule into one rule per head_dim, each stating its head_dim.",
    )
    assert [kind for kind, _ in said] == ["head_dim", "head_dim"]


def test_shared_heads_without_a_head_dim_the_model_shows() -> None:
    """replicate_heads needs the size of a head; a model that cannot be traced cannot show
    it, and the check says so rather than sharding by a guess."""
    plan = Plan(
        rules=[make_rule("up", "colwise", replicate_heads=True), make_rule("down", "rowwise")]
    )
    problems = check_plan(plan, on_meta(Untraceable), tp_size=2)
    (shared,) = [p for p in problems if p.kind == "head_dim"]
    assert str(shared).startswith(
        "rules[0] (match: up): the rule shares key/value heads among ranks (replicate_heads) "
        "and leaves head_dim out, but the model could not be traced ("
    )
    assert str(shared).endswith(
        "), so the size of a head is unknown. Fix: set head_dim in the rule to the size of one "
        "key/value head (e.g. head_dim: 128)."
    )
