"""The trackers of one traced forward: each follows one kind of tensor and writes one record
of the `Trace` (record.py).

Start at `Trackers`, which builds them and is what the dispatch driver (tracer.py), the
per-op rules (rules.py), the attention mode and the hooks share. One module per tracker:
dense.py (split Linear outputs), origins.py (parameters, the model input, vectors), reads.py
(integer attributes read in forward), lookups.py (embedding tables), experts.py and wholes.py
(mixture-of-experts partial sums and the whole outputs added to them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..record import Trace
from .dense import DenseSplits
from .experts import Experts
from .lookups import Lookups
from .origins import Origins, Vectors
from .reads import AttributeReads
from .wholes import WholeOutputs

__all__ = [
    "AttributeReads",
    "DenseSplits",
    "Experts",
    "Lookups",
    "Origins",
    "Trackers",
    "Vectors",
    "WholeOutputs",
]


@dataclass
class Trackers:
    """Everything one traced forward follows, besides the `Trace` it fills in."""

    trace: Trace
    origins: Origins
    splits: DenseSplits
    vectors: Vectors
    reads: AttributeReads
    lookups: Lookups
    whole_outputs: WholeOutputs
    experts: Experts
    quiet: int = 0
    """> 0 inside a hooked module or an op taken whole (attention): ops there are not ours."""

    @classmethod
    def start(
        cls, trace: Trace, params: dict[int, str], *, kept_whole: dict[str, list[str]]
    ) -> Trackers:
        """Trackers for one pass over the model. `params`: id -> name of each parameter of
        the traced copy; `kept_whole`: layers an earlier pass found cannot stay split."""
        origins = Origins(trace.params, params)
        splits = DenseSplits(trace.spans, kept_whole)
        whole_outputs = WholeOutputs(trace.experts, splits)
        return cls(
            trace=trace,
            origins=origins,
            splits=splits,
            vectors=Vectors(trace.params, trace.layers, origins),
            reads=AttributeReads(trace.reads, trace.spans.broken),
            lookups=Lookups(trace.lookups, origins),
            whole_outputs=whole_outputs,
            experts=Experts(trace.experts, trace.spans, origins, splits, whole_outputs),
        )
