"""Stage 1, the tracer: run a model once on fake tensors and record how each layer's output
features travel (split, viewed into heads, contracted, summed) until a layer contracts them.

Start at run.py (`trace_model`), which returns a `Trace` (record.py): facts that
tpplan/infer/ turns into rules and tpplan/check/ checks plans against. Nothing here decides a
style.

How it works. The output of a Linear called on an unsplit input gets a `Split` (split.py):
"dim d of this tensor holds that Linear's output features; splitting them into tp contiguous
chunks splits this dim so". Every aten op in the forward reaches the dispatch driver
(tracer.py), which hands it to the trackers (trackers/) and to the op's rule (rules.py): the
rule carries the Split to the op's outputs (element-wise ops, views, transposes, batched
matmuls) or ends it with a reason (a reduction, softmax or norm over the split dim, an op the
tracer does not know), which marks the Linears behind it `broken`. A Split that arrives at a
Linear on its contracted input dim marks that Linear a closer. Names are recorded only to
report facts; the decisions follow the data flow alone.

The modules, in reading order:
- run.py: `trace_model`; copies the model onto fake tensors and runs it under the modes.
- record.py: `Trace` and its records, one per concern, and the words the tracer uses.
- split.py: `Split` and its pure algebra (reshape, permute, merge, reduce).
- ops.py: the aten ops by what they do, and `Op`, one call of one.
- tracer.py: `Tracer`, the dispatch driver.
- rules.py: the per-op rules, registered by op name; heads.py: what they note about heads
  (one-head views, grouped-query attention, repeat counts); channels.py: the rules of ops
  that take split channels a group at a time (GroupNorm, BatchNorm, a grouped convolution);
  pieces.py: a fused layer's pieces (q|k|v) and how the code cuts them.
- trackers/: one object per kind of tensor followed (dense splits, parameters and vectors,
  attribute reads, embedding lookups, experts' partial sums, whole outputs).
- attention.py: the torch-function mode (attention as one op, sizes read off tensors).
- hooks.py: forward hooks that tell the trackers when modules run.
- probe.py: which modules compute a linear layer of their own weight.
- blocks.py: long stacks of identical blocks, traced through a prefix.
"""

from __future__ import annotations

from .blocks import block_structure, repeated_blocks
from .ops import run_op
from .probe import quiet_fake_tensor_log
from .record import Trace
from .run import TraceError, idle_roots, trace_model

__all__ = [
    "Trace",
    "TraceError",
    "block_structure",
    "idle_roots",
    "quiet_fake_tensor_log",
    "repeated_blocks",
    "run_op",
    "trace_model",
]
