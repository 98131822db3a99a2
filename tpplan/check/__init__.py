"""Stage 4, checking a plan against a model and a tp size: every problem at once, first the
static ones (rules, sizes, spans by data flow), then a dry run of the sharded forward and
backward on fake ranks. Start at api.py (`check_plan`), which calls the others in order.

The modules:
- api.py: `check_plan`, the driver, `complete_plan` (the plan with the sizes its rules
  leave out read from the model, and its problems) and `splits_nothing`;
- complete.py: those sizes, read from a trace;
- rules.py: each rule on the modules it matches, and checks across rules (experts, tied).
- sizes.py: the dims each style splits, and sizes tp must divide.
- flow.py: the checks by traced data flow, driven: spans.py (spans and heads),
  widths.py (head_dim, fused parts), lookups.py (vocab-parallel embeddings), and
  attributes.check_divided; structure.py where the model cannot be traced.
- attributes.py: the plan's attribute fixes. fingerprint.py: the plan's model.
- shared.py: how problems name rules, legal tp sizes, span roles.
- run.py: the dry run on fake ranks; blame.py: which rule a failure of it is told on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr

if TYPE_CHECKING:
    from .api import check_plan, complete_plan, splits_nothing

__all__ = ["check_plan", "complete_plan", "splits_nothing"]


# api.py (and through it the dry run and all of compile/) loads on first use, so that a
# module importing one of the checks here (infer's region proofs: rules.py, blame.py) does
# not pay for the others
__getattr__ = lazy_getattr(__name__, dict.fromkeys(__all__, ".api"))
