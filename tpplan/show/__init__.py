"""Stage 10, a plan drawn: `tpplan show` writes one picture of how a plan splits a model.

Start at measure.py's `picture_of`, which measures a `Picture` (picture.py: groups of
layers, each with its kind, reason, collectives and parameters per rank); svg.py and
html.py draw it, files.py picks the format by the file's suffix. The picture is built
first and tested on its own, then drawn, so a drawing can change without a measurement.

A plan is drawn on a model, never from the plan file alone: the collectives are counted
on a forward of the sharded model (fake ranks, no storage), the order of the boxes is the
order that forward runs them, and the bytes per rank are those the plan leaves on a rank
once applied, sizes the plan leaves to the model included. A plan file holds none of
these (its parameter shapes are optional, without dtypes, and absent from a family's plan).

Only measure.py imports torch, on first use of `picture_of`: a picture file's name is
checked (`picture_format`) before torch is imported or a model built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .files import FORMATS, PictureFileError, picture_format, write_picture
from .html import render_html
from .picture import Collective, Group, Kind, Layer, Picture, Region
from .svg import render_svg

if TYPE_CHECKING:
    from .measure import picture_of

__all__ = [
    "FORMATS",
    "Collective",
    "Group",
    "Kind",
    "Layer",
    "Picture",
    "PictureFileError",
    "Region",
    "picture_format",
    "picture_of",
    "render_html",
    "render_svg",
    "write_picture",
]


def __getattr__(name: str) -> Any:
    if name == "picture_of":  # imports torch: loaded on first use
        value = importlib.import_module(".measure", __name__).picture_of
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tpplan.show' has no attribute {name!r}")
