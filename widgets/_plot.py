"""Building the per-metric, per-rank plotly figure from a metrics store snapshot."""

from __future__ import annotations

from html import escape as html_escape

import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = [
    "BAND_FROM_RANKS",
    "RANK_COLORS",
    "build_figure",
    "hover",
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

RANK_COLORS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]


def trace_keys(store, ranks: list[int] | None = None) -> list[tuple[str, int | str]]:
    """(metric, rank, "mean", "low" or "high") for every trace, in figure order.

    Up to ``BAND_FROM_RANKS - 1`` ranks: ``ranks`` (default all) and the mean. From
    there on: the band, the mean, the store's outlier ranks and ``ranks``."""
    every = store.ranks()
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


def robust_range(traces, early: float = 0.1) -> list[float] | None:
    """A y range for ``traces`` (each a sequence of y values, in step order) that
    leaves out their first steps: a loss's first values would flatten the rest of
    the curve (TensorBoard's "ignore outliers", on by default). The range of each
    trace after its first ``early`` share of points, padded; None when that is
    (nearly) the full range anyway or too few points remain."""
    import numpy as np

    rest, every = [], []
    for ys in traces:
        data = np.asarray(ys, dtype=float).ravel()
        data = data[np.isfinite(data)]
        every.append(data)
        rest.append(data[max(1, int(len(data) * early)) :])
    rest_all, every_all = np.concatenate(rest or [[]]), np.concatenate(every or [[]])
    if rest_all.size < 5:
        return None
    lo, hi = float(rest_all.min()), float(rest_all.max())
    full_lo, full_hi = float(every_all.min()), float(every_all.max())
    if hi - lo >= 0.8 * (full_hi - full_lo):
        return None
    pad = 0.05 * (hi - lo) if hi > lo else max(abs(hi) * 0.05, 1e-12)
    return [lo - pad, hi + pad]


def see_through(fig, **layout) -> None:
    """See-through backgrounds with grey text and grid: readable on JupyterLab's
    light and dark themes alike (a white box in a dark notebook is not)."""
    fig.update_layout(
        template="plotly_white",
        paper_bgcolor="rgba(0,0,0,0)",
        plot_bgcolor="rgba(0,0,0,0)",
        font={"color": "#888"},
        **layout,
    )


def hover(label: str, x_axis: str, metric: str) -> str:
    """The one hover text of a curve: what it is, where on x, the metric's value
    (``label`` is HTML already; ``metric`` is escaped here)."""
    x_name = "step" if x_axis == "step" else "s"
    return f"{label}<br>{x_name} %{{x}}<br>{html_escape(metric)} %{{y:.6g}}<extra></extra>"


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
                    line={"color": "#999999", "width": 1.5, "dash": "dot"},
                    hovertemplate=hover("earlier line", x_axis, name),
                ),
                row=row,
                col=1,
            )
            continue
        color = "#444444" if rank == "mean" else RANK_COLORS[int(rank) % len(RANK_COLORS)]
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
    fig.update_layout(
        autosize=True,  # no fixed width: the figure takes its output area's width
        height=max(260, height_per_metric * max(1, len(metrics))),
        margin={"l": 50, "r": 20, "t": 30, "b": 40},
        legend={"orientation": "h", "y": -0.12 if len(metrics) < 2 else -0.05},
    )
    see_through(fig)
    fig.update_xaxes(gridcolor="rgba(128,128,128,0.25)", zerolinecolor="rgba(128,128,128,0.4)")
    fig.update_yaxes(gridcolor="rgba(128,128,128,0.25)", zerolinecolor="rgba(128,128,128,0.4)")
    fig.update_yaxes(type="log" if log_y else "linear")
    fig.update_xaxes(
        title_text="step" if x_axis == "step" else "seconds", row=max(1, len(metrics)), col=1
    )
    # A FigureWidget made from the finished figure carries every trace in its synced
    # state; traces added to a live FigureWidget only travel as messages, so a tab
    # reloaded later would restore an empty plot that no update can fill.
    return go.FigureWidget(fig) if widget else fig
