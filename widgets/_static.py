"""Output that reads well in a saved notebook: a few progress lines, then a static figure.

Used when no live frontend renders widgets (papermill, nbclient, scripts). The
figure is plain ``application/vnd.plotly.v1+json``: no widget state, no plotly.js
bundle, and at most ``max_points`` points per trace however long the run.
"""

from __future__ import annotations

import json
import sys
import time

from rtnb.widgets._header import format_header
from rtnb.widgets._plot import build_figure, robust_range, smooth, trace_keys
from rtnb.widgets._svg import figure_svg
from rtnb.widgets._theme import redraw_when_theme_known

__all__ = [
    "ACTIVE_BUTTON_COLOR",
    "BUTTON_COLOR",
    "BUTTON_TEXT_COLOR",
    "ProgressLines",
    "static_figure",
    "redraw_for_the_page_theme",
    "show_static_figure",
    "static_figure_bundle",
]

_MAX_LINES = 10
BUTTON_COLOR = "#e6e6e6"
# plotly.js draws the active button #F4FAFF itself (updatemenus have no setting)
ACTIVE_BUTTON_COLOR = "#f4faff"
BUTTON_TEXT_COLOR = "#1a1a1a"


class ProgressLines:
    """Prints at most ~10 progress lines per cell: at each tenth of ``total_steps``
    when known, else at growing intervals."""

    def __init__(self, store, handle, out=None) -> None:
        self.store = store
        self.handle = handle
        self.out = out or sys.stdout
        self.lines = 0
        self._next_step = None
        self._next_time = time.monotonic() + 5.0
        self._interval = 5.0
        self._unsubscribe = store.subscribe(self._on_reports)

    def _on_reports(self, _rank, _batch) -> None:
        if self.lines >= _MAX_LINES:
            return
        progress = self.store.progress()
        total = progress.total_steps
        if total:
            self._next_step = self._next_step or max(1, total // 10)
            if progress.step < self._next_step:
                return
            self._next_step = (progress.step // max(1, total // 10) + 1) * max(1, total // 10)
        else:
            if time.monotonic() < self._next_time:
                return
            self._interval *= 2
            self._next_time = time.monotonic() + self._interval
        self._print(progress)

    def _print(self, progress) -> None:
        import re

        handle = self.handle
        header = re.sub(
            r"<[^>]+>",
            "",
            format_header(
                progress,
                "running",
                handle.cell_id,
                handle.recoveries,
                handle.restarted_from,
                label=getattr(handle, "label", None),
            ),
        )
        last = self.store.last
        metrics = ""
        if last:
            names = self.store.metric_names()[:4]
            vals = []
            for name in names:
                nums = [
                    rep.metrics[name]
                    for rep in last.values()
                    if isinstance(rep.metrics.get(name), (int, float))
                ]
                if nums:
                    vals.append(f"{name}={sum(nums) / len(nums):.4g}")
            metrics = " | " + " ".join(vals) if vals else ""
        self.out.write(f"rtnb: {header}{metrics}\n")
        self.out.flush()
        self.lines += 1

    def close(self) -> None:
        self._unsubscribe()


# The static figure's own controls (plotly buttons: they work with no kernel).
_EMA_WEIGHTS = (0.6, 0.9)


def static_figure(store, title: str = "", max_points: int = 500, metrics: list[str] | None = None):
    """The store's figure for a saved notebook: every trace, y ranges that ignore early
    outliers, and buttons for the y scale and for smoothing; None if nothing was reported."""
    keys = [k for k in trace_keys(store) if metrics is None or k[0] in metrics]
    if not keys:
        return None
    fig = build_figure(store, keys, widget=False, max_points=max_points)
    _add_views(fig, keys)
    if title:
        # The title on the first line, the buttons on the second, the plot below.
        fig.update_layout(
            title={"text": title, "x": 0.01, "y": 0.995, "yanchor": "top", "font": {"size": 13}}
        )
    fig.update_layout(margin={"t": 100})
    return fig


def _add_views(fig, keys) -> None:
    axes = sorted({t.yaxis or "y" for t in fig.data}, key=lambda a: int(a[1:] or 1))
    names = ["yaxis" + a[1:] for a in axes]
    ranges = {}
    for axis, name in zip(axes, names):
        ranges[name] = robust_range(
            [
                trace.y or ()
                for trace, (_, rank) in zip(fig.data, keys)
                if (trace.yaxis or "y") == axis and rank not in ("low", "high")
            ]
        )
    for name, span in ranges.items():
        if span is not None:
            fig.layout[name].range = span
    robust = {f"{n}.range": r for n, r in ranges.items() if r is not None}
    linear = {f"{n}.type": "linear" for n in names}
    fit = {f"{n}.autorange": True for n in names}
    raw = [list(t.y or ()) for t in fig.data]
    smoothed = {
        weight: [
            list(t.y or ()) if rank in ("low", "high") else smooth(list(t.y or ()), weight)
            for t, (_, rank) in zip(fig.data, keys)
        ]
        for weight in _EMA_WEIGHTS
    }
    # Opaque buttons with dark text: readable on both themes (a transparent button
    # took the theme's background while plotly drew the active one white with the
    # figure's grey text, 2:1 in the dark theme). 14:1 and 17:1 for the text.
    looks = {
        "bgcolor": BUTTON_COLOR,
        "bordercolor": "#8c8c8c",
        "font": {"color": BUTTON_TEXT_COLOR},
    }
    menus = [
        {
            **looks,
            "type": "buttons",
            "direction": "right",
            "showactive": True,
            "x": 1.0,
            "xanchor": "right",
            "y": 1.0,
            "yanchor": "bottom",
            "pad": {"b": 28},
            "buttons": [
                {"label": "ignore outliers", "method": "relayout", "args": [{**linear, **robust}]},
                {"label": "fit all", "method": "relayout", "args": [{**linear, **fit}]},
                {
                    "label": "log y",
                    "method": "relayout",
                    "args": [{**{f"{n}.type": "log" for n in names}, **fit}],
                },
            ],
        },
        {
            **looks,
            "type": "buttons",
            "direction": "right",
            "showactive": True,
            "x": 0.0,
            "xanchor": "left",
            "y": 1.0,
            "yanchor": "bottom",
            "pad": {"b": 28},
            "buttons": [
                {"label": "raw", "method": "restyle", "args": [{"y": raw}]},
                *(
                    {"label": f"EMA {w:g}", "method": "restyle", "args": [{"y": ys}]}
                    for w, ys in smoothed.items()
                ),
            ],
        },
    ]
    if not robust:
        menus[0]["buttons"].pop(0)
    fig.update_layout(updatemenus=menus)


def static_figure_bundle(
    store, title: str = "", max_points: int = 500, metrics: list[str] | None = None
) -> dict | None:
    """A display bundle that lasts in a saved notebook: the figure as plotly JSON
    (interactive wherever plotly.js renders it: JupyterLab, Notebook 7, VS Code), an
    SVG of it for everything else (GitHub, nbviewer, nbconvert's HTML), and a text
    summary; None if nothing was reported."""
    fig = static_figure(store, title, max_points, metrics)
    if fig is None:
        return None
    progress = store.progress()
    names = [m for m in store.metric_names() if metrics is None or m in metrics]
    # The ranks and steps of this cell (a group scaled since reported with others).
    ranks = sorted(rank for rank, steps in progress.steps.items() if steps > 0) or store.ranks()
    summary = (
        f"rtnb metrics: {', '.join(names)} for ranks {ranks}, "
        f"{max(progress.steps.values(), default=0)} steps up to step "
        f"{max(progress.run_steps.values(), default=0)}"
    )
    return {
        "application/vnd.plotly.v1+json": json.loads(fig.to_json()),
        "image/svg+xml": figure_svg(fig, title),
        "text/plain": summary,
    }


def show_static_figure(store, title: str = "", metrics: list[str] | None = None) -> bool:
    """Display :func:`static_figure_bundle` in this cell; False if nothing was reported."""
    from IPython.display import display

    bundle = static_figure_bundle(store, title, metrics=metrics)
    if bundle is None:
        return False
    shown = display(bundle, raw=True, display_id=True)
    redraw_for_the_page_theme(shown, store, title, metrics=metrics)
    return True


def redraw_for_the_page_theme(
    shown, store, title: str = "", max_points: int = 500, metrics: list[str] | None = None
) -> None:
    """Draw the figure ``shown`` displays again once the page says its theme, if no page
    had (Run All: the cell ran before the answer came) and the page is dark."""

    def redraw() -> None:
        bundle = static_figure_bundle(store, title, max_points, metrics)
        # Through text: JupyterLab's plotly renderer ignores a new figure for one it
        # drew; a new renderer draws it.
        shown.update({"text/plain": bundle["text/plain"]}, raw=True)
        shown.update(bundle, raw=True)

    redraw_when_theme_known(redraw)
