"""infer_plan: a tensor-parallel plan from a model's data flow.

Start at `infer_plan`, then `_decide`, which reads top to bottom: one step per concern, each
in a module of its own (see this package's docstring). Module names are used only to print
patterns and to name partners in `why`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from .._runtime.facts import fingerprint, parameter_shapes
from ..plan.patterns import collapse
from ..plan.schema import AttributeRule, ModelInfo, Options, Plan, Rule
from ..trace import Trace, trace_model
from .adapters import decide_adapters, refuse_sequence_parallel
from .attention import decide_attention
from .blocks import ran_modules, spans_within_blocks, spread_to_untraced
from .context import Context, Decided, Found
from .decision import Attributes, Decisions, Divided, placed
from .dtensor_regions import try_dtensor_regions
from .embeddings import decide_embeddings, decide_head
from .experts import decide_experts, keep_inside_experts, keep_unsplit_experts, pool_experts
from .names import shared_params
from .rest import decide_rest
from .sequence_parallel import apply_sequence_parallel, try_sequence_parallel
from .spans import decide_span, find_spans
from .stream import fit_sequence_parallel
from .ties import untie_unalike
from .uncalled import copy_from_alike, infer_uncalled_parts

__all__ = ["infer_plan"]

# one step of `_decide`: what it found, given what the steps before it decided
Step = Callable[[Context, Decided], Found]

_ANY_TP = 8  # see infer_plan: the tp sizes a plan inferred without one should serve


def infer_plan(
    model: nn.Module,
    *,
    tp_size: int | None = None,
    example_inputs: Any = None,
    loss_parallel: bool = False,
    sequence_parallel: bool = False,
    experts: str = "tensor",
    split_unevenly: bool = True,
) -> Plan:
    """Infer a plan from the model's data flow.

    The model may be on the meta device; no weights are read. `example_inputs` (a tensor, a
    tuple of positional inputs, or a dict of keyword inputs) replaces the inputs guessed from
    the forward signature (`input_ids` of shape (2, 16) for Hugging Face models). With
    `tp_size`, spans it cannot split stay replicated; without, the plan is valid for tp 2
    and records head sizes so that `check_plan` can judge any other tp size.

    With `loss_parallel`, an output head split over the vocab hands back logits still split
    (a DTensor) instead of gathering them; compute the loss inside
    `torch.distributed.tensor.parallel.loss_parallel()`.

    With `sequence_parallel`, the activations between split spans (the residual stream)
    stay a DTensor split over the sequence (dim 1): each span all-gathers its input and
    reduce-scatters its output instead of one all-reduce, and the modules with parameters
    between spans (norms) run on sequence shards. DTensor computes every op on that
    stream, so a model this does not fit fails loudly rather than computing wrong numbers;
    `tpplan verify` checks the numbers.

    Mixture-of-experts layers (3-D expert weights used by batched per-expert matmuls) are
    split per expert like a dense MLP with `experts="tensor"`; with `experts="expert"` each
    rank holds num_experts/tp whole experts, where the trace shows the module takes the
    routing as inputs and reads its number of experts from an attribute (else tensor).

    Attention heads the tp size does not divide are split unevenly (each rank whole heads of
    its own key/value heads), the rules stating the model's head size; with
    `split_unevenly=False` they stay as any split the tp size does not divide, with the
    reason (`tpplan infer --family`: a family's head counts and sizes differ).
    """
    if experts not in ("tensor", "expert"):
        raise ValueError(f"experts must be 'tensor' or 'expert', got {experts!r}.")
    if tp_size is not None and (
        isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1
    ):
        raise ValueError(f"tp_size must be a positive integer or None, got {tp_size!r}.")
    if sequence_parallel:
        refuse_sequence_parallel(model)
    asked = _Asked(
        tp=tp_size or 2,
        # A plan inferred for no particular tp size serves tp 2, 4 and 8 where its heads
        # allow: the layers it gathers must divide by 8 too (a router over 6 experts stays
        # whole).
        gather_tp=tp_size or _ANY_TP,
        experts=experts,
        loss_parallel=loss_parallel,
        sequence_parallel=sequence_parallel,
        split_unevenly=split_unevenly,
    )
    decisions, attributes = _infer_decisions(model, example_inputs, asked)
    plan = Plan(
        model=ModelInfo(
            class_=type(model).__name__,
            fingerprint=fingerprint(model),
            parameters=parameter_shapes(model),
        ),
        options=Options(loss_parallel=loss_parallel, sequence_parallel=sequence_parallel),
        rules=_rules(model, decisions),
        attributes=_attribute_rules(model, attributes),
    )
    plan = try_dtensor_regions(model, plan, asked.tp, example_inputs)
    if sequence_parallel:
        plan = fit_sequence_parallel(model, plan, example_inputs)
        plan = try_sequence_parallel(model, plan, asked.tp, example_inputs)
    return plan


@dataclass(frozen=True)
class _Asked:
    """What infer_plan was asked for."""

    tp: int
    gather_tp: int
    experts: str
    loss_parallel: bool
    sequence_parallel: bool
    split_unevenly: bool = True


def _infer_decisions(
    model: nn.Module, example_inputs: Any, asked: _Asked
) -> tuple[Decisions, Attributes]:
    """Trace the model, decide, and decide what the trace could not see: the untraced blocks
    of long stacks, and the parts the forward did not call."""
    trace = trace_model(model, example_inputs=example_inputs)
    decisions, attributes = _decide(model, trace, asked)
    if trace.stacks.traced:
        spread = spread_to_untraced(trace, decisions), spread_to_untraced(trace, attributes)
        if spans_within_blocks(trace) and spread[0] is not None and spread[1] is not None:
            decisions, attributes = spread[0], spread[1]
        else:
            # a span crossed blocks, or twins disagreed: trace every block
            trace = trace_model(model, example_inputs=example_inputs, shorten=False)
            decisions, attributes = _decide(model, trace, asked)
    ran = ran_modules(trace)
    shared = shared_params(model)
    decisions, attributes = copy_from_alike(model, decisions, attributes, trace, ran, shared)
    used = trace.params.outside | set(trace.params.in_span)
    # a part's outputs go on into the model whole: not left split for a loss or over the sequence
    alone = replace(asked, loss_parallel=False, sequence_parallel=False)

    def infer_part(part: nn.Module, inputs: Any) -> tuple[Decisions, Attributes]:
        return _infer_decisions(part, inputs, alone)

    return infer_uncalled_parts(model, decisions, attributes, ran, shared, used, infer_part)


def _decide(model: nn.Module, trace: Trace, asked: _Asked) -> tuple[Decisions, Attributes]:
    """The decisions of one trace, step by step: each step reads what the steps before it
    decided and hands back what it found, which `Decided.merge` lays over it (a later
    step's word on a module replaces an earlier one's: the order below is the precedence)."""
    ctx = Context.of(
        model,
        trace,
        tp=asked.tp,
        gather_tp=asked.gather_tp,
        loss_parallel=asked.loss_parallel,
        sequence_parallel=asked.sequence_parallel,
        split_unevenly=asked.split_unevenly,
    )
    out = Decided()
    for members in find_spans(trace):
        if any(m in trace.experts.roles for m in members):
            out = out.merge(decide_experts(ctx, members, asked.experts))
        else:
            out = out.merge(decide_span(ctx, out, members))
    steps: list[Step] = [
        pool_experts,  # modules of one structure decide alike
        decide_attention,  # before the rest: its out_proj is its own, never called
        keep_unsplit_experts,
        decide_embeddings,
        decide_head,  # split over the vocab of a table split over it
        # after every split of a weight, since tied holders must split it alike; before the
        # rest, which decides what this keeps whole
        untie_unalike,
        decide_rest,
        keep_inside_experts,  # overrides what the steps above decided inside experts
    ]
    if asked.sequence_parallel:
        steps.append(apply_sequence_parallel)  # rewrites the rules: it needs all of them
    steps.append(decide_adapters)  # last: each adapter follows its base's final rule
    for step in steps:
        out = out.merge(step(ctx, out))
    return out.decisions, out.attributes


def _rules(model: nn.Module, decisions: Decisions) -> list[Rule]:
    """One rule per group of modules with equal decisions, as compact patterns, in module order."""
    names = [n for n, _ in model.named_modules() if n]
    groups: dict[str, tuple[Rule, list[str]]] = {}
    for n in names:
        if n in decisions:
            rule = decisions[n]
            groups.setdefault(rule.model_dump_json(), (rule, []))[1].append(n)
    return [placed(r, p) for r, members in groups.values() for p in collapse(members, names)]


def _attribute_rules(model: nn.Module, attributes: Attributes) -> list[AttributeRule]:
    """One attribute rule per group of modules dividing the same attributes for one reason."""
    names = [n for n, _ in model.named_modules() if n]
    groups: dict[Divided, list[str]] = {}
    for n in names:
        for entry in attributes.get(n, ()):
            groups.setdefault(entry, []).append(n)
    return [
        AttributeRule(
            match=p,
            divide=list(d.attrs),
            why=d.why,
            **({} if d.by is None else {"by": d.by, "of": d.of}),
            **({} if d.uneven is None else {"uneven": d.uneven}),
        )
        for d, members in groups.items()
        for p in collapse(members, names)
    ]
