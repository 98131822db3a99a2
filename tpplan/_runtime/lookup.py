"""Giving one nn.Embedding (or subclass) instance a class of its own with another lookup in
nn.Embedding's place, so that a subclass's `super().forward(ids)` runs that lookup instead.

Used by the styles that split an embedding whose forward does more than look up
(tpplan/compile/embeddings.py) and by the tracer's probe that proves such an embedding looks
up only through that place (tpplan/trace/hooks.py): both use this one helper, so the probe
proves what apply does.
"""

from __future__ import annotations

from torch import nn

__all__ = ["put_in_lookup_place"]

_LOOKUP_CLASSES: dict[tuple[type, type], type] = {}


def put_in_lookup_place(module: nn.Embedding, place: type[nn.Embedding]) -> None:
    """Give `module` a class of its own (of the same name) with `place`, an nn.Embedding
    subclass, where nn.Embedding was in its class order: `place.forward` then runs wherever
    the module's own forward calls `super().forward(ids)`."""
    cls = type(module)
    if (cls, place) not in _LOOKUP_CLASSES:
        bases = (place,) if cls is nn.Embedding else (cls, place)
        _LOOKUP_CLASSES[cls, place] = type(cls.__name__, bases, {})
    module.__class__ = _LOOKUP_CLASSES[cls, place]
