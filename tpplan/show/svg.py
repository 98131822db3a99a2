"""render_svg: a `Picture` as one SVG document, written by hand (no drawing library).

Start at `render_svg`. The picture reads top to bottom: a title with the model class, the tp
size and the parameters per rank; a legend of every box kind; then one panel per group,
its layers as boxes in the order the forward runs them, each coloured by its kind, the
collectives its forward ran in a dark pill under it, and its rule's reason beside it (the
whole reason in the box's <title>, which viewers show on hover). A DTensor region is a
dashed frame round its layers. Every text is XML-escaped; nothing here imports torch.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from xml.sax.saxutils import escape

from .picture import OUTSIDE, Collective, Group, Kind, Layer, Picture

__all__ = ["COLOURS", "render_svg", "size_text"]

COLOURS: dict[Kind, tuple[str, str]] = {
    Kind.COLWISE: ("#4e79a7", "#ffffff"),
    Kind.GATHERED: ("#a0cbe8", "#1b1b1b"),
    Kind.ROWWISE: ("#f28e2b", "#1b1b1b"),
    Kind.VOCAB_PARALLEL: ("#59a14f", "#ffffff"),
    Kind.SEQUENCE_PARALLEL: ("#8cd17d", "#1b1b1b"),
    Kind.PREPARE: ("#f1ce63", "#1b1b1b"),
    Kind.REPLICATE: ("#bab0ac", "#1b1b1b"),
    Kind.REPLICATE_GRAD_SUM: ("#9d7660", "#ffffff"),
    Kind.EXPERTS: ("#b07aa1", "#ffffff"),
    Kind.SPLIT_PARAMS: ("#ff9d9a", "#1b1b1b"),
    Kind.HEADS: ("#499894", "#ffffff"),
    Kind.NO_RULE: ("#f2f2f2", "#1b1b1b"),
    Kind.REGION: ("#e15759", "#e15759"),
}
"""Each kind's (fill, text) colours; a region's fill is its frame's stroke."""

_WIDTH = 1040
_BOX_X, _BOX_W, _BOX_H = 56, 350, 42
_REASON_X = _BOX_X + _BOX_W + 22
_REASON_CHARS = 96  # characters of 11px text that fit beside a box (about 6 px each)
_PILL_H = 22
_GAP = 12

_STYLE = """
text { font-family: system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; fill: #1b1b1b; }
.title { font-size: 20px; font-weight: 600; }
.sub { font-size: 13px; }
.head { font-size: 15px; font-weight: 600; }
.name { font-family: ui-monospace, 'SFMono-Regular', Menlo, Consolas, monospace; font-size: 12.5px; }
.small { font-size: 11px; }
.reason { font-size: 11px; fill: #444; }
.pill text { font-size: 11px; fill: #ffffff; font-weight: 600; }
.layer rect { stroke: #333; stroke-width: 1; }
.layer:hover rect { stroke-width: 2.5; }
.panel { fill: #fafafa; stroke: #cccccc; }
.flow { stroke: #888; stroke-width: 1.5; }
"""


def size_text(n: int) -> str:
    """Bytes in the unit that reads best: 512 B, 3.0 KiB, 1.2 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def _share(per_rank: int, total: int) -> str:
    return f"{size_text(per_rank)} of {size_text(total)} ({per_rank / max(1, total):.1%})"


def _esc(text: str) -> str:
    """Text safe in an element or a double-quoted attribute (control characters dropped:
    XML 1.0 allows none but tab and newline)."""
    clean = "".join(c for c in text if c >= " " or c in "\t\n")
    return escape(clean, {'"': "&quot;"})


def _text(x: float, y: float, text: str, cls: str, *, fill: str | None = None) -> str:
    colour = f' style="fill:{fill}"' if fill else ""
    return f'<text x="{x:g}" y="{y:g}" class="{cls}"{colour}>{_esc(text)}</text>'


def _collectives_text(found: Sequence[Collective]) -> str:
    return ", ".join(str(c) for c in found)


def render_svg(picture: Picture) -> str:
    """The picture as a standalone SVG document."""
    body, y = _title(picture)
    legend, y = _legend(y)
    body += legend
    for group in picture.groups:
        panel, y = _group(group, y)
        body += panel
    height = y + 16
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
        f'viewBox="0 0 {_WIDTH} {height}" role="img" aria-labelledby="tpplan-title">\n'
        f'<title id="tpplan-title">{_esc(_heading(picture))}</title>\n'
        f"<style>{_STYLE}</style>\n"
        f'<rect width="{_WIDTH}" height="{height}" fill="#ffffff"/>\n'
        + "\n".join(body)
        + "\n</svg>\n"
    )


def _heading(picture: Picture) -> str:
    return f"{picture.model} at tp {picture.tp_size}: how tpplan's plan splits it"


def _title(picture: Picture) -> tuple[list[str], float]:
    out = [
        _text(24, 34, _heading(picture), "title"),
        _text(
            24,
            56,
            f"parameters per rank: {_share(picture.bytes_per_rank, picture.bytes_total)} "
            f"of the unsharded model, at tp {picture.tp_size}",
            "sub",
        ),
    ]
    y = 62.0
    if picture.note:
        out.append(_text(24, y + 16, f"note: {picture.note}", "sub", fill="#b00020"))
        y += 20
    return out, y


def _legend(top: float) -> tuple[list[str], float]:
    """Every kind's colour, two columns, then what a pill means."""
    out = [_text(24, top + 26, "legend", "head")]
    kinds = list(Kind)
    rows = (len(kinds) + 1) // 2
    for i, kind in enumerate(kinds):
        x = 24 + (i // rows) * 500
        y = top + 38 + (i % rows) * 22
        fill, _ = COLOURS[kind]
        if kind is Kind.REGION:
            swatch = (
                f'<rect x="{x}" y="{y}" width="28" height="16" fill="none" stroke="{fill}" '
                'stroke-width="2" stroke-dasharray="5 3"/>'
            )
        else:
            swatch = f'<rect x="{x}" y="{y}" width="28" height="16" fill="{fill}" stroke="#333"/>'
        out.append(
            f'<g class="legend-entry" data-kind="{kind.name.lower()}">{swatch}'
            f"{_text(x + 36, y + 12.5, kind.value, 'sub')}</g>"
        )
    y = top + 38 + rows * 22 + 4
    out.append(_pill(24, y, "all-reduce", "a collective one forward runs after the layer above"))
    out.append(_text(120, y + 15, "a collective its forward runs (one per call)", "sub"))
    return out, y + _PILL_H + 10


def _pill(x: float, y: float, text: str, why: str) -> str:
    width = 14 + 6.4 * len(text)
    return (
        f'<g class="pill"><title>{_esc(why)}</title>'
        f'<rect x="{x:g}" y="{y:g}" width="{width:.0f}" height="{_PILL_H}" rx="11" fill="#222222"/>'
        f"{_text(x + 7, y + 15, text, 'small')}</g>"
    )


def _group_heading(group: Group) -> tuple[str, str]:
    if group.name == OUTSIDE:
        return (
            "outside the repeated blocks",
            f"parameters per rank: {_share(group.bytes_per_rank, group.bytes_total)}",
        )
    n, of = len(group.indices), group.stack_size
    which = ", ".join(str(i) for i in group.indices)
    shared = f"drawn once for all {n} blocks" if n == of else f"{n} of {of} blocks ({which})"
    per_block = _share(group.bytes_per_rank, group.bytes_total)
    return (
        f"{group.name}: {shared}",
        f"parameters per rank, each block: {per_block}; the {n}: "
        f"{size_text(group.bytes_per_rank * n)}",
    )


def _layer_height(layer: Layer) -> float:
    return _BOX_H + (_PILL_H + 8 if layer.collectives else 0) + _GAP


def _group(group: Group, top: float) -> tuple[list[str], float]:
    """One panel: heading, region frames, boxes with their pills and reasons."""
    name, sizes = _group_heading(group)
    y = top + 70
    rows: list[tuple[float, Layer]] = []
    for layer in group.layers:
        rows.append((y, layer))
        y += _layer_height(layer)
    if group.own_collectives:
        y += 22
    bottom = y + 4
    out = [
        f'<g class="group" data-name="{_esc(group.name)}">',
        f'<rect class="panel" x="12" y="{top + 14:g}" width="{_WIDTH - 24}" '
        f'height="{bottom - top - 14:g}" rx="8"/>',
        _text(24, top + 38, name, "head"),
        _text(24, top + 56, sizes, "sub"),
    ]
    out += _regions(group, rows)
    for i, (row_y, layer) in enumerate(rows):
        if i + 1 < len(rows):  # the flow from this layer to the next
            x = _BOX_X + 24
            out.append(
                f'<line class="flow" x1="{x}" y1="{row_y + _BOX_H:g}" x2="{x}" '
                f'y2="{rows[i + 1][0]:g}"/>'
            )
        out.append(_box(layer, row_y))
    if group.own_collectives:
        out.append(
            _text(
                24,
                y - 6,
                f"the block's own code, outside its layers: {_collectives_text(group.own_collectives)}",
                "sub",
            )
        )
    out.append("</g>")
    return out, bottom


def _regions(group: Group, rows: list[tuple[float, Layer]]) -> list[str]:
    out = []
    fill, _ = COLOURS[Kind.REGION]
    for region in group.regions:
        inside = [(y, layer) for y, layer in rows if layer.name.startswith(f"{region.name}.")]
        if not inside:
            continue
        y0, y1 = inside[0][0] - 6, inside[-1][0] + _layer_height(inside[-1][1]) - _GAP + 2
        out.append(
            f'<g class="region"><title>{_esc(f"DTensor region {region.name}: {region.reason}")}'
            f'</title><rect x="{_BOX_X - 22}" y="{y0:g}" width="{_BOX_W + 30}" '
            f'height="{y1 - y0:g}" fill="none" stroke="{fill}" stroke-width="2" '
            f'stroke-dasharray="6 4" rx="6"/>'
            f"{_text(_BOX_X - 18, y0 - 3, f'region {region.name}', 'small', fill=fill)}</g>"
        )
    return out


def _box(layer: Layer, y: float) -> str:
    fill, ink = COLOURS[layer.kind]
    style = "colwise, gathered" if layer.kind is Kind.GATHERED else layer.kind.value.split(":")[0]
    copies = f" x{layer.copies}" if layer.copies > 1 else ""
    sizes = f"{style}  ·  {size_text(layer.bytes_per_rank)}/rank of {size_text(layer.bytes_total)}"
    rule = f"rule {layer.rule}" if layer.rule else "no rule"
    tip = f"{layer.name}{copies} ({layer.kind.value}; {rule}): {layer.reason}"
    out = [
        f'<g class="layer" data-kind="{layer.kind.name.lower()}" data-name="{_esc(layer.name)}">',
        f"<title>{_esc(tip)}</title>",
        f'<rect x="{_BOX_X}" y="{y:g}" width="{_BOX_W}" height="{_BOX_H}" rx="5" fill="{fill}"/>',
        _text(_BOX_X + 10, y + 17, f"{layer.name}{copies}", "name", fill=ink),
        _text(_BOX_X + 10, y + 33, sizes, "small", fill=ink),
    ]
    lines = textwrap.wrap(layer.reason, _REASON_CHARS, max_lines=3, placeholder=" …")
    for i, line in enumerate(lines):
        out.append(_text(_REASON_X, y + 13 + i * 13, line, "reason"))
    if layer.collectives:
        text = _collectives_text(layer.collectives)
        out.append(_pill(_BOX_X + 12, y + _BOX_H + 4, text, f"{layer.name}'s forward runs {text}"))
    out.append("</g>")
    return "".join(out)
