"""The picture file: its format read from its suffix, checked before any model is built,
and the file written. Start at `write_picture`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import TpplanError
from .html import render_html
from .picture import Picture
from .svg import render_svg

__all__ = ["FORMATS", "PictureFileError", "picture_format", "write_picture"]

FORMATS: dict[str, Callable[[Picture], str]] = {".svg": render_svg, ".html": render_html}
"""Suffix -> how the picture is written in that format."""


class PictureFileError(TpplanError, ValueError):
    """A picture file that cannot be written: a format not offered, a folder, no folder."""


def picture_format(path: str | Path) -> Callable[[Picture], str]:
    """How to write the picture named `path`, by its suffix; a suffix not offered, a
    folder or a missing folder is refused with the fix."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        given = f"'{path.suffix}'" if path.suffix else "no suffix"
        raise PictureFileError(
            f"-o {path}: {given} is not a picture format tpplan show writes; end the file "
            f"name in .svg or .html, e.g. -o {path.with_suffix('.svg')}."
        )
    if path.is_dir():
        raise PictureFileError(
            f"-o {path} is a folder; name the file, e.g. -o {path / 'plan.svg'}."
        )
    if not path.parent.is_dir():
        raise PictureFileError(
            f"-o {path}: the folder {path.parent} does not exist; create it first, or write "
            "the picture elsewhere."
        )
    return FORMATS[suffix]


def write_picture(picture: Picture, path: str | Path) -> None:
    """Write the picture as SVG or HTML, chosen by the suffix of `path`."""
    render = picture_format(path)
    try:
        Path(path).write_text(render(picture), encoding="utf-8")
    except OSError as e:
        raise PictureFileError(f"-o {path}: cannot write it ({e.strerror}).") from None
