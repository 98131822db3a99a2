"""Stage 5, the plan-to-torch compiler: each plan rule becomes a torch ParallelStyle, and
`shard_model` applies them module by module.

Start at rules.py (`plan_to_torch`, `rule_to_style`), which maps every style of the schema
to torch's own or to one built here for what torch lacks, one concern per module:
- linear.py: `Colwise`, `Rowwise` for fused layers (q|k|v) and weights stored (in, out);
- embeddings.py: `SumAtLookup`, `WrittenRows` for embeddings whose forward does more than
  look up;
- experts.py: `Experts` for 3-D expert weights;
- params.py: `split_param` (used by all of them), `ReplicateGradSum`, `SplitParams`;
- strided.py: the layout of a fused layer split rank by rank (`_StridedShard`) and its
  checkpoint chunks;
- shard.py: `shard_model`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .rules import plan_to_torch, rule_to_style
    from .shard import shard_model

__all__ = ["plan_to_torch", "rule_to_style", "shard_model"]

_LAZY = {"plan_to_torch": ".rules", "rule_to_style": ".rules", "shard_model": ".shard"}


# these load on first use, so that a module importing one of the others (infer reads
# strided.py's layout) does not pay for every style
def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
