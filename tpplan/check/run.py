"""run_plan: prove that a plan runs, by applying it to a meta copy of the model over fake
ranks and taking one forward and one backward pass; a failure becomes a Problem naming the
rule, the module where torch raised, and torch's own words.

check_plan calls it last, once the static checks have found nothing: they name the usual
mistakes precisely, and this catches the rest (a style torch cannot run where the plan puts
it, an attribute divided that the forward needs whole). No weights are copied or made: the
copy's parameters are meta tensors, so a run costs the model's module count, not its bytes.
Start at `run_plan`; blame.py tells which rule a failure is on.

No run is tried, and the plan is left to the static checks, where none can be set up:
inputs tpplan cannot make up, a model that does not run on the meta device even unsharded
(routing by values), parameters that are already DTensors, or a torch whose private mesh
pieces (`solo_fake_mesh`) have changed. A run that meets what fake tensors cannot run at all
(an op that reads values, a kernel with no fake implementation: `blame.fake_limit`) stops
there with a `DryRunSkipped` warning, "could not dry-run <module>: <op> ...", never a
Problem: no plan could pass it, so it is no rule's fault.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._runtime.fake import meta_copy
from .._runtime.inputs import example_inputs
from .._runtime.local import outside_simulation, solo_fake_mesh
from .._runtime.torch_compat import (
    FakeTensorMode,
    comm_mode_module_tracker,
    dtensor_rng_tracker,
    set_dtensor_rng_tracker,
)
from .._runtime.tree import tensor_leaves
from ..compile.local_regions import RegionNotes
from ..compile.shard import shard_model
from ..errors import DryRunSkipped, Problem, TpplanError
from ..plan.patterns import match_names
from ..plan.schema import Plan
from ..plan.styles import SequenceParallelRule
from ..trace import quiet_fake_tensor_log, repeated_blocks
from .blame import Failure, MetaKernels, Watch, failure_note, failure_problem, fake_limit
from .shared import rules_by_module

__all__ = [
    "Inside",
    "collectives_inside",
    "meta_copy",
    "prove_local_regions",
    "region_inputs",
    "run_plan",
]


class _CannotRun(Exception):
    """No dry run can be set up here; the static checks stand alone."""


def run_plan(
    plan: Plan,
    model: nn.Module,
    *,
    tp_size: int,
    given: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
    strict: bool = False,
) -> list[Problem]:
    """The Problem of a plan that passes the static checks but does not run: applied to a
    meta copy of `model` on `tp_size` fake ranks, a forward and a backward pass fail. Empty
    when they run, or when no run can be set up (see the module docstring). `given`: the
    (args, kwargs) to run with, as meta tensors, instead of inputs made up here. `strict`:
    what fake tensors cannot run in the sharded model (blame.fake_limit) is a problem too,
    not a `DryRunSkipped` note (infer's sequence-parallel fitting offers only what it saw
    run to the end).

    The fake ranks are a process group of their own: this works inside a real gloo or NCCL
    job of any world size without a collective. The model itself is never touched.
    """
    if not plan.rules and not plan.attributes:
        return []
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return []  # already sharded: its own layouts are not the plan's to prove
    # once, on fake tensors: not once per rank when every rank is simulated in this process
    with outside_simulation(), quiet_fake_tensor_log(), warnings.catch_warnings():
        # the copy's warnings are about a copy; the real apply gives its own
        warnings.simplefilter("ignore")
        try:
            args, inputs = given if given is not None else ((), _inputs(model, tp_size))
            cut = _shortened(plan, model)
            # a forward that counts its blocks by the config (Gemma 3n's per-layer inputs)
            # fails on a shortened stack: a failure there is only believed of the whole model
            failure = None
            for keep in [cut, {}] if cut else [{}]:
                failure = _run_sharded(plan, model, tp_size, inputs, keep, args=args)
                if failure is None or fake_limit(failure.error):
                    break
            if failure is None:
                return []
            why = fake_limit(failure.error)
            # a model that does not run on fake tensors even unsharded (routing that reads
            # values) leaves the plan to the static checks, as it always has: no note
            if not _runs_unsharded(model, inputs, args):
                return []
        except _CannotRun:
            return []
    if why is not None and not strict:
        # fake tensors cannot run it, whatever the plan: no rule is to blame (blame.py)
        warnings.warn(failure_note(model, failure, why), DryRunSkipped, stacklevel=2)
        return []
    return [failure_problem(plan, model, failure, tp_size)]


def _shortened(plan: Plan, model: nn.Module) -> dict[int, int]:
    """{id of a ModuleList: blocks to run}: the long stacks of identical blocks the tracer
    runs through their first blocks (`repeated_blocks`), where the plan treats every block
    left out as the block it repeats. A run costs tens of milliseconds per block; a 126-block model
    runs its first two."""
    names = [n for n, _ in model.named_modules() if n]
    styled, divided = rules_by_module(plan, names)

    def treated(block: str) -> tuple[dict[str, Any], dict[str, Any]]:
        def under(rules: dict[str, Any]) -> dict[str, Any]:
            return {
                n[len(block) :]: r
                for n, r in rules.items()
                if n == block or n.startswith(f"{block}.")
            }

        return under(styled), under(divided)

    cut = {}
    # same_as: {block: the earliest block of the same structure}, for every later one
    for key, (stack, keep, same_as) in repeated_blocks(model).items():
        prefix = f"{stack}." if stack else ""
        if all(
            treated(f"{prefix}{i}") == treated(f"{prefix}{j}")
            for i, j in same_as.items()
            if i >= keep
        ):
            cut[key] = keep
    return cut


def prove_local_regions(plan: Plan, model: nn.Module, *, tp_size: int) -> dict[type, RegionNotes]:
    """{region module class: what running it on local shards needs, or why it cannot}: the
    plan applied to a meta copy on `tp_size` fake ranks, its regions on DTensors noted call
    by call (compile/local_regions.py). The forward fills a KV cache where the model keeps
    one, so that the cache's own code is proven too; where that run fails, one without.
    Empty where no run can be set up (the regions then stay on DTensors)."""
    if not plan.regions or tp_size == 1:
        return {}
    if any(isinstance(r, SequenceParallelRule) for r in plan.rules):
        # the stream reaches a region split over the sequence, as a DTensor: no local run
        names = [n for n, _ in model.named_modules()]
        found = [model.get_submodule(n) for r in plan.regions for n in match_names(r.match, names)]
        why = "the plan is sequence parallel (the stream reaches the region as a DTensor)"
        return {type(m): RegionNotes(refused=why, ran=True) for m in found}
    with outside_simulation(), quiet_fake_tensor_log(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            inputs = _inputs(model, tp_size)
        except _CannotRun:
            return {}
        # made-up inputs of a hand-written module come on the CPU; the copy is on meta
        inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        cached = {k: v for k, v in inputs.items() if k != "use_cache"}
        cut = _shortened(plan, model)
        for given in [cached, inputs] if "use_cache" in inputs else [inputs]:
            notes: dict[type, RegionNotes] = {}
            try:
                if _run_sharded(plan, model, tp_size, given, cut, record=notes) is None:
                    return notes
            except _CannotRun:
                return {}
    return {}


def _inputs(model: nn.Module, tp: int) -> dict[str, Any]:
    """The tracer's batch of 2, with a sequence a multiple of tp (sequence-parallel layers
    split it evenly), on the meta device."""
    seq = tp * math.ceil(16 / tp)
    try:
        inputs: dict[str, Any] = dict(example_inputs(model, batch=2, seq=seq, device="meta"))
    except TpplanError as e:
        raise _CannotRun from e
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False  # no cache to fill: its writes are not part of the plan
    return inputs


@contextmanager
def _kept_rng_tracker() -> Iterator[None]:
    """DTensor keeps one random-number tracker per process, made on the mesh of the first
    random op it meets; one made on the fake mesh must not outlive the run."""
    saved = dtensor_rng_tracker()
    try:
        yield
    finally:
        set_dtensor_rng_tracker(saved)


def _run_sharded(
    plan: Plan,
    model: nn.Module,
    tp: int,
    inputs: dict[str, Any],
    keep: dict[int, int],
    *,
    args: tuple[Any, ...] = (),
    counting: Any = None,
    record: dict[type, RegionNotes] | None = None,
    bounded_nonzero: bool = False,
    returned: dict[str, int] | None = None,
) -> Failure | None:
    # Fake tensors rather than bare meta ones: models skip value checks on them (Hugging
    # Face's mask code asks `.all()` of position ids otherwise), as they do for the tracer.
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    # eval: no dropout, so no random op on DTensors (see _kept_rng_tracker)
    copy_ = meta_copy(model, fake=fake, trainable=True, keep=keep).eval()
    with ExitStack() as stack:
        try:
            mesh = stack.enter_context(solo_fake_mesh(tp))
        except Exception as e:
            raise _CannotRun from e
        stack.enter_context(_kept_rng_tracker())
        stack.enter_context(fake)
        applying = [""]
        try:
            shard_model(copy_, mesh, plan, on_module=applying.append, record=record)
        except Exception as e:
            return Failure("applying the plan", applying[-1], [(applying[-1], "in")], e)
        watch = Watch(copy_, kernels=MetaKernels(bounded_nonzero=bounded_nonzero))
        if returned is not None:
            _count_split_outputs(copy_, returned)
        if counting is not None:
            stack.enter_context(counting)
        try:
            _forward_backward(copy_, fake, inputs, watch, args)
        except Exception as e:
            at, suspects = watch.suspects()
            return Failure(watch.phase, at, suspects, e)
        finally:
            watch.remove()
    return None


def _count_split_outputs(model: nn.Module, returned: dict[str, int]) -> None:
    """Counts into `returned` ({module name: 0}) the DTensors each named module hands back:
    a region's output that leaves it still split."""
    from torch.distributed.tensor import DTensor

    def hook(name: str) -> Any:
        def count(m: nn.Module, a: Any, out: Any) -> None:
            returned[name] += sum(isinstance(t, DTensor) for t in tensor_leaves(out))

        return count

    for name, module in model.named_modules():
        if name in returned:
            module.register_forward_hook(hook(name))


def _runs_unsharded(model: nn.Module, inputs: dict[str, Any], args: tuple[Any, ...] = ()) -> bool:
    """Whether the model itself runs forward and backward on fake meta tensors; a plan is
    not to blame for a model that cannot (routing that reads the values, say)."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    copy_ = meta_copy(model, fake=fake, trainable=True).eval()
    try:
        with fake:
            _forward_backward(copy_, fake, inputs, None, args)
    except Exception:
        return False
    return True


def _forward_backward(
    model: nn.Module,
    fake: FakeTensorMode,
    inputs: dict[str, Any],
    watch: Watch | None,
    args: tuple[Any, ...] = (),
) -> None:
    given = {
        k: fake.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
    }
    given_args = [fake.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in args]
    kernels = watch.kernels if watch is not None else MetaKernels()
    # grads on even where the caller has them off: a plan must also train
    with torch.inference_mode(False), torch.enable_grad(), kernels:
        out = model(*given_args, **given)
        loss = next((t for t in tensor_leaves(out) if t.requires_grad), None)
        if loss is None:
            return
        if watch is not None:
            watch.phase = "a backward"
        loss.float().sum().backward()


class Inside(NamedTuple):
    """The collectives a module ran outside its split layers' own calls."""

    forward: dict[str, int]
    """{collective: count} of the forward (an all-reduce of what a reduction over the split
    heads summed, say)."""
    backward: dict[str, int]
    """{collective: count} of the backward (an all-gather of a gradient, say)."""
    returned_split: int = 0
    """How many tensors it handed back still split (DTensors)."""

    def gathers(self) -> int:
        """The forward's collectives other than all-reduces: each moves split activations
        whole, so the work after it is not split."""
        return sum(n for op, n in self.forward.items() if not op.startswith("all_reduce"))


def collectives_inside(
    plan: Plan,
    model: nn.Module,
    *,
    tp_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    modules: dict[str, list[str]],
) -> dict[str, Inside] | None:
    """The proof of DTensor regions: the plan applied to a meta copy on `tp_size` fake
    ranks, one forward and backward counted by torch's CommDebugMode. For each of
    `modules` ({module: the split layers inside it}): the collectives its forward and
    backward ran outside those layers' own calls (none: the split ran through it
    untouched), keyed by module name. A module in a block of a shortened stack that did
    not run gets the counts of the block it repeats (`_shortened` runs the first blocks
    for the rest); a module that did not run otherwise is left out. `args` and `kwargs`
    are meta tensors, as `region_inputs` makes them. None when the run fails."""
    with outside_simulation(), quiet_fake_tensor_log(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        counting = _comm_counting()
        cut = _shortened(plan, model)
        ran_as = _ran_as(model, cut)
        returned = {ran_as(m): 0 for m in modules}
        try:
            # shapes only: routing by `torch.where` runs, every token to every expert
            failed = _run_sharded(
                plan,
                model,
                tp_size,
                kwargs,
                cut,
                args=args,
                counting=counting,
                bounded_nonzero=True,
                returned=returned,
            )
            if failed:
                return None
        except _CannotRun:
            return None
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for fqn, per in counting.comm_module_counts.items():
        name = fqn.partition(".")[2] if "." in fqn else ""
        counts[name] = {
            phase: {getattr(op, "__name__", str(op)).split(".")[0]: n for op, n in ops.items()}
            for phase, ops in per.items()
        }

    def phase(module: str, which: str) -> dict[str, int]:
        return counts.get(ran_as(module), {}).get(which, {})

    out = {}
    for module, inside in modules.items():
        if ran_as(module) not in counts:
            continue
        kinds: dict[str, dict[str, int]] = {}
        for which in ("forward", "backward"):
            kinds[which] = dict(phase(module, which))
            for m in inside:
                for op, n in phase(m, which).items():
                    kinds[which][op] = kinds[which].get(op, 0) - n
        out[module] = Inside(
            {op: n for op, n in kinds["forward"].items() if n},
            {op: n for op, n in kinds["backward"].items() if n},
            returned.get(ran_as(module), 0),
        )
    return out


def _comm_counting() -> Any:
    """torch's CommDebugMode, its module tracker mended for a module called more than once
    in one forward (T5's stack runs its one dropout before and after its blocks): torch's
    tracker adds a hook that leaves the module at each call and never removes the earlier
    ones, so the second call leaves twice and the forward fails (an IndexError) on any
    such model, sharded or not. Here each call's hook replaces the one before."""
    from torch.distributed.tensor.debug import CommDebugMode

    class _Tracker(comm_mode_module_tracker()):  # type: ignore[misc]
        def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
            old = self.register_forward_hook_handles.pop(self._get_mod_name(mod), None)
            if old is not None:
                old.remove()
            super()._fw_pre_hook(mod, input)

    counting = CommDebugMode()
    counting.advanced_module_tracker = _Tracker()
    return counting


def _ran_as(model: nn.Module, cut: dict[int, int]) -> Any:
    """name -> the name of the module that ran for it: in a block a shortened stack left
    out, the same module of the earlier block it repeats; else the name itself."""
    stacks = [
        (f"{name}.", cut[key], same_as)
        for key, (name, _, same_as) in repeated_blocks(model).items()
        if key in cut
    ]

    def ran_as(module: str) -> str:
        for prefix, keep, same_as in stacks:
            if module.startswith(prefix):
                index, _, rest = module[len(prefix) :].partition(".")
                if index.isdigit() and int(index) >= keep:
                    twin = f"{prefix}{same_as.get(int(index), int(index))}"
                    return f"{twin}.{rest}" if rest else twin
        return module

    return ran_as


def region_inputs(model: nn.Module, tp: int) -> dict[str, Any] | None:
    """The dry run's made-up inputs, or None where tpplan cannot make them up."""
    try:
        return _inputs(model, tp)
    except _CannotRun:
        return None
