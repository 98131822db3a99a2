"""Long stacks of identical blocks, traced through a prefix (trace/blocks.py): the decisions
of the traced blocks are copied to the untraced ones, when that is sound.

Start at `spread_to_untraced`. The trace's words hold here (trace/record.py): a twin is a
traced block of the same structure as an earlier traced one; each untraced block names the
traced block it copies (`trace.stacks.untraced`). Copying is sound when every span stays
inside one traced block (`spans_within_blocks`) and twins decided alike; else api.py traces
every block.
"""

from __future__ import annotations

from typing import Any, TypeVar

from ..trace import Trace
from .spans import find_spans

__all__ = ["ran_modules", "spans_within_blocks", "spread_to_untraced"]

_T = TypeVar("_T")


def _block_of(name: str, blocks: list[str]) -> str | None:
    return next((b for b in blocks if name == b or name.startswith(b + ".")), None)


def spans_within_blocks(trace: Trace) -> bool:
    """Every span, with the modules its parameters and head counts live in, sits inside one
    traced block (or outside all of them), so a block's decisions hold for its twins."""
    for members in find_spans(trace):
        near = set(members)
        near |= {p.rpartition(".")[0] for p, srcs in trace.params.in_span.items() if srcs & near}
        near |= {c[0] for o in members for c in trace.reads.counts.get(o, ())}
        if len({_block_of(m, trace.stacks.traced) for m in near}) > 1:
            return False
    return True


def spread_to_untraced(trace: Trace, decided: dict[str, _T]) -> dict[str, _T] | None:
    """Decisions of traced blocks copied to the identical blocks that were not traced; None
    when two traced twins decided differently."""

    def copied(block: str, source: str) -> dict[str, Any]:
        return {
            block + name[len(source) :]: d
            for name, d in decided.items()
            if name == source or name.startswith(source + ".")
        }

    for block, twin in trace.stacks.twins.items():
        mine = {n: d for n, d in decided.items() if _block_of(n, [block])}
        if mine != copied(block, twin):
            return None
    out = dict(decided)
    for block, source in trace.stacks.untraced.items():
        # Modules of untraced blocks were marked "not called" by `rest`; the copies replace them.
        out.update(copied(block, source))
    return out


def ran_modules(trace: Trace) -> set[str]:
    """Modules whose forward ran, the untraced blocks' modules counted as the traced blocks
    they copy ran."""
    ran = set(trace.layers.ran)
    for block, source in trace.stacks.untraced.items():
        ran |= {block + n[len(source) :] for n in trace.layers.ran if n.startswith(source + ".")}
    return ran
