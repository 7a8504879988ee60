"""The figure of ``%rtnb profile``: each rank's step split into its parts."""

from __future__ import annotations

import plotly.graph_objects as go

__all__ = ["profile_figure"]

_COLORS = {
    "compute": "#4c78a8",
    "communication": "#f58518",
    "data": "#54a24b",
    "rtnb": "#b279a2",
    "idle": "#bab0ac",
}


def profile_figure(report) -> go.Figure:
    """Stacked bars, one per rank: ms per step in compute, communication, data,
    rtnb and idle; the straggler's bar named in the title."""
    ranks = [r for r, p in sorted(report.ranks.items()) if not p.error]
    fig = go.Figure()
    for part, color in _COLORS.items():
        fig.add_trace(
            go.Bar(
                y=[f"rank {r}" for r in ranks],
                x=[report.ranks[r].per_step_ms(part) for r in ranks],
                name=part,
                orientation="h",
                marker_color=color,
                hovertemplate=f"{part}: %{{x:.2f}} ms/step<extra>%{{y}}</extra>",
            )
        )
    last = report.first_step + report.steps - 1
    title = f"steps {report.first_step}-{last}: ms per step"
    if report.straggler is not None:
        title += f" — straggler: rank {report.straggler} ({report.cause})"
    fig.update_layout(
        barmode="stack",
        title=title,
        height=max(200, 60 + 40 * len(ranks)),
        margin={"l": 60, "r": 20, "t": 40, "b": 40},
        xaxis_title="ms per step",
        yaxis={"autorange": "reversed"},
        legend={"orientation": "h", "y": -0.3},
    )
    return fig
