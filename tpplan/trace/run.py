"""Running the model once on fake tensors to trace it: `trace_model`, the entry point.

Start at `trace_model`. The model is copied onto fake tensors (shapes and dtypes, no storage;
blocks.py shortens long stacks), its linear layers are found (probe.py), hooks mark every
Linear / Embedding call and every module holding expert weights (hooks.py), and the
`Tracer` (tracer.py) and `AttentionMode` (attention.py) see every op in between. The pass
repeats until the spans settle (`_trace_once`), and falls back to tracing every block or
to the model's own weights where a fake, shortened copy cannot run (`_trace`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from .._runtime.adapters import lora_layers
from .._runtime.facts import channel_conv
from .._runtime.inputs import example_inputs as _derived_inputs
from .._runtime.local import outside_simulation
from .._runtime.torch_compat import (
    ConvNd,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    tree_leaves,
    tree_map,
)
from .._runtime.tree import tensor_leaves
from ..errors import TpplanError
from .attention import AttentionMode
from .blocks import fake_copy, repeated_blocks
from .hooks import (
    hook_attention,
    hook_experts,
    hook_layer,
    track_frames,
    under,
    watch_lookup_places,
    watch_reads,
)
from .probe import linear_like, plain_forward
from .record import Trace
from .tracer import Tracer
from .trackers import Trackers
from .whole import alike, failing_module, run_whole, watch_failures

__all__ = ["TraceError", "idle_roots", "trace_model"]


class TraceError(TpplanError, RuntimeError):
    """The model could not be run on fake tensors to trace it."""

    module: str | None = None
    """The innermost module whose forward raised, where one did (not the model's own)."""


# modules run whole on real tensors, at most, before a trace gives up (whole.py)
_MOST_WHOLE = 16


def trace_model(model: nn.Module, *, example_inputs: Any = None, shorten: bool = True) -> Trace:
    """Run `model` once on fake tensors and return the data-flow facts.

    `shorten` traces long stacks of identical blocks through a prefix (see blocks.py); pass
    False to trace every block.
    """
    # once, on fake tensors: not once per rank when every rank is simulated in this process
    with outside_simulation():
        return _trace(model, example_inputs, shorten)


def _trace(
    model: nn.Module, example_inputs: Any, shorten: bool, whole: dict[str, str] | None = None
) -> Trace:
    whole = whole or {}
    try:
        return _trace_once(model, example_inputs, shorten, real=False, whole=whole)
    except TraceError as failed:
        e = failed
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if shorten and repeated_blocks(model):
        # a forward that indexes its blocks by the config's layer count (Gemma 3n's
        # per-layer inputs) fails on a shortened copy: trace every block instead (a model
        # in memory with the fallbacks below, on its weights; on the meta device only on
        # fake tensors, so that a module run whole runs in the shortened stack)
        try:
            if on_meta:
                return _trace_once(model, example_inputs, False, real=False, whole=whole)
            return _trace(model, example_inputs, False, whole)
        except TraceError:
            pass
    # What cannot run on fake tensors (routing by the values, `nonzero`, `.item()`; a
    # kernel whose fake implementation fails where the real one runs): a model whose
    # weights are in memory is traced on them instead (the tracer watches the same ops;
    # the weights are shared, not copied).
    data_dependent = isinstance(
        e.__cause__, (DataDependentOutputException, DynamicOutputShapeException)
    )
    if not on_meta and e.__cause__ is not None and not whole:
        return _trace_once(model, example_inputs, shorten, real=True, whole={})
    if data_dependent:
        raise TraceError(
            f"{e} Its forward depends on the values (routing by `nonzero` or `.item()`), "
            "which a model on the meta device cannot provide: infer the plan from a "
            "small copy of the model built on the CPU (a config with fewer layers and "
            "narrower widths), and use that plan for the big one."
        ) from e.__cause__
    # on the meta device: the module that failed, and its like in every block of its
    # stack, run whole on real tensors (whole.py)
    if e.module is None or e.module in whole or len(whole) >= _MOST_WHOLE:
        raise e
    cause = e.__cause__
    why = f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
    return _trace(model, example_inputs, shorten, {**whole, **alike(model, e.module, why)})


def _trace_once(
    model: nn.Module, example_inputs: Any, shorten: bool, *, real: bool, whole: dict[str, str]
) -> Trace:
    """Trace until the spans settle: a layer whose split ends somewhere is kept whole or
    gathered by any plan, so its output is whole, but in the pass that found it, it may
    already have reached other layers and tied them into its dead span (ALBERT's shared
    layer, called first on the split output of the embedding projection). Those layers are
    traced again with it whole from the start: the next pass judges them on what the
    sharded model will compute. infer_plan and check_plan both see the settled trace."""
    kept: dict[str, list[str]] = {}
    for _ in range(3):
        trace = _trace_pass(model, example_inputs, shorten, real=real, kept=kept, whole=whole)
        spans = trace.spans
        tied = {
            src: reasons
            for src, reasons in spans.broken.items()
            if src in spans.openers
            and src not in kept
            and any(src in group and len(group) > 1 for group in spans.links)
        }
        if not tied:
            break
        kept = {**kept, **tied}
    return trace


def _trace_pass(
    model: nn.Module,
    example_inputs: Any,
    shorten: bool,
    *,
    real: bool,
    kept: dict[str, list[str]],
    whole: dict[str, str],
) -> Trace:
    """One forward of a fake copy of `model` under the tracer; `kept`: layers kept whole;
    `whole`: modules run whole on real tensors (whole.py)."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    trace = Trace()
    copy_ = fake_copy(model, fake, trace, shorten=shorten, real=real)
    copy_.eval()
    params = {id(p): n for n, p in copy_.named_parameters(remove_duplicate=False)}
    st = Trackers.start(trace, params, kept_whole=kept)
    st.origins.buffers = {id(b): n for n, b in copy_.named_buffers(remove_duplicate=False)}
    wrappers = _find_linears(copy_, fake, trace)
    # after the probes: reads made by a probe's forward are no evidence of the traced one
    watch_reads(copy_, st)
    watch_lookup_places(copy_, st)
    _hook_experts(copy_, st)  # before `track_frames`: see `hook_experts`
    for name, m in copy_.named_modules():
        track_frames(st, name, m)
        if name in wrappers:
            hook_layer(st, wrappers[name], m)  # the adapter's wrapper, as its base layer
        elif name in trace.layers.linears or isinstance(m, nn.Embedding):
            hook_layer(st, name, m)
        elif isinstance(m, nn.MultiheadAttention) and plain_forward(m, nn.MultiheadAttention):
            hook_attention(st, name, m)
    if not real:
        run_whole(copy_, model, whole, fake, st)
    running = watch_failures(copy_)
    args, kwargs = _inputs(model, example_inputs, device, fake if not real else None)
    for x in tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            st.origins.inputs[id(x)] = x
    try:
        with torch.no_grad(), fake if not real else nullcontext(), Tracer(st), AttentionMode(st):
            out = copy_(*args, **kwargs)
    except TpplanError:
        raise
    except Exception as e:
        error = TraceError(
            f"could not run {type(model).__name__} on fake tensors to trace it ({type(e).__name__}: {e}). "
            "Pass example_inputs that its forward accepts, or write the plan by hand."
        )
        error.module = failing_module(running)
        raise error from e
    for t in tensor_leaves(out):
        s = st.splits.split_of(t)
        if s is not None:
            trace.spans.at_output |= s.sources
    return trace


def _find_linears(copy_: nn.Module, fake: FakeTensorMode, trace: Trace) -> dict[str, str]:
    """The linear layers of the copy (`LayerFacts.linears`): nn.Linear modules that run its
    own forward, convolutions of one group (over dim 1, `LayerFacts.channels`), and any other module
    that computes one of its own 2-D weight. A LoRA wrapper (_runtime/adapters.py) computes
    a linear layer of its base's features, adapters included: it is one layer, named as its
    base, and its adapters are not layers of their own. Returns {wrapper: its base's name}."""
    adapters = lora_layers(copy_)
    for adapter in adapters.values():
        base: Any = copy_.get_submodule(adapter.base)  # an nn.Linear (adapters.unsupported)
        trace.layers.linears[adapter.base] = (base.in_features, base.out_features, False)
    for name, m in copy_.named_modules():
        if under(name, adapters):
            continue
        if isinstance(m, nn.Linear) and plain_forward(m, nn.Linear):
            trace.layers.linears[name] = (m.in_features, m.out_features, False)
        elif isinstance(m, ConvNd) and channel_conv(m):
            trace.layers.linears[name] = (m.in_channels, m.out_channels, False)
            trace.layers.channels.add(name)
        elif not isinstance(m, nn.Embedding):
            # a Linear subclass with a forward of its own (a block-diagonal grouped product,
            # say) is judged by what it computes, like any other module
            stored_in_out = linear_like(m, fake)
            if stored_in_out is not None:
                rows, cols = m.weight.shape
                linears = trace.layers.linears
                linears[name] = (rows, cols, True) if stored_in_out else (cols, rows, False)
    return {name: adapter.base for name, adapter in adapters.items()}


def _hook_experts(copy_: nn.Module, st: Trackers) -> None:
    """Hook the modules holding 3-D expert weights, and the parents that sum them."""
    linears = st.trace.layers.linears
    holders = {
        name: m
        for name, m in copy_.named_modules()
        # a convolution's 3-D weight (Conv1d's) is a kernel, not one matrix per expert
        if not isinstance(m, (nn.Linear, nn.Embedding, ConvNd))
        and name not in linears
        and any(p.dim() == 3 for p in m.parameters(recurse=False))
    }
    # experts whose weights two children hold (JetMoE's block: one child's per-expert matmuls
    # open the split, another's close it) are judged at that parent, which sums them
    parents = {
        name: m
        for name, m in copy_.named_modules()
        if name not in holders
        and not isinstance(m, (nn.ModuleList, nn.ModuleDict))  # a container, never called
        and sum(f"{name}.{c}".lstrip(".") in holders for c, _ in m.named_children()) >= 2
    }
    for name, m in holders.items():
        st.origins.expert_params |= {
            f"{name}.{p}" if name else p
            for p, w in m.named_parameters(recurse=False)
            if w.dim() >= 2
        }
        hook_experts(st, name, m, sums=name.rpartition(".")[0] not in parents)
    for name, m in parents.items():
        hook_experts(st, name, m, holders=[h for h in holders if under(h, [name])])


def _inputs(
    model: nn.Module, example_inputs: Any, device: torch.device, fake: FakeTensorMode | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) for the traced forward, from the caller or from the forward signature;
    made fake with `fake`."""
    args, kwargs = _example_inputs(model, example_inputs, device)
    if fake is None:
        return args, kwargs
    with fake:
        return tree_map(
            lambda x: fake.from_tensor(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
        )


def _example_inputs(
    model: nn.Module, example_inputs: Any, device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) for the traced forward, from the caller or from the forward signature."""
    if example_inputs is not None:
        if isinstance(example_inputs, dict):
            return (), dict(example_inputs)
        if isinstance(example_inputs, (tuple, list)):
            return tuple(example_inputs), {}
        return (example_inputs,), {}
    # Batch 2, sequence 16: distinct sizes, so a broadcast batch dim is never taken for a split.
    kwargs: dict[str, Any] = dict(_derived_inputs(model, batch=2, seq=16, device=device))
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        kwargs["use_cache"] = False  # no cache to fill: its writes are not part of the math
    return (), kwargs


def idle_roots(
    names: Iterable[str], ran: Iterable[str], traced: Callable[[str], str] = str
) -> list[str]:
    """The largest parts that hold one of `names` and nothing in `ran` (the modules that ran,
    named as `traced` maps a name: an untraced repeat to the block traced in its place). A
    container such as a ModuleList never runs itself, but holds what did."""
    busy = {""}
    for name in ran:
        parts = name.split(".")
        busy.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    roots = set()
    for name in names:
        parts = name.split(".")
        prefixes = (".".join(parts[:k]) for k in range(1, len(parts) + 1))
        root = next((p for p in prefixes if traced(p) not in busy), None)
        if root is not None:
            roots.add(root)
    return sorted(roots)
