"""Sequence parallel fitted to the model's own forward: where the sequence-split stream (a
DTensor) really flows, and where it meets whole tensors.

Start at `fit_sequence_parallel`, which infer_plan calls once a sequence-parallel plan is
made. The plan's rules say what turns the stream into a DTensor split over the sequence: a
vocab-parallel lookup or a rowwise layer reduce-scattering onto sequence shards. The rules
on the modules between them (norms run on sequence shards, a module gathering its input)
assume their input is that DTensor. That holds in a model whose stream starts at a token
lookup; elsewhere (a patch embedding, a Linear over latents, blocks fed by more than one
stream) the first block sees the stream whole, and a norm told its plain input is a
sequence shard would compute on the wrong rows. So a forward on fake tensors follows which
tensors would be DTensors under the plan (`_follow`):

1. a rule that reads its input as the stream keeps it only where the input is the stream;
   elsewhere the module runs whole, as it would without sequence parallel;
2. a module whose own code meets the stream with a whole tensor (a residual add of the
   whole input to the first reduce-scattered output, modulation scales computed from a
   timestep) becomes a stream region (`RegionRule(stream=True)`): while it runs, whole
   tensors meeting DTensors are lifted to replicated DTensors (no copy, no collective),
   as in DTensor regions;
3. a module the stream enters and does not leave (a classifier head), or one kept whole,
   gathers it as it comes in (`_exits`); a lookup whose rows the model's own forward adds
   to sums them whole, so the stream starts at the first block (`_whole_lookups`).

`settle_sequence_parallel` then runs the plan on fake ranks: where that fails inside a
module whose layers reduce-scatter (a window's tokens in dim 1, not the sequence), they
sum whole and the stream is fitted again. What cannot be fitted (the model's own forward
mixes the two outside any submodule, or hands the stream back as its output) raises,
naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .._runtime.fake import meta_copy
from .._runtime.torch_compat import DisableTorchFunction, FakeTensorMode, tree_flatten
from ..errors import TpplanError
from ..plan.patterns import collapse, match_names
from ..plan.schema import Plan, RegionRule, Rule
from ..plan.styles import (
    ColwiseRule,
    PrepareRule,
    ReplicateRule,
    RowwiseRule,
    SequenceParallelRule,
    VocabParallelRule,
)
from ..plan.versions import SCHEMA_VERSION
from ..trace import quiet_fake_tensor_log
from .dtensor_regions import call_fake, collapsed, example_call, per_module

__all__ = ["fit_sequence_parallel", "settle_sequence_parallel"]

# styles whose module computes on DTensors itself (its parameters are DTensors, its input is
# made one): what its own code does is torch's, and its output is a DTensor only as the rule
# says (`_hands_on_stream`)
_ON_DTENSORS = (ColwiseRule, RowwiseRule, VocabParallelRule, SequenceParallelRule)
# what sequence_parallel.py appends to a layer's reason when it gathers its own input
_GATHERS_INPUT = re.compile(
    r"; sequence parallel: (its input is gathered over the sequence first"
    r"|all-gathers its input over the sequence[^;]*)"
)
# what sequence_parallel.py appends to a layer's reason when it reduce-scatters its output
_SCATTERED = "; sequence parallel: reduce-scattered onto sequence shards, left a DTensor"
_GATHERED_WHY = "; sequence parallel: its input is gathered over the sequence first"
_STREAM_WHY = (
    "sequence parallel: its forward meets the sequence-split stream (a DTensor) with whole "
    "tensors ({}); while it runs, those are lifted to replicated DTensors (no copy, no "
    "collective) so DTensor computes the op"
)


def fit_sequence_parallel(model: nn.Module, plan: Plan, example_inputs: Any) -> Plan:
    """`plan` with its sequence-parallel rules kept where the stream flows, and stream
    regions where the model's code meets it with whole tensors (see the module docstring).
    `plan` itself where the fake forward cannot run (the dry run then tells)."""
    names = [n for n, _ in model.named_modules() if n]
    rules = per_module(plan, names)
    held = {m for r in plan.regions for m in match_names(r.match, names)}
    args, kwargs = example_call(model, example_inputs)
    seen = _follow(model, rules, held, args, kwargs)
    if seen is not None and "" in seen.mixes and (whole := _whole_lookups(rules)):
        # nanoGPT adds position embeddings to the looked-up rows in its own forward: the
        # lookup sums its rows whole, and the stream starts at the first block instead
        rules = {**rules, **whole}
        seen = _follow(model, rules, held, args, kwargs)
    if seen is None:
        return plan
    exits = _exits(seen, rules, held)
    if exits:
        rules = {**rules, **exits}
        seen = _follow(model, rules, held, args, kwargs)
        if seen is None:
            return plan
    cls = type(model).__name__
    if "" in seen.mixes:
        raise TpplanError(
            f"sequence parallel does not fit {cls}: its own forward meets the "
            f"sequence-split stream with whole tensors ({', '.join(sorted(seen.mixes['']))}), "
            "outside any submodule a region could hold. Infer without sequence parallel, or write "
            "those rules by hand."
        )
    if seen.output:
        raise TpplanError(
            f"sequence parallel does not fit {cls}: its output is the sequence-split stream "
            "itself (no layer gathers it back). Infer without sequence parallel, or write "
            "those rules by hand."
        )
    kept = {n: r for n, r in ((n, _fitted(r, seen.fed.get(n))) for n, r in rules.items()) if r}
    stream = {m: ops for m, ops in seen.mixes.items() if m not in held}
    if kept == rules and not stream:
        return plan
    return _rebuilt(plan, kept, stream, names)


def settle_sequence_parallel(
    model: nn.Module, plan: Plan, tp: int, example_inputs: Any, run: Any
) -> Plan:
    """`plan` once a run on fake ranks (`run(plan)`: the first problem, or None) passes:
    where it fails inside a module whose split layers reduce-scatter onto the sequence
    (Swin's windowed attention, whose dim 1 is a window's tokens, not the sequence), those
    layers sum whole instead (one all-reduce, as without sequence parallel) and the stream
    is fitted again around them. Raises, naming the failure, where that does not help."""
    names = [n for n, _ in model.named_modules() if n]
    for _ in range(len(names)):
        problem = run(plan)
        if problem is None:
            return plan
        whole = _summed_whole(per_module(plan, names), problem.module)
        if not whole:
            break
        merged = {**per_module(plan, names), **whole}
        per = {n: r for n, r in merged.items() if r is not None}
        plan = fit_sequence_parallel(model, _rebuilt(plan, per, {}, names), example_inputs)
    else:
        problem = run(plan)
    raise TpplanError(
        f"sequence parallel does not fit {type(model).__name__}: its forward mixes the "
        f"sequence-split stream with whole tensors ({problem.message.rstrip('.')}). "
        "Infer without sequence parallel, or write those rules by hand."
    )


def _summed_whole(rules: dict[str, Rule], failed: str | None) -> dict[str, Rule | None]:
    """For the innermost module at or around `failed` holding layers that reduce-scatter
    onto the sequence: those layers summing whole instead, and the rule gathering that
    module's input dropped (None), so the stream is fitted again around it."""
    if failed is None:
        return {}
    scope: str | None = failed
    while scope is not None:
        closers = {
            n: r
            for n, r in rules.items()
            if (n == scope or n.startswith(f"{scope}.") or not scope)
            and isinstance(r, RowwiseRule)
            and r.output == "shard(1)"
        }
        if closers:
            break
        scope = scope.rpartition(".")[0] if scope else None
    if scope is None:
        return {}
    out: dict[str, Rule | None] = {
        n: _summed(
            r,
            "sequence parallel stops around it (its output is summed whole, as without it): "
            "the sequence-split layout does not fit the module's own code",
        )
        for n, r in closers.items()
    }
    for n, r in rules.items():
        inside = n == scope or n.startswith(f"{scope}.")
        if inside and isinstance(r, PrepareRule) and (r.inputs or r.input_kwargs):
            out[n] = None
    return out


def _whole_lookups(rules: dict[str, Rule]) -> dict[str, Rule]:
    """Each vocab-parallel lookup that reduce-scatters its rows onto sequence shards, made
    to sum them whole instead (one all-reduce, as without sequence parallel)."""
    return {
        n: _summed(
            r,
            "sequence parallel starts after it, since the model's own forward adds whole "
            "tensors to its rows",
        )
        for n, r in rules.items()
        if isinstance(r, VocabParallelRule) and r.output == "shard(1)"
    }


def _summed(rule: Rule, why: str) -> Rule:
    """`rule` summing its output whole (one all-reduce) instead of reduce-scattering it onto
    sequence shards, with `why` said."""
    return rule.model_copy(
        update={
            "output": None,
            "local_output": None,
            "why": f"{rule.why.replace(_SCATTERED, '')}; {why}",
        }
    )


def _exits(seen: _Seen, rules: dict[str, Rule], held: set[str]) -> dict[str, Rule]:
    """A `prepare` rule for each outermost module the stream enters and does not leave (its
    output is whole: a classifier head pooling the tokens, an attention kept whole), and for
    each module kept whole (style replicate) the stream reaches: its input is gathered over
    the sequence as it comes in, so its own code runs on whole tensors as without sequence
    parallel (DTensor's partial averages over the sequence, a pooling's, have no backward
    into a sum)."""
    found: dict[str, Rule] = {}
    for name, (args, kwargs) in seen.given.items():
        kept = rules.get(name)
        if kept is not None and not isinstance(kept, ReplicateRule):
            continue  # (one kept whole can gather too: prepare splits nothing either)
        if name in held or not (any(args) or any(kwargs.values())):
            continue
        # one kept whole gathers wherever the stream reaches it: it runs as without it
        if name not in seen.computes or (kept is None and seen.hands_on.get(name, True)):
            continue
        if any(name.startswith(f"{f}.") for f in found):
            continue
        inputs = ["shard(1)" if a else None for a in args] if any(args) else None
        taken = {k: "shard(1)" for k, v in kwargs.items() if v} or None
        found[name] = PrepareRule(
            match=name,
            inputs=inputs,
            desired_inputs=[None if x is None else "replicate" for x in inputs or []] or None,
            input_kwargs=taken,
            desired_input_kwargs={k: "replicate" for k in taken or {}} or None,
            local_input=True,
            why=(f"{kept.why}; " if kept is not None else "")
            + (
                "sequence parallel: the stream ends in it (its output is whole), so its "
                "input is gathered over the sequence as it comes in and it runs as without "
                "sequence parallel"
            ),
        )
    return found


def _fitted(rule: Rule, fed: bool | None) -> Rule | None:
    """The rule as the stream reaches its module (`fed`: its input is the stream; None: it
    did not run): unchanged where that holds or cannot be told; where the input is whole,
    without what reads it as the stream (None: no rule, the module runs whole)."""
    if fed and isinstance(rule, ColwiseRule) and rule.input is None:
        # the stream (a DTensor) reaches it: gathered in its input hook, as a layout
        return rule.model_copy(update={"input": "shard(1)", "why": rule.why + _GATHERED_WHY})
    if fed is None or fed:
        return rule
    if isinstance(rule, SequenceParallelRule):
        return None
    if isinstance(rule, PrepareRule) and (rule.inputs or rule.input_kwargs):
        return None
    if isinstance(rule, ColwiseRule) and rule.input == "shard(1)":
        return rule.model_copy(update={"input": None, "why": _GATHERS_INPUT.sub("", rule.why)})
    return rule


def _rebuilt(
    plan: Plan, per: dict[str, Rule], stream: dict[str, set[str]], names: list[str]
) -> Plan:
    """The plan from per-module rules, collapsed to patterns again in module order, with a
    stream region for each module in `stream` ({module: the ops that met the stream})."""
    rules = collapsed(per, names)
    whys: dict[str, list[str]] = {}
    for m in names:
        if m in stream:
            whys.setdefault(_STREAM_WHY.format(", ".join(sorted(stream[m]))), []).append(m)
    regions = [
        RegionRule(match=p, why=why, stream=True)
        for why, ms in whys.items()
        for p in collapse(ms, names)
    ]
    return plan.model_copy(
        update={"rules": rules, "regions": [*plan.regions, *regions], "tpplan": SCHEMA_VERSION}
    )


# ---- the fake forward -------------------------------------------------------------------------
@dataclass
class _Seen:
    fed: dict[str, bool] = field(default_factory=dict)
    """Module -> whether the input its rule reads as the stream was the stream (first call;
    False if any call got it whole)."""
    mixes: dict[str, set[str]] = field(default_factory=dict)
    """Module whose own code met the stream with a whole tensor -> the ops that did."""
    output: bool = False
    """Whether the model's output is the stream."""
    given: dict[str, tuple[list[bool], dict[str, bool]]] = field(default_factory=dict)
    """Module -> which of its positional and keyword inputs were the stream (first call)."""
    hands_on: dict[str, bool] = field(default_factory=dict)
    """Module -> whether its output was the stream (first call)."""
    computes: set[str] = field(default_factory=set)
    """Modules inside which an op computed a tensor from the stream (not only read its
    dtype or device, as a rotary table's module does)."""


class _Stream(TorchFunctionMode):
    """Marks which tensors would be DTensors under the plan (`ids`), and notes every op of
    a module's own code that meets one with a whole tensor of more than one element (DTensor
    takes a one-element plain tensor as a scalar)."""

    def __init__(self, seen: _Seen) -> None:
        super().__init__()
        self.seen = seen
        self.ids: set[int] = set()
        self.keep: list[Any] = []  # tensors whose ids are marked: alive, so ids stay unique
        self.running: list[str] = []  # the modules whose forward is running, innermost last
        self.quiet = 0  # >0 inside a module whose rule runs its own code on DTensors

    def marked(self, tree: Any) -> tuple[bool, bool]:
        """(any tensor of `tree` is the stream, any is whole and larger than a scalar)"""
        leaves, _ = tree_flatten(tree)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        return (
            any(id(t) in self.ids for t in tensors),
            any(id(t) not in self.ids and t.numel() > 1 for t in tensors),
        )

    def mark(self, tree: Any, on: bool = True) -> None:
        leaves, _ = tree_flatten(tree)
        for t in leaves:
            if isinstance(t, torch.Tensor):
                if on:
                    self.ids.add(id(t))
                    self.keep.append(t)
                else:
                    self.ids.discard(id(t))

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        stream, whole = self.marked((args, kwargs))
        if stream:
            if any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
                self.seen.computes.update(self.running)
            if whole and not self.quiet:
                where = self.running[-1] if self.running else ""
                op = getattr(func, "__name__", str(func))
                self.seen.mixes.setdefault(where, set()).add(op)
            self.mark(out)
        return out


def _follow(
    model: nn.Module,
    rules: dict[str, Rule],
    held: set[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> _Seen | None:
    """One forward of a fake copy, following the stream as the plan's rules make it (see
    the module docstring); None when the forward fails on fake tensors."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    copy_ = meta_copy(model, fake=fake).eval()
    seen = _Seen()
    mode = _Stream(seen)
    handles = []

    def enter(name: str) -> Any:
        rule = rules.get(name)
        quiet = name in held or (rule is not None and isinstance(rule, _ON_DTENSORS))

        def hook(m: nn.Module, a: Any, kw: Any) -> Any:
            mode.running.append(name)
            if name not in seen.given:
                seen.given[name] = (
                    [mode.marked(x)[0] for x in a],
                    {k: mode.marked(v)[0] for k, v in kw.items()},
                )
            changed = None
            if rule is not None:
                fed = _reads(rule, a, kw)
                if fed is not None:
                    got = mode.marked(fed)[0]
                    seen.fed[name] = seen.fed.get(name, True) and got
                    if isinstance(rule, PrepareRule) and got and rule.local_input:
                        changed = _gathered(rule, a, kw)  # plain whole tensors inside
            if quiet:
                mode.quiet += 1
            return changed

        return hook

    def leave(name: str) -> Any:
        rule = rules.get(name)
        quiet = name in held or (rule is not None and isinstance(rule, _ON_DTENSORS))

        def hook(m: nn.Module, a: Any, kw: Any, out: Any) -> None:
            mode.running.pop()
            if quiet:
                mode.quiet -= 1
            if rule is not None and isinstance(rule, _ON_DTENSORS):
                mode.mark(out, _hands_on_stream(rule, seen.fed.get(name, False)))
            seen.hands_on.setdefault(name, mode.marked(out)[0])

        return hook

    for name, module in copy_.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(enter(name), with_kwargs=True))
            handles.append(
                module.register_forward_hook(leave(name), with_kwargs=True, always_call=True)
            )
    try:
        with quiet_fake_tensor_log(), fake, mode, torch.no_grad():
            seen.output = mode.marked(call_fake(copy_, fake, args, kwargs))[0]
    except Exception:
        return None
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _gathered(rule: PrepareRule, args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A prepared module's inputs as its own code gets them: the ones its rule gathers are
    new plain tensors (the caller's stays the stream), made where the mode does not see."""

    def plain(t: Any) -> Any:
        with DisableTorchFunction():
            return t.view_as(t) if isinstance(t, torch.Tensor) else t

    layouts = rule.inputs or []
    new_args = tuple(
        plain(a) if i < len(layouts) and layouts[i] == "shard(1)" else a for i, a in enumerate(args)
    )
    taken = rule.input_kwargs or {}
    new_kwargs = {k: plain(v) if taken.get(k) == "shard(1)" else v for k, v in kwargs.items()}
    return new_args, new_kwargs


def _reads(rule: Rule, args: Any, kwargs: Any) -> Any:
    """What of a module's inputs its rule reads as the stream; None when it reads none."""
    if isinstance(rule, SequenceParallelRule):
        return args[:1] or list(kwargs.values())[:1]
    if isinstance(rule, PrepareRule):
        picked = [
            a for a, layout in zip(args, rule.inputs or [], strict=False) if layout == "shard(1)"
        ]
        picked += [kwargs[k] for k, v in (rule.input_kwargs or {}).items() if v == "shard(1)"]
        return picked or None
    if isinstance(rule, ColwiseRule):
        return args[:1]
    return None


def _hands_on_stream(rule: Rule, fed: bool) -> bool:
    """Whether the module's output is the stream (a DTensor) under its rule."""
    if rule.output_layout() == "shard(1)" and rule.hands_dtensors():
        return True  # reduce-scattered onto sequence shards (or a lookup summed there)
    if isinstance(rule, SequenceParallelRule):
        return fed
    return isinstance(rule, ColwiseRule) and rule.local_output is False  # a DTensor region's opener
