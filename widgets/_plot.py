"""Building the per-metric, per-rank plotly figure from a metrics store snapshot."""

from __future__ import annotations

import contextlib
import threading
from html import escape as html_escape

import plotly.graph_objects as go
from plotly.subplots import make_subplots
from rtnb.widgets._theme import figure_text_color

__all__ = [
    "BAND_FROM_RANKS",
    "MEAN_COLOR",
    "RANK_COLORS",
    "build_figure",
    "hover",
    "import_figure_widget_in_background",
    "robust_range",
    "see_through",
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


def robust_range(traces, k: float = 20.0, early: float = 0.25) -> list[float] | None:
    """A y range for ``traces`` (each a sequence of y values, in step order) without
    their outliers, or None (autorange) when leaving them out changes nothing.

    An outlier is a jump, not a steep start: a smooth decay (``1/step``, an
    exponential) keeps its first steps in view, however steep. Left out are the
    points before a jump in a trace's first ``early`` share that is ``k`` times the
    trace's median change and ``k`` times the change after it (a first loss of 100
    before 2.3, 2.2, ...), and spikes: a point ``k`` median changes away from both
    neighbours on the same side."""
    import numpy as np

    kept, every = [], []
    for ys in traces:
        if isinstance(ys, np.ndarray) and ys.dtype.kind == "f":
            data = ys.ravel()  # the live view's traces: no None to turn into nan
        else:
            data = np.asarray([np.nan if v is None else v for v in ys], dtype=float).ravel()
        data = data[np.isfinite(data)]
        every.append(data)
        keep = np.ones(data.size, dtype=bool)
        if data.size >= 5:
            change = np.abs(np.diff(data))
            usual = float(np.median(change))
            jumps = (change[:-1] > k * usual) & (change[:-1] > k * change[1:])
            jumps = np.nonzero(jumps[: max(1, int(data.size * early))])[0]
            if jumps.size:
                keep[: jumps[-1] + 1] = False
            left, right = data[1:-1] - data[:-2], data[1:-1] - data[2:]
            spikes = (np.sign(left) == np.sign(right)) & (
                np.minimum(np.abs(left), np.abs(right)) > k * usual
            )
            keep[1:-1] &= ~spikes
        kept.append(data[keep])
    rest_all, every_all = np.concatenate(kept or [[]]), np.concatenate(every or [[]])
    if rest_all.size < 5:
        return None
    lo, hi = float(rest_all.min()), float(rest_all.max())
    if lo <= float(every_all.min()) and hi >= float(every_all.max()):
        return None
    pad = 0.05 * (hi - lo) if hi > lo else max(abs(hi) * 0.05, 1e-12)
    return [lo - pad, hi + pad]


def see_through(fig, **layout) -> None:
    """See-through backgrounds with grey grid and text in the theme's colour (see
    ``_theme``): readable on JupyterLab's light and dark themes (a white box in a
    dark notebook is not)."""
    fig.update_layout(
        template="plotly_white",
        paper_bgcolor="rgba(0,0,0,0)",
        plot_bgcolor="rgba(0,0,0,0)",
        font={"color": figure_text_color()},
        **layout,
    )


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
):
    metrics = list(dict.fromkeys(k[0] for k in keys))  # the order they were reported in
    base = make_subplots(
        rows=max(1, len(metrics)),
        cols=1,
        shared_xaxes=True,
        subplot_titles=metrics,
        vertical_spacing=0.08 if len(metrics) > 1 else 0.0,
    )
    fig = go.Figure(base)
    for key in keys:
        name, rank = key
        xs, ys = series_xy(store, key, x_axis, weight, max_points)
        row = metrics.index(name) + 1
        if rank in _BAND:
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode="lines",
                    name="min–max over ranks",
                    legendgroup="band",
                    showlegend=row == 1 and rank == "high",
                    line={"width": 0, "color": "rgba(68,68,68,0.25)"},
                    fill="tonexty" if rank == "high" else None,
                    fillcolor="rgba(68,68,68,0.15)",
                    hoverinfo="skip",
                ),
                row=row,
                col=1,
            )
            continue
        if isinstance(rank, str) and rank.startswith("earlier-"):
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode="lines",
                    name="earlier line",
                    legendgroup="earlier",
                    showlegend=row == 1 and rank == "earlier-0",
                    opacity=0.45,
                    line={"color": EARLIER_COLOR, "width": 1.5, "dash": "dot"},
                    hovertemplate=hover("earlier line", x_axis, name),
                ),
                row=row,
                col=1,
            )
            continue
        color = MEAN_COLOR if rank == "mean" else RANK_COLORS[int(rank) % len(RANK_COLORS)]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                name="mean" if rank == "mean" else f"rank {rank}",
                hovertemplate=hover("mean" if rank == "mean" else f"rank {rank}", x_axis, name),
                legendgroup=str(rank),
                showlegend=row == 1,
                line={
                    "color": color,
                    "width": 2.5 if rank == "mean" else 1.5,
                    "dash": "dash" if rank == "mean" else None,
                },
            ),
            row=row,
            col=1,
        )
    height = max(260, height_per_metric * max(1, len(metrics)))
    top, bottom = 30, 70
    fig.update_layout(
        autosize=True,  # no fixed width: the figure takes its output area's width
        height=height,
        margin={"l": 50, "r": 20, "t": top, "b": bottom},
        # Under the x axis's title, however many entries (a resumed run's "earlier
        # line" made a legend wide enough to run over "step").
        legend={"orientation": "h", "yanchor": "top", "y": -42 / (height - top - bottom)},
    )
    see_through(fig)
    fig.update_xaxes(gridcolor="rgba(128,128,128,0.25)", zerolinecolor="rgba(128,128,128,0.4)")
    fig.update_yaxes(gridcolor="rgba(128,128,128,0.25)", zerolinecolor="rgba(128,128,128,0.4)")
    fig.update_yaxes(type="log" if log_y else "linear")
    fig.update_xaxes(
        title_text="step" if x_axis == "step" else "seconds", row=max(1, len(metrics)), col=1
    )
    for row, name in enumerate(metrics, start=1):
        fig.update_yaxes(title_text=name, row=row, col=1)
    if x_axis == "step":
        add_markers(fig, list(getattr(store, "markers", ())), max(1, len(metrics)))
    # A FigureWidget made from the finished figure carries every trace in its synced
    # state; traces added to a live FigureWidget only travel as messages, so a tab
    # reloaded later would restore an empty plot that no update can fill.
    return go.FigureWidget(fig) if widget else fig


def add_markers(fig, markers: list[tuple[int, str]], rows: int) -> None:
    """A dotted vertical line at each live-control change's step on every subplot,
    its text (``lr = 0.0003``) on the top one."""
    for step, text in markers:
        for row in range(1, rows + 1):
            fig.add_vline(
                x=step,
                line={"dash": "dot", "width": 1.5, "color": "rgba(128,128,128,0.9)"},
                annotation_text=text if row == 1 else None,
                annotation_position="top right",
                row=row,
                col=1,
            )


def import_figure_widget_in_background() -> None:
    """Import plotly's FigureWidget in a daemon thread. The first one a kernel makes
    imports its machinery (nbformat, jsonschema, anywidget: ~1.5 s of a free core
    here, several seconds on a busy one), which a live view's first draw would
    otherwise pay while the cell's first steps go by without a plot."""

    def load() -> None:
        with contextlib.suppress(Exception):
            from plotly.graph_objects import FigureWidget  # noqa: F401

    threading.Thread(target=load, name="rtnb-plotly-import", daemon=True).start()
