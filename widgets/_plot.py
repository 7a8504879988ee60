"""Building the per-metric, per-rank plotly figure from a metrics store snapshot."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = ["build_figure", "trace_keys", "smooth", "RANK_COLORS"]

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
    """(metric, rank or "mean") for every trace, in figure order."""
    shown = store.ranks() if ranks is None else ranks
    keys: list[tuple[str, int | str]] = []
    for name in store.metric_names():
        for rank in shown:
            keys.append((name, rank))
        if len(store.ranks()) > 1:
            keys.append((name, "mean"))
    return keys


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
    steps, times, values = (
        store.mean_series(name, max_points)
        if rank == "mean"
        else store.series(name, rank, max_points)
    )
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
    metrics = sorted({k[0] for k in keys})
    fig_cls = go.FigureWidget if widget else go.Figure
    base = make_subplots(
        rows=max(1, len(metrics)),
        cols=1,
        shared_xaxes=True,
        subplot_titles=metrics,
        vertical_spacing=0.08 if len(metrics) > 1 else 0.0,
    )
    fig = fig_cls(base)
    for key in keys:
        name, rank = key
        xs, ys = series_xy(store, key, x_axis, weight, max_points)
        row = metrics.index(name) + 1
        color = "#444444" if rank == "mean" else RANK_COLORS[int(rank) % len(RANK_COLORS)]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                name="mean" if rank == "mean" else f"rank {rank}",
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
        height=max(260, height_per_metric * max(1, len(metrics))),
        margin={"l": 50, "r": 20, "t": 30, "b": 40},
        legend={"orientation": "h", "y": -0.12 if len(metrics) < 2 else -0.05},
        template="plotly_white",
    )
    fig.update_yaxes(type="log" if log_y else "linear")
    fig.update_xaxes(
        title_text="step" if x_axis == "step" else "seconds", row=max(1, len(metrics)), col=1
    )
    return fig
