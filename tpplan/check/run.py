"""run_plan: prove that a plan runs, by applying it to a meta copy of the model over fake
ranks and taking one forward and one backward pass; a failure becomes a Problem naming the
rule, the module where torch raised, and torch's own words.

check_plan calls it last, once the static checks have found nothing: they name the usual
mistakes precisely, and this catches the rest (a style torch cannot run where the plan puts
it, an attribute divided that the forward needs whole). No weights are copied or made: the
copy's parameters are meta tensors, so a run costs the model's module count, not its bytes.
Start at `run_plan`; `_Watch` knows which module was running, or getting its gradient,
when torch raised.

No run is tried, and the plan is left to the static checks, where none can be set up:
inputs tpplan cannot make up, a model that does not run on the meta device even unsharded
(routing by values), parameters that are already DTensors, or a torch whose private mesh
pieces (`solo_fake_mesh`) have changed.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .._runtime.inputs import example_inputs
from .._runtime.local import outside_simulation, solo_fake_mesh
from .._runtime.tree import tensor_leaves
from ..compile.shard import shard_model
from ..errors import Problem, TpplanError
from ..plan.patterns import match_names
from ..plan.schema import Plan
from ..trace import quiet_fake_tensor_log, repeated_blocks, run_op

__all__ = ["meta_copy", "run_plan"]


def meta_copy(
    model: nn.Module,
    *,
    fake: FakeTensorMode | None = None,
    trainable: bool = False,
    keep: dict[int, int] | None = None,
) -> nn.Module:
    """The model with every parameter and buffer on the meta device, no storage copied (a
    plain deepcopy would copy every weight first). Tied parameters stay tied. With `fake`,
    they are that mode's fake tensors of meta tensors; with `trainable`, every
    floating-point parameter requires grad, so a backward reaches it; `keep` ({id of a
    ModuleList: n}) copies only the first n blocks of those stacks."""
    keep = keep or {}
    stacks = [m for m in model.modules() if id(m) in keep]
    # the tensors of blocks left out are never copied: making them would cost the most
    skipped = {
        id(t)
        for m in stacks
        for block in list(m.children())[keep[id(m)] :]
        for t in [*block.parameters(), *block.buffers()]
    }

    def empty(t: torch.Tensor) -> torch.Tensor:
        # a plain tensor whatever `t` is (a LocalTensor of simulated ranks, say)
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        return fake.from_tensor(meta) if fake is not None else meta

    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in skipped:
            grad = p.requires_grad or (trainable and p.is_floating_point())
            memo[id(p)] = nn.Parameter(empty(p), requires_grad=grad)
    for b in model.buffers():
        if id(b) not in skipped:
            memo[id(b)] = empty(b)
    for m in stacks:
        memo[id(m)] = nn.ModuleList(
            [copy.deepcopy(b, memo) for b in list(m.children())[: keep[id(m)]]]
        )
    return copy.deepcopy(model, memo)


class _CannotRun(Exception):
    """No dry run can be set up here; the static checks stand alone."""


@dataclass
class _Failure:
    """Where a dry run failed: the phase, the modules to blame in order of likelihood (each
    with how it relates to the module where torch raised), and torch's error."""

    phase: str
    at: str
    suspects: list[tuple[str, str]]
    error: BaseException


def run_plan(plan: Plan, model: nn.Module, *, tp_size: int) -> list[Problem]:
    """The Problem of a plan that passes the static checks but does not run: applied to a
    meta copy of `model` on `tp_size` fake ranks, a forward and a backward pass fail. Empty
    when they run, or when no run can be set up (see the module docstring).

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
            inputs = _inputs(model, tp_size)
            cut = _shortened(plan, model)
            # a forward that counts its blocks by the config (Gemma 3n's per-layer inputs)
            # fails on a shortened stack: a failure there is only believed of the whole model
            failure = None
            for keep in [cut, {}] if cut else [{}]:
                failure = _run_sharded(plan, model, tp_size, inputs, keep)
                if failure is None:
                    return []
            if failure is None or not _runs_unsharded(model, inputs):
                return []
        except _CannotRun:
            return []
    return [_problem(plan, model, failure, tp_size)]


def _rules_by_module(
    plan: Plan, names: list[str]
) -> tuple[dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
    """({module: (rule, style)}, {module: (attribute rule, "divide")}) of the plan's rules,
    each rule written as check_plan names it."""
    styled: dict[str, tuple[str, str]] = {}
    for i, rule in enumerate(plan.rules):
        for name in match_names(rule.match, names):
            styled.setdefault(name, (f"rules[{i}] (match: {rule.match})", rule.style))
    divided: dict[str, tuple[str, str]] = {}
    for i, attrs in enumerate(plan.attributes):
        for name in match_names(attrs.match, names):
            divided.setdefault(name, (f"attributes[{i}] (match: {attrs.match})", "divide"))
    return styled, divided


def _shortened(plan: Plan, model: nn.Module) -> dict[int, int]:
    """{id of a ModuleList: blocks to run}: the long stacks of identical blocks the tracer
    runs through their first blocks (`repeated_blocks`), where the plan treats every block left out
    as the block it repeats. A run costs tens of milliseconds per block; a 126-block model
    runs its first two."""
    names = [n for n, _ in model.named_modules() if n]
    styled, divided = _rules_by_module(plan, names)

    def treated(block: str) -> tuple[dict[str, Any], dict[str, Any]]:
        def under(rules: dict[str, Any]) -> dict[str, Any]:
            return {
                n[len(block) :]: r
                for n, r in rules.items()
                if n == block or n.startswith(f"{block}.")
            }

        return under(styled), under(divided)

    cut = {}
    for key, (stack, keep, twins) in repeated_blocks(model).items():
        prefix = f"{stack}." if stack else ""
        if all(
            treated(f"{prefix}{i}") == treated(f"{prefix}{j}")
            for i, j in twins.items()
            if i >= keep
        ):
            cut[key] = keep
    return cut


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


class _MetaKernels(TorchDispatchMode):
    """Every op as the tracer runs it on meta tensors (`run_op`: the grouped matmul of
    mixture-of-experts layers, whose meta kernel takes bf16 only, is asked in bf16); and the
    tensors of the first op that raised, whose makers are the likeliest culprits."""

    def __init__(self) -> None:
        super().__init__()
        self.operands: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        try:
            return run_op(func, args, kwargs or {})
        except Exception:
            if not self.operands:
                self.operands = list(tensor_leaves([list(args), kwargs or {}]))
            raise


@contextmanager
def _kept_rng_tracker() -> Iterator[None]:
    """DTensor keeps one random-number tracker per process, made on the mesh of the first
    random op it meets; one made on the fake mesh must not outlive the run."""
    from torch.distributed.tensor import _random

    saved = _random._rng_tracker
    try:
        yield
    finally:
        _random._rng_tracker = saved


def _run_sharded(
    plan: Plan, model: nn.Module, tp: int, inputs: dict[str, Any], keep: dict[int, int]
) -> _Failure | None:
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
            shard_model(copy_, mesh, plan, on_module=applying.append)
        except Exception as e:
            return _Failure("applying the plan", applying[-1], [(applying[-1], "in")], e)
        watch = _Watch(copy_)
        try:
            _forward_backward(copy_, fake, inputs, watch)
        except Exception as e:
            at, suspects = watch.suspects()
            return _Failure(watch.phase, at, suspects, e)
        finally:
            watch.remove()
    return None


def _runs_unsharded(model: nn.Module, inputs: dict[str, Any]) -> bool:
    """Whether the model itself runs forward and backward on fake meta tensors; a plan is
    not to blame for a model that cannot (routing that reads the values, say)."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    copy_ = meta_copy(model, fake=fake, trainable=True).eval()
    try:
        with fake:
            _forward_backward(copy_, fake, inputs, None)
    except Exception:
        return False
    return True


def _forward_backward(
    model: nn.Module, fake: FakeTensorMode, inputs: dict[str, Any], watch: _Watch | None
) -> None:
    given = {
        k: fake.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
    }
    kernels = watch.kernels if watch is not None else _MetaKernels()
    # grads on even where the caller has them off: a plan must also train
    with torch.inference_mode(False), torch.enable_grad(), kernels:
        out = model(**given)
        loss = next((t for t in tensor_leaves(out) if t.requires_grad), None)
        if loss is None:
            return
        if watch is not None:
            watch.phase = "a backward"
        loss.float().sum().backward()


@dataclass
class _Watch:
    """Hooks on every module of the sharded copy that remember, when torch raises, which
    module was running (forward) or had just got its output's gradient (backward), which
    modules made the tensors it was working on, and which modules had finished."""

    model: nn.Module
    phase: str = "a forward"
    kernels: _MetaKernels = field(default_factory=_MetaKernels)
    running: list[tuple[str, int]] = field(default_factory=list)
    """The forwards under way, outermost first, each with len(done) when it started."""
    fed_by: dict[str, list[str]] = field(default_factory=dict)
    """Module -> the modules whose outputs its last call took as inputs."""
    made: dict[int, tuple[torch.Tensor, list[str]]] = field(default_factory=dict)
    """id of a module output -> (the tensor, kept so that its id is not reused; the modules
    that returned it, innermost first)."""
    done: list[str] = field(default_factory=list)
    grads: list[str] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, m in self.model.named_modules():
            self.handles.append(m.register_forward_pre_hook(self._enter(name), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._leave(name)))

    def _enter(self, name: str) -> Any:
        def hook(mod: nn.Module, args: Any, kwargs: Any) -> None:
            self.running.append((name, len(self.done)))
            self.fed_by[name] = self.makers(tensor_leaves([list(args), kwargs]))

        return hook

    def _leave(self, name: str) -> Any:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            # a forward that caught an error of a submodule left it on the stack: drop it too
            names = [n for n, _ in self.running]
            if name in names:
                del self.running[len(names) - 1 - names[::-1].index(name) :]
            self.done.append(name)
            for t in tensor_leaves(out):
                kept = self.made.setdefault(id(t), (t, []))
                if kept[0] is t:
                    kept[1].append(name)
                if t.requires_grad:
                    t.register_hook(lambda grad: self.grads.append(name))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def makers(self, tensors: Iterable[torch.Tensor]) -> list[str]:
        """The modules that returned these tensors, outermost first (an outer module's
        hooks are the last to act on what it returns)."""
        found: list[str] = []
        for t in tensors:
            kept = self.made.get(id(t))
            if kept is not None and kept[0] is t:
                found += reversed(kept[1])
        return list(dict.fromkeys(found))

    def suspects(self) -> tuple[str, list[tuple[str, str]]]:
        """(the module where torch raised, [(module, how it relates to that one)]), likeliest
        culprit first: the module itself; the makers of the tensors the failing op took;
        the modules it ran before torch raised, latest first; the makers of its inputs
        (and of theirs); the modules around it; every module that had finished. In a
        backward: the module whose output's gradient came last, those around it, and the
        makers of its inputs."""
        before = [(d, "before") for d in reversed(self.done)]
        if self.phase == "a backward":
            at = self.grads[-1] if self.grads else ""
            parts = at.split(".")
            around = [".".join(parts[:k]) for k in range(len(parts) - 1, -1, -1)]
            fed = [(m, "feeds") for m in self.fed_by.get(at, [])]
            return at, [(at, "in"), *((a, "around") for a in around), *fed, *before]
        at, start = self.running[-1] if self.running else ("", 0)
        found = [(at, "in")]
        found += [(m, "feeds") for m in self.makers(self.kernels.operands)]
        found += [(d, "feeds") for d in reversed(self.done[start:])]
        seen, queue = {at}, list(self.fed_by.get(at, []))
        while queue:
            src = queue.pop(0)
            if src in seen:
                continue
            seen.add(src)
            found.append((src, "feeds"))
            # a block that made the input without a rule of its own: the last of its
            # modules to finish made it, most likely
            if src:
                found += [(d, "feeds") for d in reversed(self.done) if d.startswith(f"{src}.")]
            queue += self.fed_by.get(src, [])
        found += [(m, "around") for m, _ in reversed(self.running[:-1])]
        return at, found + before


def _problem(plan: Plan, model: nn.Module, failure: _Failure, tp: int) -> Problem:
    """The failure as a Problem on the rule of its likeliest culprit."""
    names = [n for n, _ in model.named_modules() if n]
    modules = dict(model.named_modules())
    styled, divided = _rules_by_module(plan, names)

    def rule_of(module: str, how: str) -> tuple[str, str] | None:
        # a divided attribute changes its module's own forward: where torch raised inside
        # that forward, it is the likelier culprit than the module's style
        if how == "in" and module in divided:
            return divided[module]
        return styled.get(module) or divided.get(module)

    blamed = next(
        ((m, how, found) for m, how in failure.suspects if (found := rule_of(m, how))), None
    )
    at = failure.at or "the model"
    if at in modules and failure.at:
        at = f"{failure.at} ({type(modules[failure.at]).__name__})"
    lines = str(failure.error).strip().splitlines()
    said = f"{type(failure.error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if len(said) > 300:
        said = said[:297] + "..."
    said += "" if said.endswith((".", "!", "?")) else "."
    where = (
        f"{failure.phase} on a copy sharded over {tp} fake ranks (fake tensors, no weights) fails"
    )
    if blamed is None:
        return Problem(
            "dry_run",
            "plan",
            failure.at or None,
            f"{where} in {at}: {said}",
            "no rule matches that module or the modules around it; run `tpplan verify` to "
            "see which module's output differs first, and correct the rules near it.",
        )
    module, how, (rule, style) = blamed
    link = {
        "in": "",
        "feeds": f", which takes the output of {module}",
        "around": f", inside {module}",
        "before": f", after {module} ran",
    }[how]
    if how == "in" or at == module:
        where += f" in {at}"
    else:
        where += f" in {at}{link}"
    return Problem("dry_run", rule, module, f"{where}: {said}", _fix(style, modules.get(module)))


def _fix(style: str, module: nn.Module | None) -> str:
    if style == "divide":
        return (
            "divide only the head counts the model's views read to cut the split features "
            "(`tpplan infer` lists them under attributes); a size each rank keeps whole, "
            "such as head_dim, stays as it is."
        )
    if isinstance(module, nn.Embedding) and style in ("colwise", "sequence_parallel"):
        return f"{style} on an Embedding: use vocab_parallel or replicate."
    return (
        "give the rule a style or layouts (input, output) that what follows can take, or "
        "keep the module whole (style: replicate); `tpplan verify` compares every module "
        "with the unsharded model."
    )
