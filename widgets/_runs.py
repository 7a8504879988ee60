"""``RunsDashboard``: every run in a storage location, compared.

A table of runs sorted by a click on a column's header (the run with its state,
start, duration, steps, ranks, checkpoints, the last and best value of a chosen
metric, key config), each row ticked or not for the plot; the
selected runs' curves overlaid in one plot (the mean over ranks per run, an
optional min-max band, x by step or wall time, EMA, log y); a button opens a
run's checkpoint browser. It reads run directories through the callables it is
given (never Ray), so it shows batch runs and other kernels' runs alike, and
re-reads the live ones every few seconds.
"""

from __future__ import annotations

import html
import threading
import time

import ipywidgets as w
import plotly.graph_objects as go
from rtnb.widgets._comms import close_tree, close_view
from rtnb.widgets._figure import figure_widget, missed_updates
from rtnb.widgets._plot import (
    RANK_COLORS,
    ema_control,
    hover,
    robust_range,
    see_through,
    smooth,
    x_axis_control,
)
from rtnb.widgets._table import Column, DataTable, Row, Tone
from rtnb.widgets._theme import follow_theme

from rtnb.core._score import direction_of
from rtnb.metrics._compare import (
    NUMERIC_RUN_COLUMNS,
    format_rows,
    run_cells,
    run_columns,
    run_curve,
    runs_rows,
)

__all__ = ["RunsDashboard", "runs_bundle", "runs_figure"]

_TIGHT = {"description_width": "initial"}
# A run's state as a badge's colour.
_STATE_TONES: dict[str, Tone] = {"live": "busy", "finished": "good", "failed": "bad"}


def runs_figure(
    stores: dict,
    names: list[str],
    metric: str,
    *,
    x_axis: str = "step",
    weight: float = 0.0,
    log_y: bool = False,
    band: bool = False,
    widget: bool = False,
    outliers: bool = False,
):
    """The selected runs' ``metric`` overlaid: one mean curve per run (colour per
    run), with its min-max band over the ranks when ``band``; a resumed run's
    earlier lines (the main line it branched from) dotted under it in its colour.
    ``outliers``: the y range leaves out outliers (:func:`robust_range`), so one
    run's first loss does not flatten the others."""
    fig = go.Figure()
    curves = []
    for i, name in enumerate(names):
        store = stores.get(name)
        if store is None or metric not in store.metric_names():
            continue
        xs, ys, low, high = run_curve(store, metric, x_axis)
        color = RANK_COLORS[i % len(RANK_COLORS)]
        for index, segment in enumerate(getattr(store, "earlier", [])):
            if metric not in segment:
                continue
            steps, times, values = store.earlier_series(metric, index)
            origin = store.started_at or (times[0] if times else 0.0)
            fig.add_trace(
                go.Scatter(
                    x=steps if x_axis == "step" else [t - origin for t in times],
                    y=smooth(values, weight),
                    mode="lines",
                    name=f"{name} (earlier line)",
                    legendgroup=name,
                    showlegend=False,
                    opacity=0.6,
                    line={"color": color, "width": 1.5, "dash": "dot"},
                    hovertemplate=hover(html.escape(f"{name}, earlier line"), x_axis, metric),
                )
            )
            curves.append(values)
        curves.append(ys)
        if band and low is not None and len(low) == len(xs):
            # the lower edge, then the upper one filled down to it
            for edge, fill in ((low, {}), (high, {"fill": "tonexty", "opacity": 0.2})):
                fig.add_trace(
                    go.Scatter(
                        x=xs,
                        y=list(edge),
                        mode="lines",
                        line={"width": 0, "color": color},
                        showlegend=False,
                        hoverinfo="skip",
                        legendgroup=name,
                        **fill,
                    )
                )
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=smooth(ys, weight),
                mode="lines",
                name=name,
                legendgroup=name,
                line={"color": color, "width": 2},
                hovertemplate=hover(html.escape(name), x_axis, metric),
            )
        )
    see_through(
        fig,
        height=360,
        autosize=True,  # the output's full width, not plotly's 700 px
        margin={"l": 55, "r": 20, "t": 36, "b": 40},
        title={"text": metric, "x": 0.01, "font": {"size": 13}},
        # A legend with a single run too: the curve says whose it is.
        showlegend=True,
    )
    fig.update_layout(legend={"orientation": "h", "y": -0.2})
    span = robust_range(curves) if outliers and not log_y else None
    if span is not None:
        fig.update_yaxes(range=span, autorange=False)
    fig.update_xaxes(
        title_text="step" if x_axis == "step" else "seconds", gridcolor="rgba(128,128,128,0.25)"
    )
    fig.update_yaxes(
        title_text=metric, type="log" if log_y else "linear", gridcolor="rgba(128,128,128,0.25)"
    )
    # built whole, then wrapped: a widget keeps its traces in its synced state
    return figure_widget(fig) if widget else fig


def _same_shape(shown, drawn) -> bool:
    """The same traces (by name, kind and fill) on the same axes types."""

    # Only what runs_figure sets: the page fills in plotly.js's defaults of the rest
    # (fill "none", showlegend), which would make every refresh a new figure.
    def shape(fig):
        traces = [(t.name, t.legendgroup, t.fill == "tonexty") for t in fig.data]
        return traces, fig.layout.xaxis.title.text, fig.layout.yaxis.type == "log"

    return shape(shown) == shape(drawn)


class RunsDashboard(w.VBox):
    """``list_runs()`` returns the runs (:class:`rtnb.storage._result.RunSummary`
    rows); ``load_metrics(name)`` a metrics store of that run's record;
    ``open_checkpoints(name)`` a checkpoint browser widget for it (optional)."""

    def __init__(
        self,
        list_runs,
        load_metrics,
        *,
        open_checkpoints=None,
        refresh_s: float = 3.0,
        title: str = "",
    ) -> None:
        self._list_runs = list_runs
        self._load = load_metrics
        self._open_checkpoints = open_checkpoints
        self._stores: dict = {}
        self._loaded_at: dict[str, float] = {}
        self._runs: list = []
        self._rows: list[dict] = []
        self._busy = False
        self._title = f"<b>{html.escape(title)}</b>" if title else ""
        self._refresh_s = refresh_s
        self.title = w.HTML(self._title)
        self.metric = w.Dropdown(
            options=[], description="metric", style=_TIGHT, layout=w.Layout(width="auto")
        )
        # The run written to last first, until a header is clicked.
        self.table = DataTable(sort_by="updated", descending=True, multiple=True)
        self.table.add_class("rtnb-runs-rows")
        self._table_rows: list[Row] = []
        self.x_axis = x_axis_control(style=_TIGHT, layout=w.Layout(width="auto"))
        self.smoothing = ema_control(style=_TIGHT, layout=w.Layout(width="230px"))
        self.log_y = w.Checkbox(
            value=False, description="log y", indent=False, layout=w.Layout(width="auto")
        )
        self.band = w.Checkbox(
            value=False, description="min–max band", indent=False, layout=w.Layout(width="auto")
        )
        self.outliers = w.Checkbox(
            value=True, description="ignore outliers", indent=False, layout=w.Layout(width="auto")
        )
        self.open_button = w.Button(
            description="checkpoints",
            disabled=True,
            tooltip="open the first ticked run's checkpoints",
            layout=w.Layout(width="auto"),  # the run's whole name on it
        )
        self.plot = w.Box(layout=w.Layout(width="100%", display="block"))
        self.detail = w.Box(layout=w.Layout(flex_flow="column", width="100%"))
        self.message = w.HTML()
        self.figure = None
        for control in (
            self.x_axis,
            self.smoothing,
            self.log_y,
            self.band,
            self.outliers,
        ):
            control.observe(lambda _c: self._draw(), names="value")
        self.metric.observe(lambda _c: self._on_metric(), names="value")
        self.table.observe(lambda _c: self._on_pick(), names="selected")
        self.open_button.on_click(lambda _b: self._show_checkpoints())
        super().__init__(
            [
                self.title,
                self.table,
                self.plot,
                # What is drawn and how, under the curves they change.
                w.HBox(
                    [
                        self.metric,
                        self.x_axis,
                        self.smoothing,
                        self.log_y,
                        self.band,
                        self.outliers,
                    ],
                    layout=w.Layout(
                        flex_flow="row wrap", align_items="center", grid_gap="4px 18px"
                    ),
                ),
                self.open_button,
                self.message,
                self.detail,
            ],
            layout=w.Layout(width="100%"),
        )
        follow_theme(self, lambda: [self.figure])
        self.refresh()
        self._closed = threading.Event()
        self._thread = None
        if refresh_s > 0:
            self._thread = threading.Thread(
                target=self._follow, args=(refresh_s,), name="rtnb-runs", daemon=True
            )
            self._thread.start()

    # ---- data --------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the runs again, and the metrics of those that changed (or are live)."""
        runs = list(self._list_runs().runs)
        for run in runs:
            seen = self._loaded_at.get(run.name)
            if seen is None or seen != run.updated or run.state == "live":
                try:
                    self._stores[run.name] = self._load(run.name)
                except Exception as exc:  # noqa: BLE001 - one unreadable run must not hide the rest
                    self.message.value = html.escape(f"run {run.name}: {exc}")
                    continue
                self._loaded_at[run.name] = run.updated
        self._runs = runs
        self._show_freshness()
        names = list(
            dict.fromkeys(
                m
                for run in runs
                if run.name in self._stores
                for m in self._stores[run.name].metric_names()
            )
        )
        current = self.metric.value
        self._busy = True
        try:
            if list(self.metric.options) != names:
                self.metric.options = names
            if names:
                self.metric.value = current if current in names else names[0]
        finally:
            self._busy = False
        self._render_table()

    def _show_freshness(self) -> None:
        """Say, while a run is live, when its curves were last read: a plot that stopped
        moving is then told apart from a run that stopped reporting."""
        live = [run.name for run in self._runs if run.state == "live"]
        if not live or self._refresh_s <= 0:
            self.title.value = self._title
            return
        read_at = time.strftime("%H:%M:%S")
        note = (
            f"live: {html.escape(', '.join(live))}, re-read every {self._refresh_s:g} s, "
            f"last at {read_at}"
        )
        self.title.value = f'{self._title} <span class="rtnb-runs-read">{note}</span>'

    def _follow(self, every_s: float) -> None:
        while not self._closed.wait(every_s):
            if any(run.state == "live" for run in self._runs):
                try:
                    self.refresh()
                except Exception:  # noqa: BLE001 - storage hiccups: the next tick retries
                    pass

    def close(self) -> None:
        if hasattr(self, "_closed"):
            self._closed.set()
        close_tree(self)

    # ---- views -------------------------------------------------------------------------
    def _on_metric(self) -> None:
        if not self._busy:
            self._render_table()

    @property
    def picked(self) -> list[str]:
        """The runs ticked for the plot, in the order they were ticked."""
        return list(self.table.selected)

    def pick(self, *names: str) -> None:
        """Tick these runs (and only these), as clicks on their rows do."""
        self.table.selected = [n for n in names if any(r.id == n for r in self._table_rows)]

    def rows(self) -> list[dict]:
        """The runs' rows (numbers unformatted) in the table's order: by the column
        whose header was clicked last (at first: the run written to last first)."""
        by_name = {r["run"]: r for r in self._rows}
        return [by_name[row.id] for row in self.table.ordered(self._table_rows)]

    def _render_table(self) -> None:
        rows = runs_rows(self._runs, self._stores, self.metric.value)
        self._rows = rows
        metric = self.metric.value
        better_high = bool(metric) and direction_of(metric) == "max"
        # The state is the run's badge, not a column of its own.
        columns = [
            Column(
                key,
                label,
                numeric=key in NUMERIC_RUN_COLUMNS,
                descending_first=better_high
                if key in ("last", "best")
                else key in NUMERIC_RUN_COLUMNS or key == "started",
                badges=key == "run",
            )
            for key, label in run_columns(rows, metric)
            if key != "status"
        ]
        self._table_rows = [
            Row(
                id=r["run"],
                cells=run_cells(r),
                keys={key: r.get(key) for key in (*r, "updated")},
                badges=((r["status"], _STATE_TONES.get(r["status"].split(",")[0], "muted")),),
                tooltip=r["config"],
            )
            for r in rows
        ]
        self._busy = True
        try:
            self.table.show(columns, self._table_rows)
            if not self.table.selected and rows:
                # The run the table lists first is drawn until the user picks.
                self.table.selected = [self.table.ordered(self._table_rows)[0].id]
        finally:
            self._busy = False
        self._update_open()
        self._draw()

    def _on_pick(self) -> None:
        if self._busy:
            return
        self._update_open()
        self._draw()

    def _update_open(self) -> None:
        picked = self.picked
        self.open_button.disabled = self._open_checkpoints is None or not picked
        if picked:
            self.open_button.description = f"checkpoints of {picked[0]}"

    def _draw(self) -> None:
        if self._busy or not self.metric.value:
            return
        drawn = runs_figure(
            self._stores,
            self.picked,
            self.metric.value,
            x_axis=self.x_axis.value,
            weight=self.smoothing.value,
            log_y=self.log_y.value,
            band=self.band.value,
            outliers=self.outliers.value,
        )
        if (
            self.figure is not None
            and _same_shape(self.figure, drawn)
            and not missed_updates(self.figure)
        ):
            # A refresh of the same curves: new points into the figure on the page.
            # Replacing the widget every few seconds made the page's plotly view of
            # the closed one answer into a comm the kernel no longer had ("No such
            # comm" in JupyterLab's log console), and redrew the whole plot.
            with self.figure.batch_update():
                for shown, fresh in zip(self.figure.data, drawn.data):
                    shown.x, shown.y = fresh.x, fresh.y
                self.figure.layout.yaxis.update(drawn.layout.yaxis.to_plotly_json())
                self.figure.layout.title.text = drawn.layout.title.text  # the metric's name
            return
        old, self.figure = self.figure, figure_widget(drawn)
        self.plot.children = (self.figure,)
        if old is not None:
            close_tree(old)

    def _show_checkpoints(self) -> None:
        if self._open_checkpoints is None or not self.picked:
            return
        name = self.picked[0]
        try:
            view = self._open_checkpoints(name)
        except Exception as exc:  # noqa: BLE001 - shown to the user, one line
            self.message.value = f'<span style="color:var(--jp-error-color1, #d32f2f)">{html.escape(str(exc))}</span>'
            return
        for old in self.detail.children:
            close_view(old)
        self.detail.children = (view,)


def runs_bundle(runs, stores: dict, metric: str | None, title: str = "") -> dict:
    """What a saved notebook and a terminal keep of the dashboard: the table as
    text, and (when a metric is known) every run's curve as plotly JSON and SVG."""
    import json

    from rtnb.widgets._svg import figure_svg

    rows = runs_rows(runs, stores, metric)
    head, lines = format_rows(rows, metric)
    text = "\n".join([title, head, *lines] if title else [head, *lines])
    bundle: dict = {"text/plain": text}
    if metric:
        fig = runs_figure(stores, [r["run"] for r in rows], metric)
        if fig.data:
            bundle["application/vnd.plotly.v1+json"] = json.loads(fig.to_json())
            bundle["image/svg+xml"] = figure_svg(fig, title or metric)
    return bundle
