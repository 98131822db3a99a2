"""Long stacks of identical blocks, traced through a prefix, and the fake copy that holds it.

Start at `repeated_blocks`. A 126-layer model is traced through its first blocks, as many as
it takes to hold each distinct block structure (at least two), so it costs what a 2-layer one
does; `fake_copy` builds that shortened copy on fake tensors and records in the trace's
`StackFacts` which traced block stands for which untraced one.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from .._runtime.torch_compat import FakeTensorMode
from .record import Trace

__all__ = ["block_structure", "fake_copy", "repeated_blocks"]

_WHOLE_STACK = 8  # stacks this short are traced block by block (see `repeated_blocks`)


def block_structure(module: nn.Module) -> tuple[Any, ...]:
    """What two blocks must share to be traced once: module types and parameter shapes."""
    mods = tuple((n, type(m).__qualname__) for n, m in module.named_modules())
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    return mods, params


def repeated_blocks(model: nn.Module) -> dict[int, tuple[str, int, dict[int, int]]]:
    """Outermost ModuleLists worth shortening: id -> (name, blocks kept, {block: first twin}),
    a twin being an earlier block of the same structure.

    A shortened stack assumes that blocks of one structure behave alike, which a forward
    that hands some layers extra inputs by index breaks (NeoMME gives its value embeddings
    to its first and last global layers only). Stacks of up to 8 blocks, where tracing
    every block costs little, are traced whole for that reason."""
    found: dict[int, tuple[str, int, dict[int, int]]] = {}
    taken: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) <= _WHOLE_STACK:
            continue
        if any(name.startswith(p + ".") for p in taken):
            continue
        shapes = [block_structure(c) for c in m]
        first: dict[Any, int] = {}
        for i, s in enumerate(shapes):
            first.setdefault(s, i)
        keep = max(2, max(first.values()) + 1)
        if keep >= len(m):
            continue
        found[id(m)] = (
            name,
            keep,
            {i: first[shapes[i]] for i in range(len(m)) if first[shapes[i]] != i},
        )
        taken.append(name)
    return found


def fake_copy(
    model: nn.Module, fake: FakeTensorMode, trace: Trace, *, shorten: bool, real: bool = False
) -> nn.Module:
    """A copy of `model` whose parameters and buffers are fake tensors (no storage copied);
    with `real`, the model's own tensors (shared, not copied). With `shorten`, long stacks
    of blocks keep their first blocks only (`repeated_blocks`)."""
    memo: dict[int, Any] = {}
    repeats = repeated_blocks(model) if shorten else {}
    # Tensors of blocks left out are never copied; making fakes of them would cost the most.
    skipped = {
        id(t)
        for m in model.modules()
        if id(m) in repeats
        for block in list(m.children())[repeats[id(m)][1] :]
        for t in [*block.parameters(), *block.buffers()]
    }
    for p in model.parameters():
        if id(p) not in skipped:
            memo[id(p)] = p if real else nn.Parameter(fake.from_tensor(p), p.requires_grad)
    for b in model.buffers():
        if id(b) not in skipped:
            memo[id(b)] = b if real else fake.from_tensor(b)
    for m in model.modules():
        if id(m) in repeats:
            name, keep, twin = repeats[id(m)]
            prefix = f"{name}." if name else ""
            blocks = list(m.children())
            memo[id(m)] = nn.ModuleList([copy.deepcopy(blocks[i], memo) for i in range(keep)])
            trace.stacks.traced.extend(f"{prefix}{i}" for i in range(keep))
            for i, j in twin.items():
                into = trace.stacks.untraced if i >= keep else trace.stacks.twins
                into[f"{prefix}{i}"] = f"{prefix}{j}"
    return copy.deepcopy(model, memo)
