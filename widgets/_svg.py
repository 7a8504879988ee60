"""A plotly figure of line traces drawn as plain SVG: what a saved notebook shows
where no plotly.js runs (GitHub, nbviewer, nbconvert's HTML, a mail client).

Only what rtnb's figures use: one column of subplots, line traces (solid or
dashed), the min-max band (a trace filled to the previous one), linear or log y,
subplot titles. No JavaScript, so it renders anywhere an image does.
"""

from __future__ import annotations

import math
from html import escape

__all__ = ["figure_svg"]

_WIDTH = 760
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 28, 30


def _numbers(values) -> list[float | None]:
    out: list[float | None] = []
    for v in values if values is not None else ():
        try:
            f = float(v)
        except (TypeError, ValueError):
            out.append(None)
            continue
        out.append(f if math.isfinite(f) else None)
    return out


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _axis_of(trace) -> str:
    return trace.yaxis or "y"


def figure_svg(fig, title: str = "", panel_height: int = 170) -> str:
    """``fig`` (a plotly Figure built by :func:`rtnb.widgets._plot.build_figure`) as SVG."""
    layout = fig.layout
    panels: list[str] = []
    for trace in fig.data:
        if _axis_of(trace) not in panels:
            panels.append(_axis_of(trace))
    titles = [a.text for a in (layout.annotations or ()) if a.text]
    x_title = next(
        (layout[k].title.text for k in layout if k.startswith("xaxis") and layout[k].title.text),
        "step",
    )
    height = _TOP + len(panels) * (panel_height + _BOTTOM) + (24 if title else 0) + 12
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
        f'viewBox="0 0 {_WIDTH} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{_WIDTH}" height="{height}" fill="white"/>',
    ]
    top = 8
    if title:
        parts.append(f'<text x="{_LEFT}" y="{top + 12}" font-size="13">{escape(title)}</text>')
        top += 24
    for index, axis in enumerate(panels):
        traces = [t for t in fig.data if _axis_of(t) == axis]
        axis_layout = layout["yaxis" + axis[1:]] if axis != "y" else layout.yaxis
        log = getattr(axis_layout, "type", None) == "log"
        y0 = top + _TOP + index * (panel_height + _BOTTOM)
        name = titles[index] if index < len(titles) else ""
        span = None if log else getattr(axis_layout, "range", None)
        parts.append(
            _panel(
                traces,
                name,
                y0,
                panel_height,
                log,
                span,
                index,
                last=index == len(panels) - 1,
                x_title=x_title,
            )
        )
    parts.append("</svg>")
    return "".join(parts)


def _panel(
    traces,
    name: str,
    y0: float,
    height: float,
    log: bool,
    span,
    index: int,
    last: bool,
    x_title: str = "step",
) -> str:
    points = []
    for trace in traces:
        xs, ys = _numbers(trace.x), _numbers(trace.y)
        if log:
            ys = [math.log10(y) if y is not None and y > 0 else None for y in ys]
        points.append([(x, y) for x, y in zip(xs, ys) if x is not None and y is not None])
    every = [p for series in points for p in series]
    out = [f'<text x="{_LEFT}" y="{y0 - 6}" font-size="12">{escape(name)}</text>']
    x_left, x_right = _LEFT, _WIDTH - _RIGHT
    out.append(
        f'<rect x="{x_left}" y="{y0}" width="{x_right - x_left}" height="{height}" '
        'fill="none" stroke="#ccc"/>'
    )
    if not every:
        return "".join(out)
    xmin, xmax = min(p[0] for p in every), max(p[0] for p in every)
    ymin, ymax = min(p[1] for p in every), max(p[1] for p in every)
    if span is not None:  # the figure's own y range (spikes left out)
        ymin, ymax = float(span[0]), float(span[1])
    if xmax == xmin:
        xmax = xmin + 1
    if ymax == ymin:
        ymin, ymax = ymin - 0.5, ymax + 0.5

    def sx(x: float) -> float:
        return x_left + (x - xmin) / (xmax - xmin) * (x_right - x_left)

    def sy(y: float) -> float:
        return y0 + height - (y - ymin) / (ymax - ymin) * height

    def label(y: float) -> str:
        return _fmt(10**y) if log else _fmt(y)

    for y in (ymin, (ymin + ymax) / 2, ymax):
        out.append(
            f'<text x="{x_left - 4}" y="{sy(y) + 4:.1f}" text-anchor="end" fill="#555">'
            f"{label(y)}</text>"
        )
    if last:
        out.append(
            f'<text x="{(x_left + x_right) / 2:.0f}" y="{y0 + height + 26}" '
            f'text-anchor="middle" fill="#555">{escape(x_title)}</text>'
        )
        for x in (xmin, xmax):
            out.append(
                f'<text x="{sx(x):.1f}" y="{y0 + height + 14}" text-anchor="middle" '
                f'fill="#555">{_fmt(x)}</text>'
            )
    clip = f"rtnb-panel-{index}"
    out.append(
        f'<clipPath id="{clip}"><rect x="{x_left}" y="{y0}" width="{x_right - x_left}" '
        f'height="{height}"/></clipPath><g clip-path="url(#{clip})">'
    )
    previous: list[tuple[float, float]] = []
    for trace, series in zip(traces, points):
        line = trace.line
        if trace.fill == "tonexty" and previous and series:
            outline = series + list(reversed(previous))
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in outline)
            out.append(f'<polygon points="{path}" fill="rgba(68,68,68,0.15)" stroke="none"/>')
        elif series and (line.width is None or line.width > 0):
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in series)
            dash = ' stroke-dasharray="6,3"' if line.dash == "dash" else ""
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{escape(line.color or "#444")}" '
                f'stroke-width="{line.width or 1.5}"{dash}/>'
            )
        previous = series
    out.append("</g>")
    return "".join(out)
