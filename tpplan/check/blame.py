"""Which rule a failed dry run is told on: `Watch` hooks every module of the sharded copy
and remembers, when torch raises, which module was running (or getting its gradient), which
modules made the tensors it worked on, and which had finished; `failure_problem` turns the
likeliest culprit that a rule or attribute fix treats into the Problem. Start at
`failure_problem`; run.py makes the `Failure` it reads.

A failure no rule is to blame for is told apart first (`fake_limit`): an op that reads a
tensor's values (`.item()`, `nonzero`) or a kernel without a fake implementation fails on
fake tensors whatever the plan; such a run proves nothing either way, and `failure_note`
says so in a note instead of a Problem.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from .._runtime.torch_compat import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    TorchDispatchMode,
    UnsupportedOperatorException,
)
from .._runtime.tree import tensor_leaves
from ..errors import Problem
from ..plan.schema import Plan, Rule
from ..plan.styles import ColwiseRule, SequenceParallelRule
from ..trace import run_op
from .shared import rules_by_module

__all__ = ["Failure", "MetaKernels", "Watch", "failure_note", "failure_problem", "fake_limit"]


@dataclass
class Failure:
    """Where a dry run failed: the phase, the modules to blame in order of likelihood (each
    with how it relates to the module where torch raised), and torch's error."""

    phase: str
    at: str
    suspects: list[tuple[str, str]]
    error: BaseException


class MetaKernels(TorchDispatchMode):
    """Every op as the tracer runs it on meta tensors (`run_op`: the grouped matmul of
    mixture-of-experts layers, whose meta kernel takes bf16 only, is asked in bf16); and the
    tensors of the first op that raised, whose makers are the likeliest culprits.

    With `bounded_nonzero`, `nonzero` (and `torch.where(mask)`, `argwhere`) gives as many
    indices as the mask has entries, the most it could: a fake tensor has no values to
    count, and a mixture of experts routing tokens by `torch.where(chosen == e)` then runs
    on fake tensors with each expert given every token. For runs that count collectives
    or follow which layer reads what (shapes only); never for a dry run's verdict."""

    def __init__(self, *, bounded_nonzero: bool = False) -> None:
        super().__init__()
        self.operands: list[torch.Tensor] = []
        self.bounded_nonzero = bounded_nonzero

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.bounded_nonzero and func is torch.ops.aten.nonzero.default:
            (mask,) = args
            return torch.empty((mask.numel(), mask.dim()), dtype=torch.long, device=mask.device)
        try:
            return run_op(func, args, kwargs or {})
        except Exception:
            if not self.operands:
                self.operands = list(tensor_leaves([list(args), kwargs or {}]))
            raise


@dataclass
class Watch:
    """Hooks on every module of the sharded copy that remember, when torch raises, which
    module was running (forward) or had just got its output's gradient (backward), which
    modules made the tensors it was working on, and which modules had finished."""

    model: nn.Module
    phase: str = "a forward"
    kernels: MetaKernels = field(default_factory=MetaKernels)
    running: list[tuple[str, int]] = field(default_factory=list)
    """The forwards under way, outermost first, each with len(done) when it started."""
    fed_by: dict[str, list[str]] = field(default_factory=dict)
    """Module -> the modules whose outputs its last call took as inputs."""
    made: dict[int, tuple[torch.Tensor, list[str]]] = field(default_factory=dict)
    """id of a module output -> (the tensor, kept so that its id is not reused; the modules
    that returned it, innermost first)."""
    done: list[str] = field(default_factory=list)
    """Modules whose forward returned, in order."""
    grads: list[str] = field(default_factory=list)
    """Modules whose output got its gradient, in order (the backward's progress)."""
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


# what fake tensors cannot run, whatever the plan: the exception, and what it means
_FAKE_LIMITS: list[tuple[type[BaseException], str]] = [
    (DataDependentOutputException, "reads a tensor's values, which fake tensors do not have"),
    (GuardOnDataDependentSymNode, "branches on a tensor's values, which fake tensors do not have"),
    (DynamicOutputShapeException, "makes a tensor whose shape depends on the values"),
    (UnsupportedOperatorException, "has no fake or meta kernel"),
]
# the words of a kernel missing on meta or fake tensors, in a plain NotImplementedError or
# RuntimeError (a custom op with no register_fake). DTensor's own NotImplementedError (an op
# with no sharding strategy) is none of these: that one is the plan's to answer.
_MISSING_KERNEL = ("'Meta' backend", "no fake impl", "meta kernel", "fake kernel", "fake impl")


def fake_limit(error: BaseException) -> str | None:
    """'<op> <why>' when `error` (or an error it came from) is one fake tensors raise for
    what they cannot run at all, whatever the plan; None for any other failure."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for kind, why in _FAKE_LIMITS:
            if isinstance(e, kind):
                func = getattr(e, "func", None)
                return f"{func if func is not None else type(e).__name__} {why}"
        if isinstance(e, (NotImplementedError, RuntimeError)):
            said = _first_line(e).split(". ")[0].rstrip(".")  # its first sentence
            if any(w in said for w in _MISSING_KERNEL):
                return f"{said} (no kernel for fake tensors)"
        e = e.__cause__ or e.__context__
    return None


def failure_note(model: nn.Module, failure: Failure, why: str) -> str:
    """The note for a dry run that met what fake tensors cannot run (`why`, from
    `fake_limit`): which module, which op, and that the plan is not refused for it."""
    at = _named(dict(model.named_modules()), failure.at)
    return (
        f"could not dry-run {at}: {why}. {failure.phase.capitalize()} on fake ranks "
        "stopped there; no rule is to blame and the plan is not refused for it (`tpplan "
        "verify` runs it on real numbers)."
    )


def failure_problem(plan: Plan, model: nn.Module, failure: Failure, tp: int) -> Problem:
    """The failure as a Problem on the rule of its likeliest culprit."""
    modules = dict(model.named_modules())
    blamed = _blame(plan, [n for n in modules if n], failure)
    at = _named(modules, failure.at)
    said = _first_line(failure.error)
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
    module, how, (label, rule) = blamed
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
    return Problem("dry_run", label, module, f"{where}: {said}", _fix(rule, modules.get(module)))


def _named(modules: dict[str, nn.Module], at: str) -> str:
    """`at` with its class ('mlp.up (Linear)'), or 'the model' for the root."""
    if not at:
        return "the model"
    return f"{at} ({type(modules[at]).__name__})" if at in modules else at


def _blame(
    plan: Plan, names: list[str], failure: Failure
) -> tuple[str, str, tuple[str, Rule | None]] | None:
    """(module, how it relates to where torch raised, (rule label, the rule, or None for an
    attribute fix)) of the likeliest suspect that a rule or an attribute fix treats; None
    when none does."""
    styled, divided = rules_by_module(plan, names)

    def rule_of(module: str, how: str) -> tuple[str, Rule | None] | None:
        # a divided attribute changes its module's own forward: where torch raised inside
        # that forward, it is the likelier culprit than the module's style
        if how == "in" and module in divided:
            return divided[module]
        return styled.get(module) or divided.get(module)

    return next(
        ((m, how, found) for m, how in failure.suspects if (found := rule_of(m, how))), None
    )


def _first_line(error: BaseException) -> str:
    """torch's error as one sentence: its type and first line, at most 300 characters."""
    lines = str(error).strip().splitlines()
    said = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if len(said) > 300:
        said = said[:297] + "..."
    return said + ("" if said.endswith((".", "!", "?")) else ".")


def _fix(rule: Rule | None, module: nn.Module | None) -> str:
    """The fix a dry-run failure blamed on `rule` (None: an attribute rule's division)
    suggests."""
    if rule is None:
        return (
            "divide only the head counts the model's views read to cut the split features "
            "(`tpplan infer` lists them under attributes); a size each rank keeps whole, "
            "such as head_dim, stays as it is."
        )
    if isinstance(module, nn.Embedding) and isinstance(rule, (ColwiseRule, SequenceParallelRule)):
        return f"{rule.style} on an Embedding: use vocab_parallel or replicate."
    return (
        "give the rule a style or layouts (input, output) that what follows can take, or "
        "keep the module whole (style: replicate); `tpplan verify` compares every module "
        "with the unsharded model."
    )
