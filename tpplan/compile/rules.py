"""The plan-to-torch compiler: each rule of a plan becomes one torch ParallelStyle.

Start at `plan_to_torch` (whose result `shard_model` applies): every rule is compiled by the
builder registered for its style's class (`builds`, as torch registers a rule per op) and
expanded to the modules its pattern matches. Most rules become torch's own styles (ColwiseParallel, RowwiseParallel, SequenceParallel,
PrepareModuleInput/Output); the styles torch lacks are built in the modules beside this one:

- colwise with `parts`, `transposed` or `output`: `Colwise` (linear.py);
- colwise with `replicate_heads`: `SharedHeadsColwise` (shared_heads.py);
- colwise and rowwise with uneven heads: `Colwise` and `Rowwise` on their own rows (linear.py,
  uneven_heads.py);
- rowwise: `Rowwise` (linear.py);
- colwise and rowwise on a convolution of one group: `ChannelConv` (conv.py);
- vocab_parallel with `sum_at: lookup`: `SumAtLookup` (embeddings.py);
- vocab_parallel with `written`: `WrittenRows` (embeddings.py);
- replicate_grad_sum: `ReplicateGradSum`, split_params: `SplitParams` (params.py);
- experts: `Experts` (experts.py);
- heads: `HeadParallelAttention` (attention.py), torch's nn.MultiheadAttention by heads.

Every parameter stays a DTensor whose full tensor is the unsharded one (a fused one of equal
parts a `_StridedShard`, strided.py), so torch's state-dict, optimizer and checkpoint APIs
see the unsharded model's layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    SequenceParallel,
)

from .._runtime.facts import channel_conv
from ..errors import TpplanError
from ..plan.layouts import parse_layout
from ..plan.patterns import match_names
from ..plan.rule import Rule
from ..plan.schema import Plan
from ..plan.styles import (
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
from .attention import HeadParallelAttention
from .conv import ChannelConv
from .embeddings import SumAtLookup, WrittenRows
from .experts import Experts
from .linear import Colwise, Rowwise
from .params import ReplicateGradSum, SplitParams
from .shared_heads import SharedHeadsColwise

__all__ = ["BUILDERS", "Build", "builds", "placement", "plan_to_torch", "rule_to_style"]


@dataclass(frozen=True)
class Build:
    """What a builder is told about the modules a rule's style is built for."""

    conv: bool = False
    """They are convolutions of one group (`channel_conv`): channels split as a Linear's features."""
    local_shards: bool = True
    """Split layers whose sizes are local may run on their shards (local_run.py); False
    runs every one on DTensors (`apply_plan(..., local_shards=False)`)."""


R = TypeVar("R", bound=Rule)
Builder = Callable[[Any, Build], ParallelStyle | None]
# style class -> the function that builds its torch style (None: the module is left alone)
BUILDERS: dict[type[Rule], Builder] = {}


def builds(cls: type[R]) -> Callable[[Callable[[R, Build], ParallelStyle | None]], Builder]:
    """Register the decorated function as the builder of rules of the style class `cls`."""

    def register(fn: Callable[[R, Build], ParallelStyle | None]) -> Builder:
        BUILDERS[cls] = fn
        return fn

    return register


def plan_to_torch(
    plan: Plan, model: nn.Module, *, local_shards: bool = True
) -> dict[str, ParallelStyle]:
    """{full module name: style} in the model's module order, every rule expanded.

    `local_shards`: colwise, rowwise and vocab-parallel layers whose sizes are local run on
    their shards with direct collectives (local_run.py); False runs every one on DTensors."""
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    by_name: dict[str, ParallelStyle] = {}
    for rule in plan.rules:
        built: dict[bool, ParallelStyle | None] = {}  # one style per kind of module matched
        for name in match_names(rule.match, names):
            conv = channel_conv(modules[name])
            if conv not in built:
                built[conv] = rule_to_style(rule, Build(conv=conv, local_shards=local_shards))
            style = built[conv]
            if style is not None:
                by_name[name] = style
    return {n: by_name[n] for n in names if n in by_name}


def rule_to_style(rule: Rule, build: Build | None = None) -> ParallelStyle | None:
    """The style object for one rule, by its style's builder; None for a module left alone."""
    return BUILDERS[type(rule)](rule, build or Build())


def placement(layout: str | None) -> Placement | None:
    """The DTensor placement a layout string names (None stays None)."""
    if layout is None:
        return None
    kind, dim = parse_layout(layout)
    if kind == "shard":
        assert dim is not None  # parse_layout always returns a dim for shard
        return Shard(dim)
    return Replicate() if kind == "replicate" else Partial()


def _placements(layouts: list[str | None] | None) -> tuple[Placement | None, ...] | None:
    return None if layouts is None else tuple(placement(x) for x in layouts)


def _local_output(rule: Any) -> dict[str, Any]:
    """The rule's `local_output` as torch's keyword, where the rule gives one."""
    return {} if rule.local_output is None else {"use_local_output": rule.local_output}


def _layouts(rule: ColwiseRule | RowwiseRule | VocabParallelRule) -> dict[str, Any]:
    """The rule's input and output layouts and local_output as torch's keywords."""
    kw = _local_output(rule)
    if rule.input is not None:
        kw["input_layouts"] = placement(rule.input)
    if rule.output is not None:
        kw["output_layouts"] = placement(rule.output)
    return kw


@builds(ColwiseRule)
def _colwise(rule: ColwiseRule, build: Build) -> ParallelStyle:
    """tpplan's Colwise (torch's, extended to fused and (in, out) weights and to running on
    local shards); a key/value projection sharing whole heads among ranks, or a
    convolution of one group, its own."""
    if build.conv:
        return _conv_style(rule, rowwise=False)
    kw = _layouts(rule)
    group = rule.uneven_group()
    if group is not None:
        # heads tp does not divide, each rank its own whole heads (uneven_heads.py)
        assert rule.head_dim is not None  # uneven_group says it has one
        return Colwise(
            parts=rule.parts,
            transposed=bool(rule.transposed),
            local_shards=build.local_shards,
            uneven_heads=(rule.head_dim, group),
        )
    if rule.replicate_heads and rule.parts:
        # q|k|v in one Linear: its key/value pieces' heads shared, on its own rows
        assert rule.head_dim is not None, "plan_to_torch takes a plan complete_plan completed"
        return Colwise(
            parts=rule.parts,
            local_shards=build.local_shards,
            shared_head_dim=rule.head_dim,
            **kw,
        )
    if rule.replicate_heads:
        # check/complete.py reads a head_dim the rule leaves out from the model
        assert rule.head_dim is not None, "plan_to_torch takes a plan complete_plan completed"
        return SharedHeadsColwise(
            head_dim=rule.head_dim,
            input_layouts=kw.get("input_layouts"),
            local_shards=build.local_shards,
            whole=rule.local_output is False,
        )
    return Colwise(
        parts=rule.parts, transposed=bool(rule.transposed), local_shards=build.local_shards, **kw
    )


@builds(RowwiseRule)
def _rowwise(rule: RowwiseRule, build: Build) -> ParallelStyle:
    if build.conv:
        return _conv_style(rule, rowwise=True)
    group = rule.uneven_group()
    return Rowwise(
        parts=rule.parts,
        transposed=bool(rule.transposed),
        local_shards=build.local_shards,
        uneven_heads=None if group is None else (rule.head_dim or 0, group),
        **_layouts(rule),
    )


@builds(VocabParallelRule)
def _vocab_parallel(rule: VocabParallelRule, build: Build) -> ParallelStyle:
    """torch's RowwiseParallel on an Embedding (or its lookup on the local rows), and the
    vocab-parallel styles for an embedding whose forward does more than look up."""
    kw = _layouts(rule)
    kw.setdefault("input_layouts", Replicate())
    if rule.sum_at == "lookup":
        return SumAtLookup()
    if rule.written is not None:
        return WrittenRows(
            written=rule.written,
            output_layouts=kw.get("output_layouts"),
            use_local_output=kw.get("use_local_output", True),
        )
    return Rowwise(local_shards=build.local_shards, **kw)


def _conv_style(rule: ColwiseRule | RowwiseRule, *, rowwise: bool) -> ChannelConv:
    """colwise or rowwise on a convolution of one group: its channels are split as a Linear's
    features (conv.py), fused pieces (`parts`) included. Its weight is never stored
    transposed."""
    if rule.transposed or rule.uneven_group() is not None:
        what = "transposed" if rule.transposed else "uneven heads"
        raise TpplanError(
            f"rule {rule.match!r} splits a convolution, which takes no {what}; "
            "drop it from the rule."
        )
    shared = isinstance(rule, ColwiseRule) and rule.replicate_heads and rule.parts
    return ChannelConv(
        rowwise=rowwise,
        parts=rule.parts,
        shared_head_dim=rule.head_dim if shared else None,
        input_layouts=placement(rule.input),
        output_layouts=placement(rule.output),
        **_local_output(rule),
    )


@builds(SequenceParallelRule)
def _sequence_parallel(rule: SequenceParallelRule, build: Build) -> ParallelStyle:
    _, dim = parse_layout(rule.input or "shard(1)")
    return SequenceParallel(sequence_dim=dim if dim is not None else 1, **_local_output(rule))


@builds(PrepareRule)
def _prepare(rule: PrepareRule, build: Build) -> ParallelStyle:
    """torch's PrepareModuleInput, PrepareModuleOutput or both, by the layouts the rule
    gives."""
    has_in = any(
        x is not None
        for x in (rule.inputs, rule.desired_inputs, rule.input_kwargs, rule.desired_input_kwargs)
    )
    has_out = rule.outputs is not None or rule.desired_outputs is not None
    ins: dict[str, Any] = {
        "input_layouts": _placements(rule.inputs),
        "desired_input_layouts": _placements(rule.desired_inputs),
        "input_kwarg_layouts": {k: placement(v) for k, v in (rule.input_kwargs or {}).items()}
        or None,
        "desired_input_kwarg_layouts": {
            k: placement(v) for k, v in (rule.desired_input_kwargs or {}).items()
        }
        or None,
    }
    outs: dict[str, Any] = {
        "output_layouts": _placements(rule.outputs),
        "desired_output_layouts": _placements(rule.desired_outputs),
    }
    local_in: dict[str, Any] = (
        {} if rule.local_input is None else {"use_local_input": rule.local_input}
    )
    if has_in and has_out:
        return PrepareModuleInputOutput(**ins, **outs, **local_in, **_local_output(rule))
    if has_out:
        return PrepareModuleOutput(**outs, **_local_output(rule))
    # PrepareModuleInput names its flag for plain local inputs use_local_output
    local_in_only: dict[str, Any] = (
        {} if rule.local_input is None else {"use_local_output": rule.local_input}
    )
    return PrepareModuleInput(**ins, **local_in_only)


@builds(ReplicateRule)
def _replicate(rule: ReplicateRule, build: Build) -> None:
    return None  # the module is left alone


@builds(ReplicateGradSumRule)
def _replicate_grad_sum(rule: ReplicateGradSumRule, build: Build) -> ParallelStyle:
    return ReplicateGradSum()


@builds(SplitParamsRule)
def _split_params(rule: SplitParamsRule, build: Build) -> ParallelStyle:
    assert rule.shard is not None  # the rule's validator requires it
    return SplitParams(shard=rule.shard, fused=rule.fused)


@builds(ExpertsRule)
def _experts(rule: ExpertsRule, build: Build) -> ParallelStyle:
    assert rule.shard is not None  # the rule's validator requires it
    return Experts(
        mode=rule.mode or "tensor",
        shard=rule.shard,
        fused=rule.fused,
        after_sum=rule.after_sum,
        added_whole=rule.added_whole,
    )


@builds(HeadsRule)
def _heads(rule: HeadsRule, build: Build) -> ParallelStyle:
    return HeadParallelAttention()
