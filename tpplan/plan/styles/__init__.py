"""The ten styles a rule can name, one class each: its fields, its checks, its facts.

Start at `ColwiseRule` (torch_styles.py; own.py holds the styles torch has no
ParallelStyle for). Every class holds only the fields its style takes (a field of another
style is refused with this style's list, rule.py), the schema version each came in
(`since`, `field_since`), the checks across its fields (`_check`, run once every field is
valid on its own; each message says what was given, what is allowed and the fix), and the
pure facts the rest of tpplan asks of a style (which dim of a weight it splits). Adding a
style is a class in one of the two, its builder in tpplan/compile/, and its tests. No torch here.
"""

from __future__ import annotations

from typing import Literal

from ..rule import STYLE_CLASSES, WeightKind

# torch's five first, then tpplan's own: classes register in the order they are defined,
# which is the order styles are listed in (the JSON Schema, messages, `STYLES`)
from .torch_styles import (  # isort: skip
    ColwiseRule,
    PrepareRule,
    RowwiseRule,
    SequenceParallelRule,
    VocabParallelRule,
)
from .own import (  # isort: skip
    ExpertsRule,
    HeadsRule,
    ReplicateGradSumRule,
    ReplicateRule,
    SplitParamsRule,
)

__all__ = [
    "STYLES",
    "ColwiseRule",
    "ExpertsRule",
    "HeadsRule",
    "PrepareRule",
    "ReplicateGradSumRule",
    "ReplicateRule",
    "RowwiseRule",
    "SequenceParallelRule",
    "SplitParamsRule",
    "Style",
    "VocabParallelRule",
    "WeightKind",
]

STYLES: tuple[str, ...] = tuple(STYLE_CLASSES)
"""Every style's name, in the order they are listed."""

Style = Literal[
    "colwise",
    "rowwise",
    "vocab_parallel",
    "sequence_parallel",
    "prepare",
    "replicate",
    "replicate_grad_sum",
    "experts",
    "split_params",
    "heads",
]
