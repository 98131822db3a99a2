"""Property tests of infer_plan over hand-written transformer variants (tests/support/blocks.py).

Hypothesis draws a `Spec` (attention kind, fused or separate projections, MLP kind, norm
placement, residual layout, tying, biases, q/k norms, head views, depth), builds the model, and
for tp 2 and 4 checks what must hold for every model whatever the tracer decides:

- the sharded model computes the unsharded model's outputs and gradients on every rank;
- every Linear and Embedding has a rule, and a replicated one says why;
- where the tracer has everything it needs (an unfused MLP; separate q/k/v viewed with -1 or a
  stored count it can divide, tp dividing the kv heads; an untied vocab), the layers really are
  sharded, so a tracer that replicates everything cannot pass.

Fused layers, tied heads and head counts read off a config object are only held to parity;
the modules left unsharded (kept whole, or split and gathered right away) are listed at the
end of the run rather than asserted, since the tracer learns more of them over time.

Examples are drawn derandomized, so CI sees the same ones on every run; six keep the file
near a minute on two cores, and TPPLAN_PROPERTY_EXAMPLES=200 explores further (a nightly
run, or after a tracer change).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, currently_in_test_context, event, given, settings
from hypothesis import strategies as st
from support.blocks import ROLE_NAMES, Spec, build, token_ids
from support.parity import assert_parity
from support.plans import expand_rules
from torch import nn

import tpplan
from tpplan.plan import Plan

SPECS = st.builds(
    Spec,
    hidden=st.sampled_from([32, 64]),
    kv=st.sampled_from(["mha", "gqa", "mqa"]),
    repeat_kv=st.booleans(),
    qkv=st.sampled_from(["separate", "fused", "interleaved"]),
    view=st.sampled_from(
        ["minus1", "stored", "stored_seq", "stored_last", "stored_hd", "unflatten", "config_hd"]
    ),
    mlp=st.sampled_from(["plain", "gated", "gated_fused"]),
    norm=st.sampled_from(["layer", "rms"]),
    post_norm=st.booleans(),
    parallel=st.booleans(),
    tied=st.booleans(),
    bias=st.booleans(),
    qk_norm=st.booleans(),
    layers=st.integers(1, 3),
    vocab=st.sampled_from([64, 128]),
)

# Views the tracer can size on a rank: -1 for the head count, or a count it reads from a
# module attribute (the plan divides it). A count read off a config object is held to parity
# only: keeping attention whole is as right an answer as sharding it.
_DIVIDABLE_VIEWS = ("minus1", "stored", "stored_seq", "stored_last", "stored_hd", "unflatten")

# "module (style): why" -> labels of the specs where a module was not sharded as part of a
# region (kept whole, or split and gathered right away), for the summary at the end.
NOT_SHARDED: dict[str, set[str]] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_not_sharded(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is None or capture is None or not NOT_SHARDED:
        return
    lines = ["", "test_property: modules not sharded in a region (module (style): why; in specs)"]
    for what in sorted(NOT_SHARDED):
        specs = sorted(NOT_SHARDED[what])
        lines.append(f"  {what}")
        lines.append(f"      in {len(specs)} spec(s), e.g. [{specs[0]}]")
    with capture.global_and_fixture_disabled():  # the summary is for the reader, not a test
        for line in lines:
            reporter.write_line(line)


def _role(block: int, part: str, role: str) -> str:
    return f"stack.{block}.{part}.{ROLE_NAMES[role]}"


def _check_sharded(spec: Spec, model: nn.Module, plan: Plan, tp: int) -> None:
    """The layers the tracer can shard today are sharded, in the expected roles."""
    rules = expand_rules(plan, model)

    def style(name: str) -> tuple[str, str | None]:
        return rules[name].style, getattr(rules[name], "output", None)

    for b in range(spec.layers):
        if spec.mlp != "gated_fused":
            opens = ("fc1",) if spec.mlp == "plain" else ("gate", "up")
            closes = "fc2" if spec.mlp == "plain" else "down"
            for role in opens:
                assert style(_role(b, "ff", role)) == ("colwise", None), (role, plan)
            assert style(_role(b, "ff", closes)) == ("rowwise", None), (closes, plan)
        if spec.qkv == "separate" and spec.view in _DIVIDABLE_VIEWS and spec.kv_heads % tp == 0:
            for role in ("q", "k", "v"):
                assert style(_role(b, "mix", role)) == ("colwise", None), (role, plan)
            assert style(_role(b, "mix", "o")) == ("rowwise", None), plan
            if spec.qk_norm:
                for role in ("q_norm", "k_norm"):
                    assert style(f"stack.{b}.mix.{role}")[0] == "replicate_grad_sum", plan
    if not spec.tied:
        assert style("tab") == ("vocab_parallel", None), plan
        assert style("out") == ("colwise", "replicate"), plan


def _check_reasons(spec: Spec, model: nn.Module, plan: Plan, tp: int) -> None:
    """Every Linear and Embedding has a rule; a replicated one says why. Modules kept whole,
    or split and gathered right away (outside the vocab head), are collected for the summary."""
    rules = expand_rules(plan, model)
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        assert name in rules, f"{name} has no rule"
        rule = rules[name]
        gathered = rule.style == "colwise" and rule.output_layout() == "replicate" and name != "out"
        if rule.style != "replicate" and not gathered:
            continue
        assert rule.why.strip(), f"{name} is {rule.style} without a reason"
        local = name.split(".", 2)[-1] if name.startswith("stack.") else name
        style = "gathered" if gathered else "replicate"
        NOT_SHARDED.setdefault(f"{local} ({style}): {rule.why}", set()).add(
            f"tp {tp}, {spec.label() or 'default'}"
        )
        if currently_in_test_context():  # shown by --hypothesis-show-statistics
            event(f"{local} not sharded at tp {tp}")


@settings(
    max_examples=int(os.environ.get("TPPLAN_PROPERTY_EXAMPLES", "6")),
    deadline=None,  # one example shards and runs a model twice on simulated ranks: ~1-3 s
    derandomize=True,  # the same examples on every run and machine
    database=None,
    # No shrinking: an example costs seconds, and shrinking three failures took six minutes.
    # The failing Spec is printed whole, and test_one_knob names the feature at fault.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
@given(spec=SPECS)
def test_inferred_plans_keep_the_numbers(spec: Spec) -> None:
    model = build(spec)
    ids = token_ids(spec.vocab)
    for tp in (2, 4):
        plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=ids)
        _check_reasons(spec, model, plan, tp)
        _check_sharded(spec, model, plan, tp)
        assert_parity(model, plan, tp, ids)


# ---- one knob at a time --------------------------------------------------------------------
# The knobs most likely to break a plan, each on its own at tp 2: a failure here names the
# feature, where hypothesis (which does not shrink here) reports a whole combination.
ONE_KNOB = [
    Spec(),
    Spec(kv="gqa", hidden=64),
    Spec(kv="mqa"),
    Spec(qkv="fused"),
    Spec(qkv="interleaved", kv="gqa", hidden=64),
    Spec(view="stored"),
    Spec(view="stored_hd"),
    Spec(view="unflatten"),
    Spec(view="config_hd"),
    Spec(mlp="gated_fused"),
    Spec(post_norm=True, parallel=True),
    Spec(tied=True),
    Spec(qk_norm=True),
]


@pytest.mark.parametrize("spec", ONE_KNOB, ids=lambda s: s.label() or "default")
def test_one_knob(spec: Spec) -> None:
    model = build(spec)
    ids = token_ids(spec.vocab)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=ids)
    _check_reasons(spec, model, plan, 2)
    _check_sharded(spec, model, plan, 2)
    assert_parity(model, plan, 2, ids)
