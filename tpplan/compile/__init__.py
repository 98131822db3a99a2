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

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr

if TYPE_CHECKING:
    from .rules import plan_to_torch, rule_to_style
    from .shard import shard_model

__all__ = ["plan_to_torch", "rule_to_style", "shard_model"]

# these load on first use, so that a module importing one of the others (infer reads
# strided.py's layout) does not pay for every style
__getattr__ = lazy_getattr(
    __name__, {"plan_to_torch": ".rules", "rule_to_style": ".rules", "shard_model": ".shard"}
)
