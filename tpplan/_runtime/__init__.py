"""Below every stage: what runs models and ranks, and facts read from a model's module tree.

tree.py (tensors inside outputs), local.py (simulated and fake ranks), inputs.py (made-up
example inputs), models.py (models built from a type, folder or id), launch.py (ranks
started through torch's launcher), facts.py (fingerprint, tied weights, how a rule splits a
parameter), lookup.py (a table's lookup put in nn.Embedding's place), ranks.py (which
rank this is, barriers, and agreeing on failure so no rank hangs), gather.py (whole tensors
of a sharded model, for every save), torch_compat.py (every private torch name tpplan uses,
the only module that may import one)."""

from __future__ import annotations
