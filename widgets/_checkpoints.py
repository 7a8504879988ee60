"""``CheckpointBrowser``: a run's checkpoints on a timeline and in a sortable table,
with Resume, Load and Delete for the one selected."""

from __future__ import annotations

import html
import time

import ipywidgets as w
from rtnb.widgets._comms import close_tree, close_view
from rtnb.widgets._figure import figure_widget, missed_updates
from rtnb.widgets._plot import see_through
from rtnb.widgets._table import Column, DataTable, Row
from rtnb.widgets._theme import follow_theme

from rtnb.core._score import NO_BEST, direction_of, score_rule

__all__ = ["CheckpointBrowser"]

# Marker colours of the timeline (and the words the status column uses for them).
_COLORS = {
    "committed": "#1f77b4",
    "best": "#b8860b",
    "latest": "#2ca02c",
    "selected": "#d62728",
    "writing": "#8c8c8c",
}


class CheckpointBrowser(w.VBox):
    """A run's checkpoints: a timeline (the score metric over steps, each
    checkpoint a marker: committed, best by the score, latest, selected, being
    written; one line of markers per branch) above a table (the checkpoint by its
    step with its badges, age, metrics, size, ranks), grouped by the line of
    training that wrote them, sorted by a click on a column's header. Clicking a
    marker or a row selects it; Resume, Load and Delete act on the selection and
    are disabled without one. Delete asks twice and is never offered for the
    latest checkpoint.

    ``list_checkpoints()`` returns :class:`rtnb.CheckpointInfo` rows; ``latest()``
    the id a recovery would restart from (default: the one committed last);
    ``score``/``mode`` pick the best (without ``score``, only a metric named like a
    loss or an accuracy makes one, and the browser says which rule it used: see
    :mod:`rtnb.core._score`); ``resume(id)``, ``load(id)``, ``delete(id)``
    are the actions, each returning a message or a ``(message, widget)`` pair whose
    widget (e.g. the resumed cell's live view) is shown under the buttons. It
    refreshes when ``subscribe`` reports a commit.
    """

    def __init__(
        self,
        list_checkpoints,
        *,
        resume=None,
        load=None,
        delete=None,
        subscribe=None,
        latest=None,
        score: str | None = None,
        mode: str = "min",
        title: str = "",
    ) -> None:
        self._list = list_checkpoints
        self._latest_of = latest
        self._score, self._mode = score, mode
        self._actions = {"Resume": resume, "Load": load, "Delete": delete}
        self._title = w.HTML(f"<b>{html.escape(title)}</b>" if title else "")
        self._metric = w.Dropdown(
            options=[("step", None)],
            value=None,
            description="timeline",
            layout=w.Layout(width="220px"),
        )
        self.rule_line = w.HTML()
        # Newest first until a header is clicked.
        self.table = DataTable(sort_by="step", descending=True)
        self.table.add_class("rtnb-ckpt-rows")
        self._table_rows: list[Row] = []
        self._buttons = {name: w.Button(description=name, disabled=True) for name in self._actions}
        # Delete asks twice: the first click names what would go and arms the button.
        self._armed: str | None = None
        self._refreshing = False
        self._latest: str | None = None
        self._best: str | None = None
        self._shown: list = []
        self.timeline = _timeline_figure()
        # The timeline in a box of its own, replaced there: a new child at the
        # browser's own level would make the page draw every later child anew (the
        # buttons, the activity's live view), and the replaced views of a live figure
        # would go on taking its updates, undrawn ("Error setting state" at each).
        self._timeline_box = w.Box([self.timeline], layout=w.Layout(flex_flow="column"))
        self.table.observe(self._on_row, names="selected")
        self.message = w.HTML()
        self.activity = w.Box(layout=w.Layout(flex_flow="column"))
        for name, button in self._buttons.items():
            button.on_click(lambda _b, name=name: self._act(name))
        self._metric.observe(lambda _c: None if self._refreshing else self.refresh(), names="value")
        super().__init__(
            [
                self._title,
                self._timeline_box,
                w.HBox([self._metric, self.rule_line], layout=w.Layout(align_items="center")),
                self.table,
                w.HBox(list(self._buttons.values())),
                self.message,
                self.activity,
            ],
            layout=w.Layout(width="100%"),
        )
        follow_theme(self, lambda: [self.timeline])
        if subscribe is not None:
            subscribe(lambda _info: self.refresh())
        self.refresh()

    # ---- selection ---------------------------------------------------------------------
    @property
    def selected(self) -> str | None:
        return self.table.selected[0] if self.table.selected else None

    def select(self, cid: str | None) -> None:
        """Select checkpoint ``cid`` (what a click on its marker or row does); an
        incomplete checkpoint cannot be acted on, so it is not selected."""
        if cid is None:
            self.table.selected = []
        elif any(row.id == cid and row.selectable for row in self._table_rows):
            self.table.selected = [cid]

    def _on_row(self, _change) -> None:
        if not self._refreshing:
            self._update_buttons()
            self._draw_timeline()

    def _on_marker(self, trace, points, _state) -> None:
        if points.point_inds:
            self.select(trace.customdata[points.point_inds[0]][0])

    def _update_buttons(self) -> None:
        chosen = self.selected
        if chosen != self._armed:
            self._armed = None
            self._buttons["Delete"].description = "Delete"
            self._buttons["Delete"].button_style = ""
        for name, button in self._buttons.items():
            # Nothing selected, nothing to do; the latest checkpoint is what a
            # recovery restarts from, so it is never offered for deletion.
            button.disabled = (
                self._actions[name] is None
                or chosen is None
                or (name == "Delete" and chosen == self._latest)
            )
        if self._buttons["Delete"].disabled and self._actions["Delete"] is not None and chosen:
            self._buttons["Delete"].tooltip = "the latest checkpoint is kept"
        else:
            self._buttons["Delete"].tooltip = ""

    # ---- content -----------------------------------------------------------------------
    def rows(self):
        """The checkpoints in the table's order: grouped by line (the first line,
        then each branch), sorted inside a group by the column whose header was
        clicked last (at first: newest step first)."""
        by_id = {c.id: c for c in self._shown}
        return [by_id[row.id] for row in self.table.ordered(self._table_rows)]

    def refresh(self) -> None:
        # Lines in order (the first, then each branch); inside one, by step.
        rows = sorted(self._list(), key=lambda c: (_line_of(c), c.step))
        metrics = list(dict.fromkeys(k for c in rows for k in c.all_metrics))
        committed = [c for c in rows if c.status == "committed"]
        self._latest = self._latest_of() if self._latest_of is not None else None
        if self._latest is None and committed:
            self._latest = max(committed, key=lambda c: (c.time, c.step)).id
        rule = score_rule(self._score, self._mode, metrics)
        best = rule.best(committed, lambda c: c.all_metrics) if rule is not None else None
        self._best = best.id if best is not None else None
        self.rule_line.value = (
            f'<span style="font-size:12px">{html.escape(rule.describe() if rule else NO_BEST)}'
            "</span>"
        )
        # The timeline starts on the metric that decides "best", else the first reported.
        first_plotted = rule.metric if rule is not None and rule.metric in metrics else None
        self._refreshing = True
        try:
            plot_options = [(m, m) for m in metrics] or [("step", None)]
            if list(self._metric.options) != plot_options:
                current = self._metric.value
                self._metric.options = plot_options
                values = [v for _l, v in plot_options]
                self._metric.value = current if current in values else (first_plotted or values[0])
            self._shown = rows
            self._render_rows(rows, metrics)
        finally:
            self._refreshing = False
        self._update_buttons()
        self._draw_timeline()

    def _badges(self, c) -> tuple:
        badges = []
        if c.id == self._best:
            badges.append(("★ best", "best"))
        if c.id == self._latest:
            badges.append(("latest", "latest"))
        if c.status != "committed":
            badges.append((c.shown_status, "busy" if c.status == "writing" else "muted"))
        elif c.shown_status != "committed":  # how its validation stands
            badges.append((c.shown_status.removeprefix("committed, "), "muted"))
        return tuple(badges)

    def _render_rows(self, rows, metrics: list[str]) -> None:
        now = time.time()
        # A checkpoint is named by its step (what `%rtnb resume STEP` takes); its line
        # tells two of one step apart. The zero-padded folder name is its tooltip.
        columns = [
            Column("step", "checkpoint", numeric=False, descending_first=True, badges=True),
            Column("age", "age", numeric=True),
            *[
                Column(m, m, numeric=True, descending_first=direction_of(m) == "max")
                for m in metrics
            ],
            Column("size", "size", numeric=True, descending_first=True),
            Column("ranks", "ranks"),
        ]
        self._table_rows = [
            Row(
                id=c.id,
                cells={
                    "step": f"step {c.step}",
                    "age": _age(now - c.time) if c.time else "-",
                    **{m: _number(c.all_metrics.get(m)) for m in metrics},
                    "size": _size(c.size) if c.files else "-",
                    "ranks": _ranks(c.ranks),
                },
                keys={
                    "step": c.step,
                    "age": now - c.time if c.time else None,
                    **{m: _sortable(c.all_metrics.get(m)) for m in metrics},
                    "size": c.size if c.files else None,
                    "ranks": len(c.ranks),
                },
                badges=self._badges(c),
                # An incomplete checkpoint is listed but cannot be acted on.
                selectable=c.status == "committed",
                group=_line_name(c),
                tooltip=f"{c.id} in {_line_name(c)}",
            )
            for c in rows
        ]
        self.table.show(columns, self._table_rows)

    def _draw_timeline(self) -> None:
        import plotly.graph_objects as go

        metric = self._metric.value
        committed = [c for c in self._shown if c.status == "committed"]
        writing = [c for c in self._shown if c.status == "writing"]
        selected = self.selected
        traces = []
        for line_no in sorted({_line_of(c) for c in committed}):
            points = sorted((c for c in committed if _line_of(c) == line_no), key=lambda c: c.step)
            colors = [
                _COLORS["selected"]
                if c.id == selected
                else _COLORS["latest"]
                if c.id == self._latest
                else _COLORS["best"]
                if c.id == self._best
                else _COLORS["committed"]
                for c in points
            ]
            traces.append(
                go.Scatter(
                    x=[c.step for c in points],
                    y=[_y(c, metric) for c in points],
                    mode="lines+markers",
                    name=_line_name(points[0]),
                    line={"width": 1, "dash": "dot" if line_no else "solid", "color": "#888"},
                    marker={
                        "size": [
                            14 if c.id in (selected, self._latest, self._best) else 9
                            for c in points
                        ],
                        "color": colors,
                        "symbol": ["star" if c.id == self._best else "circle" for c in points],
                        "line": {"width": 1, "color": "#333"},
                    },
                    customdata=[[c.id, _size(c.size), _age(time.time() - c.time)] for c in points],
                    hovertemplate=(
                        "%{customdata[0]}<br>step %{x}<br>"
                        + (html.escape(metric) + " %{y:.5g}<br>" if metric else "")
                        + "%{customdata[1]} · %{customdata[2]} ago<extra></extra>"
                    ),
                )
            )
        if writing:
            traces.append(
                go.Scatter(
                    x=[c.step for c in writing],
                    y=[_y(c, metric) for c in writing],
                    mode="markers",
                    name="being written",
                    marker={
                        "size": 9,
                        "color": "rgba(0,0,0,0)",
                        "line": {"width": 2, "color": _COLORS["writing"]},
                    },
                    customdata=[[c.id, "-", "-"] for c in writing],
                    hovertemplate="%{customdata[0]} (being written)<extra></extra>",
                )
            )
        current = self.timeline
        if (
            [t.name for t in current.data] == [t.name for t in traces]
            and current.data
            and not missed_updates(current)
        ):
            # Same traces: update them in place (a new FigureWidget sends plotly.js along).
            with current.batch_update():
                for old_trace, trace in zip(current.data, traces):
                    old_trace.update(trace.to_plotly_json())
                current.layout.yaxis.title.text = metric or ""
            return
        # New traces: a new widget, built whole, so that its synced state holds every
        # trace and a reloaded tab shows the timeline as it is (see widgets/_plot.py).
        shape = go.Figure(layout=self.timeline.layout)
        for trace in traces:
            shape.add_trace(trace)
        shape.layout.yaxis.title.text = metric or ""
        figure = figure_widget(shape)
        for trace in figure.data:
            trace.on_click(self._on_marker)
        old, self.timeline = self.timeline, figure
        self._timeline_box.children = (figure,)
        close_tree(old)

    # ---- actions -----------------------------------------------------------------------
    def _act(self, name: str) -> None:
        action, cid = self._actions[name], self.selected
        if action is None or not cid:
            return
        if name == "Delete" and self._armed != cid:
            self._armed = cid
            self._buttons["Delete"].description = "Confirm delete"
            self._buttons["Delete"].button_style = "danger"
            self.message.value = html.escape(
                f"Delete {cid} and its files? Click 'Confirm delete' to delete it."
            )
            return
        self._armed = None
        try:
            outcome = action(cid)
            if isinstance(outcome, tuple):
                outcome, view = outcome
                for old in self.activity.children:
                    close_view(old)
                self.activity.children = (view,)
            self.message.value = html.escape(
                f"{name}: {cid}" + (f" — {outcome}" if isinstance(outcome, str) else "")
            )
        except Exception as exc:  # noqa: BLE001 - shown to the user, one line
            self.message.value = f'<span style="color:var(--jp-error-color1, #d32f2f)">{html.escape(f"{name} {cid} failed: {exc}")}</span>'
        self.refresh()


def _timeline_figure():
    import plotly.graph_objects as go

    # Laid out before it becomes a widget: its opening state holds the whole look.
    shape = go.Figure()
    see_through(shape, height=220, margin={"l": 50, "r": 20, "t": 10, "b": 35})
    shape.update_layout(legend={"orientation": "h", "y": -0.25}, clickmode="event")
    shape.update_xaxes(title_text="step", gridcolor="rgba(128,128,128,0.25)")
    shape.update_yaxes(gridcolor="rgba(128,128,128,0.25)")
    return figure_widget(shape)


def _line_of(c) -> int:
    return getattr(c, "line", 0)


def _line_name(c) -> str:
    return "main" if not _line_of(c) else f"branch {_line_of(c)}"


def _y(c, metric: str | None):
    value = c.all_metrics.get(metric) if metric else None
    return value if isinstance(value, (int, float)) else (c.step if metric is None else None)


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else ""


def _sortable(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value == value else None


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 3 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
