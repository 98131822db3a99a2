"""Sequence parallel: the stream between split spans (the residual stream) stays a
DTensor split over the sequence (dim 1), instead of whole on every rank.

Start at `apply_sequence_parallel`, which rewrites the decisions once every module has one:
what ends a span reduce-scatters onto sequence shards, what opens one all-gathers its
input, and the modules with parameters on the stream (norms) run on sequence shards.
`try_sequence_parallel` then runs the plan once on fake ranks, so a model this does not fit
fails at infer time.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..plan.schema import Plan
from ..plan.styles import (
    ColwiseRule,
    PrepareRule,
    ReplicateRule,
    RowwiseRule,
    SequenceParallelRule,
    VocabParallelRule,
)
from .context import Context, Decided, Found
from .decision import Decisions, decided, reasoned
from .embeddings import not_linear_lookup
from .names import join, own_params, relative

__all__ = ["apply_sequence_parallel", "try_sequence_parallel"]


def apply_sequence_parallel(ctx: Context, so_far: Decided) -> Found:
    """Keep the stream between split spans split over the sequence (dim 1): four
    rewrites, each of the rules as the ones before it left them."""
    found = Found()
    for rewrite in (
        _routers_on_the_stream,
        _scatter_outputs,
        _gather_span_inputs,
        _stream_params_on_shards,
    ):
        found.rules.update(rewrite(ctx, so_far.merge(found)))
    return found


def _routers_on_the_stream(ctx: Context, out: Decided) -> Decisions:
    """A router kept whole takes its module's input, which sequence parallel makes a
    DTensor: a plain weight cannot meet it. Split with its output gathered, its colwise
    style takes the stream as DTensor computes it."""
    rules: Decisions = {}
    for name, gathered in out.routers.items():
        if gathered is not None:
            rules[name] = reasoned(
                gathered,
                gathered.why + "; sequence parallel: a router kept whole would meet the "
                "sequence-split stream with a plain weight",
            )
    return rules


def _scatter_outputs(ctx: Context, out: Decided) -> Decisions:
    """Partial sums (rowwise outputs, vocab-parallel lookups) are reduce-scattered onto
    sequence shards; a gathered head gathers its input over the sequence first."""
    t = ctx.trace
    scatter = "; sequence parallel: reduce-scattered onto sequence shards, left a DTensor"
    rules: Decisions = {}
    for name, d in out.decisions.items():
        if isinstance(d, VocabParallelRule) and d.sum_at is not None:
            # its rows are summed inside its forward, whole: nothing there to scatter
            why = not_linear_lookup(t.lookups.not_linear[name])
            rules[name] = decided(
                ReplicateRule, f"{why} (where sequence parallel reduce-scatters them)"
            )
        elif isinstance(d, VocabParallelRule) or (isinstance(d, RowwiseRule) and d.output is None):
            rules[name] = reasoned(d, d.why + scatter, output="shard(1)", local_output=False)
        elif isinstance(d, ColwiseRule) and d.output == "replicate" and name in t.spans.at_output:
            rules[name] = reasoned(
                d,
                d.why + "; sequence parallel: its input is gathered over the sequence first",
                input="shard(1)",
            )
    return rules


def _gather_span_inputs(ctx: Context, out: Decided) -> Decisions:
    """Each split span all-gathers its input over the sequence: once, at the module that
    holds its openers when they all take that module's input (prepare), else each opener
    its own."""
    t = ctx.trace
    gather = (
        "sequence parallel: all-gathers its input over the sequence, since {} need whole sequences"
    )
    rules: Decisions = {}
    for openers, _ in out.split_spans:
        parent = _common_parent(openers)
        entry = t.layers.entries.get(parent)
        if (
            entry is not None
            and all(t.layers.entries.get(o, (0, -1))[1] == entry[1] for o in openers)
            and parent
            and parent not in openers
            and parent not in out.decisions
            and parent not in rules
        ):
            rules[parent] = _gathering(
                gather.format(
                    join(sorted(relative([*openers, parent]).get(o, o) for o in openers))
                ),
                entry[0],
                t.layers.positional.get(parent, 1),
            )
            continue
        for o in openers:  # each opener gathers its own input
            d = rules.get(o, out.decisions[o])
            rules[o] = reasoned(d, d.why + "; " + gather.format("it"), input="shard(1)")
    return rules


def _gathering(why: str, where: int | str, positional: int) -> PrepareRule:
    """A prepare rule that all-gathers the module's input at `where` (a positional index
    or a keyword) over the sequence, the module taking `positional` positional inputs (one
    layout each; the others pass as they are)."""
    if isinstance(where, str):
        return decided(
            PrepareRule,
            why,
            input_kwargs={where: "shard(1)"},
            desired_input_kwargs={where: "replicate"},
            local_input=True,
        )
    rest: list[str | None] = [None] * (positional - where - 1)
    return decided(
        PrepareRule,
        why,
        inputs=[None] * where + ["shard(1)", *rest],
        desired_inputs=[None] * where + ["replicate", *rest],
        local_input=True,
    )


def _stream_params_on_shards(ctx: Context, out: Decided) -> Decisions:
    """Modules whose parameters act on the stream (norms) run on sequence shards. Not one
    whose submodules hold parameters too (an attention kept whole with a bias table of its
    own): torch's SequenceParallel replicates only a module's own parameters, and the
    module runs as its rules and the stream make it."""
    t = ctx.trace
    rules: Decisions = {}
    for name, module in ctx.modules.items():
        if name in out.decisions or name in t.layers.linears or isinstance(module, nn.Embedding):
            continue
        if any(True for c in module.children() for _ in c.parameters()):
            continue
        own = own_params(module, name)
        if own and name in t.layers.entries and any(p in t.params.outside for p in own):
            rules[name] = decided(
                SequenceParallelRule,
                "its parameters act on the stream between split regions, which sequence "
                "parallel keeps split over the sequence; they are replicated and it runs on "
                "each rank's shard of the sequence",
            )
    return rules


def _common_parent(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    k = 0
    while all(len(p) > k for p in parts) and len({p[k] for p in parts}) == 1:
        k += 1
    return ".".join(parts[0][:k])


def try_sequence_parallel(model: nn.Module, plan: Plan, tp: int, example_inputs: Any) -> Plan:
    """Run the plan as check_plan does (a meta copy over fake ranks) until it runs, summing
    whole where the sequence-split layout does not fit a module's code
    (`stream.settle_sequence_parallel`); a stream the model mixes with plain tensors where
    nothing can hold it fails here, with a message, rather than in the user's first
    forward."""
    # imported here: the dry run brings in torch.distributed, which nothing else needs
    from ..check.run import run_plan
    from .stream import settle_sequence_parallel

    given = None
    if example_inputs is not None:
        from .dtensor_regions import example_call

        given = example_call(model, example_inputs)

    def first_problem(p: Plan) -> Any:
        # strict: a stream the dry run cannot follow to the end (a router reading the split
        # stream's values) is not offered, where a plain plan would only get a note
        return next(iter(run_plan(p, model, tp_size=tp, given=given, strict=True)), None)

    return settle_sequence_parallel(model, plan, tp, example_inputs, first_problem)
