"""Building the per-metric, per-rank plotly figure from a metrics store snapshot."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from html import escape as html_escape

import plotly.graph_objects as go
from rtnb.widgets._figure import figure_widget, send_plotly_code
from rtnb.widgets._theme import figure_text_color

__all__ = [
    "BAND_FROM_RANKS",
    "MEAN_COLOR",
    "RANK_COLORS",
    "build_figure",
    "column_layout",
    "hover",
    "prepare_figures_in_background",
    "robust_range",
    "see_through",
    "see_through_layout",
    "smooth",
    "trace_keys",
]

# From this many ranks on, a metric is drawn as its mean, the min-max band over the
# ranks and a few outlier ranks (plus any the user picks), not one line per rank:
# 32 lines are unreadable and cost the browser more than the kernel.
BAND_FROM_RANKS = 9
_BAND = ("low", "high")

# Every line colour keeps 3:1 against both JupyterLab themes' backgrounds (white,
# #111111; WCAG AA for graphics): plotly's orange, pink, olive and cyan, darkened.
RANK_COLORS = [
    "#1f77b4",
    "#d9690b",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#c4509c",
    "#7f7f7f",
    "#8a8a1e",
    "#13909c",
]
MEAN_COLOR = "#888888"  # 3.5:1 on white, 5.3:1 on #111111 (was #444444: 1.9:1 on dark)
EARLIER_COLOR = "#8c8c8c"


def trace_keys(
    store, ranks: list[int] | None = None, expected: list[int] | None = None
) -> list[tuple[str, int | str]]:
    """(metric, rank, "mean", "low" or "high") for every trace, in figure order.

    Up to ``BAND_FROM_RANKS - 1`` ranks: ``ranks`` (default all) and the mean. From
    there on: the band, the mean, the store's outlier ranks and ``ranks``.
    ``expected``: ranks that count as reporting before their first report arrives
    (a running cell's), so the figure has their traces from its first draw and is
    not rebuilt as each rank's first report lands."""
    every = sorted(set(store.ranks()) | set(expected or ()))
    banded = len(every) >= BAND_FROM_RANKS
    keys: list[tuple[str, int | str]] = []
    earlier = getattr(store, "earlier", [])
    names = list(store.metric_names())
    names += [n for segment in earlier for n in segment if n not in names]
    for name in names:
        # Lines the ranks went back from (a resume): drawn first, faded, underneath.
        keys += [(name, f"earlier-{i}") for i, seg in enumerate(earlier) if name in seg]
        if banded:
            keys += [(name, "low"), (name, "high")]
            shown = sorted(set(store.outlier_ranks(name)) | set(ranks or ()))
        else:
            shown = every if ranks is None else ranks
        keys += [(name, rank) for rank in shown]
        if len(every) > 1:
            keys.append((name, "mean"))
    return keys


def robust_range(
    traces, k: float = 20.0, window: int = 5, most: int = 2, gain: float = 3.0
) -> list[float] | None:
    """A y range for ``traces`` (each a sequence of y values, in step order) without
    their spikes, or None (autorange: every point in view).

    A curve's story stays in view: a falling loss's first steps, however steep or
    bumpy its descent (SGD's early bumps are as large as the changes around them), a
    plateau's noise, a rising accuracy. Left out are only spikes: at most ``most``
    points of a trace that stand ``k`` times the change usual *around them* (the
    median of the ``window`` changes on each side) away from both neighbours on the
    same side (one point, or two together), or a trace's first ``most`` points before a jump ``k`` times that
    usual change, the change after it and the whole span of the rest (a first loss
    of 1000 before 1.0, 0.5, 0.33...), and only where leaving them out shrinks the range ``gain``
    times: a spike that would flatten the rest. NaN and infinities are never drawn
    and never counted."""
    import numpy as np

    kept, every = [], []
    for ys in traces:
        if isinstance(ys, np.ndarray) and ys.dtype.kind == "f":
            data = ys.ravel()  # the live view's traces: no None to turn into nan
        else:
            data = np.asarray([np.nan if v is None else v for v in ys], dtype=float).ravel()
        data = data[np.isfinite(data)]
        every.append(data)
        out = _spikes(data, k, window, most)
        kept.append(data[~out] if out.any() else data)
    rest_all, every_all = np.concatenate(kept or [[]]), np.concatenate(every or [[]])
    if rest_all.size < 5 or rest_all.size == every_all.size:
        return None
    lo, hi = float(rest_all.min()), float(rest_all.max())
    full = float(every_all.max()) - float(every_all.min())
    if full <= gain * (hi - lo):
        return None  # the spikes do not flatten the rest: show every point
    pad = 0.05 * (hi - lo) if hi > lo else max(abs(hi) * 0.05, 1e-12)
    return [lo - pad, hi + pad]


def _spikes(data, k: float, window: int, most: int):
    """Which points of ``data`` (finite values in step order) are spikes, as
    :func:`robust_range` says; none where more than ``most`` would be."""
    import numpy as np

    n = data.size
    out = np.zeros(n, dtype=bool)
    if n < 5:
        return out
    change = np.abs(np.diff(data))  # change[i]: from point i to point i + 1
    # The change usual around point i: the median of the changes up to ``window``
    # away on each side, leaving out the two that touch i (a spike's own).
    padded = np.concatenate([np.full(window + 1, np.nan), change, np.full(window + 1, np.nan)])
    around = np.lib.stride_tricks.sliding_window_view(padded, 2 * window + 2)[:n].copy()
    around[:, window : window + 2] = np.nan  # change[i - 1] and change[i]
    usual = np.nanmedian(around, axis=1)
    left, right = data[1:-1] - data[:-2], data[1:-1] - data[2:]
    spikes = (np.sign(left) == np.sign(right)) & (
        np.minimum(np.abs(left), np.abs(right)) > k * usual[1:-1]
    )
    out[1:-1] = spikes
    # Two points up there together: i and i + 1, each far from its outer neighbour.
    up, down = data[1:-2] - data[:-3], data[2:-1] - data[3:]
    apart = np.minimum(np.abs(up), np.abs(down))
    pairs = (
        (np.sign(up) == np.sign(down))
        & (apart > k * usual[1:-2])
        & (np.abs(data[1:-2] - data[2:-1]) < apart / 2)
    )
    for i in np.nonzero(pairs)[0] + 1:
        out[i : i + 2] = True
    for first in range(min(most, n - 2)):
        # A start that jumps to where the curve then stays: k times the change after
        # it, the change usual there, and the whole span of what follows (a steep
        # descent's first steps are a fair share of that span).
        rest = data[first + 1 :]
        jump = change[first]
        if (
            jump > k * change[first + 1]
            and jump > k * usual[first + 1]
            and jump > k * float(rest.max() - rest.min())
        ):
            out[: first + 1] = True
    if out.sum() > most:
        return np.zeros(n, dtype=bool)  # more than a spike: part of the curve's story
    return out


def see_through_layout() -> dict:
    """See-through backgrounds with grey grid and text in the theme's colour (see
    ``_theme``): readable on JupyterLab's light and dark themes (a white box in a
    dark notebook is not)."""
    return {
        "template": "plotly_white",
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"color": figure_text_color()},
    }


def see_through(fig, **layout) -> None:
    """:func:`see_through_layout` applied to ``fig``, with ``layout`` besides."""
    fig.update_layout(**see_through_layout(), **layout)


def hover(label: str, x_axis: str, metric: str) -> str:
    """The one hover text of a curve: what it is, where on x, the metric's value
    (``label`` is HTML already; ``metric`` is escaped here)."""
    x_name = "step" if x_axis == "step" else "s"
    return f"{label}<br>{x_name} %{{x}}<br>{html_escape(metric)} %{{y:.6g}}<extra></extra>"


def x_axis_control(**look):
    """The x-axis picker of the live view and the runs dashboard: by step or by wall
    time (the values ``series_xy``/``run_curve`` take)."""
    import ipywidgets as w

    return w.Dropdown(
        options=[("step", "step"), ("wall time", "time")], value="step", description="x", **look
    )


def ema_control(**look):
    """The EMA slider of the live view and the runs dashboard: :func:`smooth`'s weight."""
    import ipywidgets as w

    return w.FloatSlider(
        value=0.0, min=0.0, max=0.99, step=0.01, description="EMA", readout_format=".2f", **look
    )


def smooth(values: list[float], weight: float) -> list[float]:
    """Exponential moving average (TensorBoard's smoothing slider), debiased."""
    if weight <= 0 or not values:
        return values
    out, last, norm = [], 0.0, 0.0
    for v in values:
        last = weight * last + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(last / norm)
    return out


def series_xy(store, key, x_axis: str, weight: float, max_points: int):
    name, rank = key
    if rank in _BAND:
        steps, times, low, high = store.band_series(name, max_points)
        values = low if rank == "low" else high
    elif rank == "mean":
        steps, times, values = store.mean_series(name, max_points)
    elif isinstance(rank, str) and rank.startswith("earlier-"):
        steps, times, values = store.earlier_series(name, int(rank[8:]), max_points)
    else:
        steps, times, values = store.series(name, rank, max_points)
    xs = (
        steps
        if x_axis == "step"
        else [t - (store.started_at or (times[0] if times else 0)) for t in times]
    )
    return xs, smooth(values, weight)


def column_layout(titles: list[str], vertical_spacing: float) -> dict:
    """The layout ``make_subplots(rows=len(titles), cols=1, shared_xaxes=True,
    subplot_titles=titles)`` makes (its template aside), as plain data: one subplot a
    metric, stacked, the x axes matched to the bottom one's. Built here because
    make_subplots costs ~30 ms, the most of a live view's rebuild."""
    rows = max(1, len(titles))
    height = (1.0 - vertical_spacing * (rows - 1)) / rows
    layout: dict = {"annotations": []}
    for row in range(1, rows + 1):
        suffix = "" if row == 1 else str(row)
        bottom = (rows - row) * (height + vertical_spacing)  # summed upwards, as plotly
        top = bottom + height
        xaxis: dict = {"anchor": f"y{suffix}", "domain": [0.0, 1.0]}
        if row < rows:
            xaxis.update(matches=f"x{rows}", showticklabels=False)
        layout[f"xaxis{suffix}"] = xaxis
        layout[f"yaxis{suffix}"] = {"anchor": f"x{suffix}", "domain": [bottom, top]}
        if row <= len(titles):
            layout["annotations"].append(
                {
                    "font": {"size": 16},
                    "showarrow": False,
                    "text": titles[row - 1],
                    "x": 0.5,
                    "xanchor": "center",
                    "xref": "paper",
                    "y": top,
                    "yanchor": "bottom",
                    "yref": "paper",
                }
            )
    return layout


def build_figure(
    store,
    keys,
    *,
    widget: bool,
    x_axis: str = "step",
    weight: float = 0.0,
    log_y: bool = False,
    max_points: int = 1000,
    height_per_metric: int = 220,
    on_missed: Callable[[], None] | None = None,
):
    metrics = list(dict.fromkeys(k[0] for k in keys))  # the order they were reported in
    rows = max(1, len(metrics))
    # Plain data, made into a figure once: each trace added and each layout update
    # on a plotly object is validated again (a rebuild took ~130 ms, now ~15).
    layout = column_layout(metrics, 0.08 if len(metrics) > 1 else 0.0)
    traces: list[dict] = []
    for key in keys:
        name, rank = key
        xs, ys = series_xy(store, key, x_axis, weight, max_points)
        row = metrics.index(name) + 1
        on_row = {"xaxis": _axis("x", row), "yaxis": _axis("y", row)}
        if rank in _BAND:
            trace = {
                "name": "min–max over ranks",
                "legendgroup": "band",
                "showlegend": row == 1 and rank == "high",
                "line": {"width": 0, "color": "rgba(68,68,68,0.25)"},
                "fillcolor": "rgba(68,68,68,0.15)",
                "hoverinfo": "skip",
            }
            if rank == "high":
                trace["fill"] = "tonexty"
        elif isinstance(rank, str) and rank.startswith("earlier-"):
            trace = {
                "name": "earlier line",
                "legendgroup": "earlier",
                "showlegend": row == 1 and rank == "earlier-0",
                "opacity": 0.45,
                "line": {"color": EARLIER_COLOR, "width": 1.5, "dash": "dot"},
                "hovertemplate": hover("earlier line", x_axis, name),
            }
        else:
            label = "mean" if rank == "mean" else f"rank {rank}"
            line = {
                "color": MEAN_COLOR
                if rank == "mean"
                else RANK_COLORS[int(rank) % len(RANK_COLORS)],
                "width": 2.5 if rank == "mean" else 1.5,
            }
            if rank == "mean":
                line["dash"] = "dash"
            trace = {
                "name": label,
                "hovertemplate": hover(label, x_axis, name),
                "legendgroup": str(rank),
                "showlegend": row == 1,
                "line": line,
            }
        traces.append({"type": "scatter", "x": xs, "y": ys, "mode": "lines", **trace, **on_row})
    height = max(260, height_per_metric * rows)
    top, bottom = 30, 70
    grid = {"gridcolor": "rgba(128,128,128,0.25)", "zerolinecolor": "rgba(128,128,128,0.4)"}
    for row in range(1, rows + 1):
        layout[_axis("xaxis", row)].update(grid)
        layout[_axis("yaxis", row)].update(grid, type="log" if log_y else "linear")
        if row <= len(metrics):
            layout[_axis("yaxis", row)]["title"] = {"text": metrics[row - 1]}
    layout[_axis("xaxis", rows)]["title"] = {"text": "step" if x_axis == "step" else "seconds"}
    layout.update(
        autosize=True,  # no fixed width: the figure takes its output area's width
        height=height,
        margin={"l": 50, "r": 20, "t": top, "b": bottom},
        # Under the x axis's title, however many entries (a resumed run's "earlier
        # line" made a legend wide enough to run over "step").
        legend={"orientation": "h", "yanchor": "top", "y": -42 / (height - top - bottom)},
        **see_through_layout(),
    )
    if x_axis == "step":
        add_markers(layout, list(getattr(store, "markers", ())), rows)
    # A FigureWidget made whole carries every trace in its synced state; traces added
    # to a live FigureWidget only travel as messages, so a tab reloaded later would
    # restore an empty plot that no update can fill.
    if widget:
        return figure_widget(data=traces, layout=layout, on_missed=on_missed)
    return go.Figure(data=traces, layout=layout)


def _axis(kind: str, row: int) -> str:
    """The name of ``row``'s axis of ``kind`` (x, y, xaxis, yaxis): x, x2, ..."""
    return kind if row == 1 else f"{kind}{row}"


def add_markers(layout: dict, markers: list[tuple[int, str]], rows: int) -> None:
    """A dotted vertical line at each live-control change's step on every subplot,
    its text (``lr = 0.0003``) on the top one."""
    for step, text in markers:
        for row in range(1, rows + 1):
            x, y = _axis("x", row), _axis("y", row)
            layout.setdefault("shapes", []).append(
                {
                    "type": "line",
                    "x0": step,
                    "x1": step,
                    "xref": x,
                    "y0": 0,
                    "y1": 1,
                    "yref": f"{y} domain",
                    "line": {"dash": "dot", "width": 1.5, "color": "rgba(128,128,128,0.9)"},
                }
            )
        layout["annotations"].append(
            {
                "showarrow": False,
                "text": text,
                "x": step,
                "xanchor": "left",
                "xref": "x",
                "y": 1,
                "yanchor": "top",
                "yref": "y domain",
            }
        )


def prepare_figures_in_background() -> None:
    """Import plotly's FigureWidget and send plotly's page code, in a daemon thread.
    The first figure a kernel makes imports its machinery (nbformat, jsonschema,
    anywidget: ~1.5 s of a free core here, several seconds on a busy one) and the page
    evaluates plotly's code (~1.3 s), which a live view's first draw would otherwise
    pay while the cell's first steps go by without a plot."""

    def load() -> None:
        with contextlib.suppress(Exception):
            send_plotly_code()

    threading.Thread(target=load, name="rtnb-plotly-import", daemon=True).start()
