"""render_html: a `Picture` as one self-contained HTML page: the SVG of svg.py inline, with
its CSS, and nothing fetched (no script, font or image from elsewhere). A layer's reason
shows on hover from its box's <title>. Start at `render_html`."""

from __future__ import annotations

from xml.sax.saxutils import escape

from .picture import Picture
from .svg import render_svg

__all__ = ["render_html"]

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body {{ margin: 16px; background: #ffffff; color: #1b1b1b;
  font-family: system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; }}
svg {{ max-width: 100%; height: auto; }}
p.hint {{ font-size: 13px; color: #555555; }}
</style>
</head>
<body>
<p class="hint">Hover over a box for its rule's whole reason, over a dark pill for the
collective.</p>
{svg}</body>
</html>
"""


def render_html(picture: Picture) -> str:
    """The picture as an HTML page that needs nothing else."""
    title = f"{picture.model} at tp {picture.tp_size}: tpplan show"
    return _PAGE.format(title=escape(title), svg=render_svg(picture))
