"""The errors tpplan raises for user mistakes, and the Problem a plan check reports.

Every error here carries one readable paragraph that names the thing that is wrong and the
fix; the CLI prints it as is, without a traceback. Nothing here imports torch.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CheckpointError",
    "DryRunSkipped",
    "MeshError",
    "MetaWeightsError",
    "ModelError",
    "PlanFileError",
    "PlanProblemsError",
    "Problem",
    "TpplanError",
    "did_you_mean",
]


class TpplanError(Exception):
    """Base of every error caused by user input; its message is meant to be read as is."""


class CheckpointError(TpplanError, ValueError):
    """A checkpoint that cannot be saved or loaded as asked; nothing was loaded into the model."""


class PlanFileError(TpplanError, ValueError):
    """A plan file (or plan data) that cannot be read: bad YAML/JSON, schema violations."""

    def __init__(self, source: str, issues: Sequence[str]) -> None:
        self.source = source
        self.issues = list(issues)
        if len(self.issues) == 1:
            text = f"{source}: {self.issues[0]}"
        else:
            lines = "\n".join(f"  - {i}" for i in self.issues)
            text = f"{source} has {len(self.issues)} problems:\n{lines}"
        super().__init__(text)


class MeshError(TpplanError, ValueError):
    """A DeviceMesh that cannot carry a tensor-parallel plan as given."""


class DryRunSkipped(UserWarning):
    """A note, not a problem: check's dry run met what fake tensors cannot run (an op that
    reads values, a kernel without a fake implementation) and left the rest of the proof to
    the static checks. The plan is not refused for it."""


class MetaWeightsError(TpplanError, RuntimeError):
    """A forward on real inputs of a sharded model whose weights are still on the meta
    device (apply_plan before load_checkpoint or to_empty); raised before torch runs."""


class ModelError(TpplanError, ValueError):
    """A model apply_plan cannot shard: not a torch nn.Module, or one sharded already."""


ProblemKind = Literal[
    "no_match",
    "overlap",
    "module_type",
    "divisibility",
    "head_dim",
    "unclosed_region",
    "unopened_region",
    "attribute",
    "fingerprint",
    "parts",
    "tied",
    "lookup",
    "dry_run",
    "dtensor_region",
    "adapter",
]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a plan for a given model and tp size."""

    kind: ProblemKind
    """What sort of problem: a pattern matching nothing, a dim that does not divide, ..."""
    rule: str
    """The rule it concerns, as `rules[i] (match: pattern)`, or `model` for the fingerprint."""
    module: str | None
    """The full name of the module concerned, when there is one."""
    message: str
    """What is wrong, with the numbers."""
    fix: str
    """What to change."""

    def __str__(self) -> str:
        where = f"{self.rule}" + (f", module {self.module}" if self.module else "")
        return f"{where}: {self.message} Fix: {self.fix}"


class PlanProblemsError(TpplanError, ValueError):
    """check_plan found problems; raised by apply_plan before torch is touched."""

    def __init__(self, problems: Sequence[Problem], *, tp_size: int) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        n = len(self.problems)
        super().__init__(
            f"the plan cannot be applied at tp size {tp_size}: {n} problem{'s' if n != 1 else ''}"
            f" found, nothing was changed:\n{lines}"
        )


def did_you_mean(given: str, allowed: Iterable[str]) -> str:
    """' did you mean X?' when something close to `given` is allowed, else ''."""
    close = difflib.get_close_matches(given, list(allowed), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""
