"""``SweepView``: a sweep's trials live, one curve each, with a table to sort and pick.

Every trial's curve of the sweep's metric (what the scheduler saw: the mean over the
ranks per step) is overlaid in one figure, a colour per trial; trials stopped early
end in a cross where they stopped, the best trial is drawn thick. Below, a table of
trials (state, iterations, scores, config) sorted by a click on a column's header,
the best starred; the rows ticked there are the only curves shown. A Resume button carries the picked (or best) trial on in the
notebook's own group, through the callback the magics give (a view never calls Ray).
At the sweep's end the widget gives way to a static figure and the table as text,
which a saved notebook keeps.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable

import ipywidgets as w
from rtnb.widgets._comms import close_tree, close_view
from rtnb.widgets._figure import figure_widget, missed_updates
from rtnb.widgets._late import update_within_a_cell
from rtnb.widgets._plot import RANK_COLORS, see_through
from rtnb.widgets._table import Column, DataTable, Row, Tone
from rtnb.widgets._theme import follow_theme, redraw_when_theme_known

from rtnb.core._text import align_rows

__all__ = ["SweepProgress", "SweepResume", "SweepView", "sweep_bundle", "sweep_table"]

# A trial's state as a badge's colour.
_STATE_TONES: dict[str, Tone] = {
    "running": "busy",
    "terminated": "good",
    "error": "bad",
    "stopped": "muted",
    "pending": "muted",
}
_ERROR_STYLE = "color:var(--jp-error-color1, #d32f2f)"


def _colour(index: int) -> str:
    return RANK_COLORS[index % len(RANK_COLORS)]


def _number(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def _config_text(config: dict) -> str:
    parts = []
    for key, value in config.items():
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        parts.append(f"{key}={shown}")
    return ", ".join(parts)


def sort_trials(trials, key: str, mode: str):
    """Trials in table order: by index, score (best first), iterations (most first)
    or state."""
    if key == "trial":
        return sorted(trials, key=lambda t: t.index)
    if key in ("last", "best"):
        sign = 1 if mode == "min" else -1
        scope = "last" if key == "last" else "all"
        return sorted(
            trials,
            key=lambda t: (
                t.score(mode, scope) is None,
                sign * (t.score(mode, scope) or 0),
                t.index,
            ),
        )
    if key == "iterations":
        return sorted(trials, key=lambda t: (-t.iterations, t.index))
    return sorted(trials, key=lambda t: (str(t.state), t.index))


def sweep_table(sweep, trials=None, key: str = "trial") -> list[str]:
    """The table's lines (a header first), aligned: trial, state, iterations, last and
    best score, the config, and why it stopped."""
    trials = sort_trials(sweep.trials if trials is None else trials, key, sweep.mode)
    best = sweep.best_trial()
    rows = [["trial", "state", "iters", f"last {sweep.metric}", "best", "config", "note"]]
    for t in trials:
        mark = "*" if best is not None and t.index == best.index else " "
        rows.append(
            [
                f"{mark}{t.index}",
                str(t.state),
                str(t.iterations),
                _number(t.score(sweep.mode, "last")),
                _number(t.score(sweep.mode, "all")),
                _config_text(t.config),
                t.note,
            ]
        )
    return align_rows(rows, right={"iters", f"last {sweep.metric}", "best"})


def sweep_figure(sweep, shown: set[int] | None = None, widget: bool = False):
    """Every trial's curve (or those in ``shown``); stopped trials end in a cross, the
    best is thick."""
    import plotly.graph_objects as go

    best = sweep.best_trial()
    fig = go.Figure()
    for t in sweep.trials:
        visible = shown is None or not shown or t.index in shown
        is_best = best is not None and t.index == best.index
        fig.add_scatter(
            x=list(t.steps),
            y=list(t.values),
            mode="lines",
            name=f"{t.index}: {_config_text(t.config)}"[:60],
            line={"color": _colour(t.index), "width": 4 if is_best else 1.5},
            visible=visible,
            hovertemplate=f"trial {t.index}<br>step %{{x}}<br>{sweep.metric} %{{y:.4g}}<extra></extra>",
        )
    stopped = [t for t in sweep.trials if t.stopped_at is not None and t.values]
    stopped = [t for t in stopped if shown is None or not shown or t.index in shown]
    fig.add_scatter(
        x=[t.steps[t.stopped_at - 1] for t in stopped],
        y=[t.values[t.stopped_at - 1] for t in stopped],
        mode="markers",
        name="stopped early",
        marker={"symbol": "x", "size": 11, "color": [_colour(t.index) for t in stopped]},
        hovertemplate="stopped early<extra></extra>",
    )
    see_through(
        fig,
        height=360,
        margin={"l": 50, "r": 10, "t": 30, "b": 40},
        xaxis_title="step",
        yaxis_title=sweep.metric,
        legend={"font": {"size": 10}},
    )
    if not widget:
        # A lasting figure stands alone in a saved notebook; the live view's header
        # already says the sweep's state above its figure.
        fig.update_layout(title={"text": sweep.state_text(), "font": {"size": 12}})
    return figure_widget(fig) if widget else fig


def sweep_bundle(sweep) -> dict:
    """A display bundle that lasts in a saved notebook: the figure as plotly JSON, an
    SVG of it, and the table as text."""
    import json

    from rtnb.widgets._svg import figure_svg

    fig = sweep_figure(sweep)
    return {
        "application/vnd.plotly.v1+json": json.loads(fig.to_json()),
        "image/svg+xml": figure_svg(fig, sweep.state_text()),
        "text/plain": "\n".join(sweep_table(sweep, key="last")),
    }


class SweepView(w.VBox):
    """The live view of a sweep (see the module docstring). ``resume(index)`` is called
    by the Resume button with the picked trial (the best when none is picked) and
    returns a line, or (line, view) to show a view below."""

    def __init__(
        self, sweep, resume: Callable[[int | None], object] | None = None, max_hz: float = 4.0
    ) -> None:
        self.sweep = sweep
        self._resume = resume
        self._period = 1.0 / max_hz
        self._header = w.HTML()
        self._plot_box = w.Box(layout=w.Layout(width="100%", display="block"))
        self.table = DataTable(sort_by="trial", multiple=True)
        self.table.add_class("rtnb-sweep-rows")
        self._button = w.Button(
            description="Resume best",
            disabled=resume is None,
            tooltip="carry the trial on in the notebook's group (its config and checkpoint)",
        )
        self.message = w.HTML()
        self.activity = w.Box(layout=w.Layout(flex_flow="column"))
        super().__init__(
            [
                self._header,
                self._plot_box,
                self.table,
                self._button,
                self.message,
                self.activity,
            ],
            layout=w.Layout(width="100%"),
        )
        self.figure = None
        self._drawn: tuple = ()
        self._shown: set[int] = set()
        self._setting = False
        self._dirty = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._display = None
        self._table_display = None
        self._actions_display = None
        self.resume_panel: SweepResume | None = None
        self._left = False
        self.redraws = 0
        follow_theme(self, lambda: [self.figure], self._lock)
        self.table.observe(self._on_rows, names="selected")
        self._button.on_click(lambda _b: self._act())
        self._unsubscribe = sweep.subscribe(self._on_event)
        self.redraw()
        self._thread = threading.Thread(target=self._loop, name="rtnb-sweep-view", daemon=True)
        self._thread.start()

    # ---- inputs ------------------------------------------------------------------------
    def _on_event(self, event) -> None:
        if str(event.kind) != "done":
            self._dirty.set()
            return
        # In the sweep's thread, before its wait() returns: the lasting output lands
        # in the cell that waits.
        self._stopped.set()
        try:
            self.redraw()
        except Exception:  # noqa: BLE001 - the lasting figure below matters more
            pass
        self._leave_lasting_output()

    def _on_rows(self, change) -> None:
        if self._setting:
            return
        self._shown = {int(index) for index in change["new"]}
        self._button.description = "Resume picked" if len(self._shown) == 1 else "Resume best"
        self._redraw_now()

    def _redraw_now(self) -> None:
        if self._left:
            return
        with self._lock:
            self._redraw_locked()

    def _act(self) -> None:
        if self._resume is None:
            return
        pick = next(iter(self._shown)) if len(self._shown) == 1 else None
        _resume_into(self._resume, pick, self.message, self.activity)

    # ---- drawing -----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._dirty.wait(self._period * 4)
            if self._stopped.is_set():
                break
            self._dirty.clear()
            try:
                self.redraw()
            except Exception as exc:  # noqa: BLE001 - a drawing error must not kill the loop
                # ... nor leave a still figure unexplained: one line under the header.
                self._header.value += f" · drawing failed: {html.escape(repr(exc))}"
            self._stopped.wait(self._period)

    def redraw(self) -> None:
        with self._lock:
            self._redraw_locked()

    def _redraw_locked(self) -> None:
        if self._left:
            return  # closed: its widgets are gone
        sweep = self.sweep
        trials = sweep.trials
        error = (
            f' · <span style="{_ERROR_STYLE}">{html.escape(str(sweep.error))}</span>'
            if sweep.error
            else ""
        )
        self._header.value = f"<b>{html.escape(sweep.state_text())}</b>{error}"
        self._draw_table(trials)
        best = sweep.best_trial()
        shape = (len(trials), best.index if best else None, tuple(t.stopped_at for t in trials))
        if self.figure is None or shape != self._drawn or missed_updates(self.figure):
            # A new trial, a new best or a stop: the figure is made anew, so a reloaded
            # tab restores every trace (traces added to a live figure are not kept).
            old, self.figure = self.figure, sweep_figure(sweep, self._shown, widget=True)
            self._plot_box.children = (self.figure,)
            if old is not None:
                close_view(old)
            self._drawn = shape
        else:
            with self.figure.batch_update():
                for trace, t in zip(self.figure.data, trials):
                    trace.x, trace.y = list(t.steps), list(t.values)
                    trace.visible = not self._shown or t.index in self._shown
        self.redraws += 1

    def _draw_table(self, trials) -> None:
        sweep = self.sweep
        best = sweep.best_trial()
        better_high = sweep.mode == "max"
        columns = [
            Column("trial", "trial", numeric=False, badges=True),
            Column("iterations", "iters", numeric=True, descending_first=True),
            Column("last", f"last {sweep.metric}", numeric=True, descending_first=better_high),
            Column("best", f"best {sweep.metric}", numeric=True, descending_first=better_high),
            Column("config", "config"),
            Column("note", "note"),
        ]
        rows = []
        for t in trials:
            badges: list[tuple[str, Tone]] = []
            if best is not None and t.index == best.index:
                badges.append(("★ best", "best"))
            badges.append((str(t.state), _STATE_TONES.get(str(t.state), "muted")))
            last, top = t.score(sweep.mode, "last"), t.score(sweep.mode, "all")
            rows.append(
                Row(
                    id=str(t.index),
                    cells={
                        "trial": f"trial {t.index}",
                        "iterations": str(t.iterations),
                        "last": _number(last),
                        "best": _number(top),
                        "config": _config_text(t.config),
                        "note": t.note,
                    },
                    keys={
                        "trial": t.index,
                        "iterations": t.iterations,
                        "last": last,
                        "best": top,
                        "config": _config_text(t.config),
                        "note": t.note,
                    },
                    badges=tuple(badges),
                    tooltip=_config_text(t.config),
                )
            )
        self._setting = True
        try:
            self.table.show(columns, rows)
        finally:
            self._setting = False

    # ---- showing and the end ------------------------------------------------------------
    def show(self) -> SweepView:
        """Display the view; at the sweep's end the same place gets a static figure and
        the table below it as text, which a saved notebook keeps, and under them a
        Resume for any trial (while this kernel runs)."""
        from IPython.display import display

        shown = display(self, display_id=True)
        table = display({"text/plain": ""}, raw=True, display_id=True)
        actions = display({"text/plain": ""}, raw=True, display_id=True)
        with self._lock:
            self._display, self._table_display, self._actions_display = shown, table, actions
        if self.sweep.ended_at is not None:
            self._leave_lasting_output()
        return self

    def _leave_lasting_output(self) -> None:
        with self._lock:
            if self._display is None or self._left:
                return
            self._left = True
        bundle = sweep_bundle(self.sweep)
        table = bundle.pop("text/plain")
        updates = [(self._display, {**bundle, "text/plain": self.sweep.state_text()})]
        if self._table_display is not None:
            updates.append((self._table_display, {"text/plain": table}))
        update_within_a_cell(updates)
        display_ = self._display

        def redraw() -> None:
            again = sweep_bundle(self.sweep)
            again.pop("text/plain")
            display_.update({"text/plain": self.sweep.state_text()}, raw=True)
            display_.update({**again, "text/plain": self.sweep.state_text()}, raw=True)

        redraw_when_theme_known(redraw)
        if self._resume is not None and self._actions_display is not None and self.sweep.trials:
            # Resume stays at hand once the sweep is over (what a user wants to do
            # then); the curves above last in the saved notebook, this does not.
            self.resume_panel = SweepResume(self.sweep, self._resume, self.activity.children)
            self._actions_display.update(self.resume_panel)
            self.activity.children = ()
        self.close()

    def close(self) -> None:
        self._stopped.set()
        self._unsubscribe()
        with self._lock:  # not while the redraw thread draws
            self._left = True
            close_tree(self)


class SweepResume(w.VBox):
    """After a sweep: pick a trial (the best first) and carry it on in the notebook's
    group; ``resume(index)`` as for :class:`SweepView`."""

    def __init__(self, sweep, resume: Callable[[int | None], object], activity=()) -> None:
        self.sweep = sweep
        self._resume = resume
        order = sort_trials(sweep.trials, "last", sweep.mode)
        self.pick = w.Dropdown(
            options=[
                (
                    f"trial {t.index}: {_config_text(t.config)} · {sweep.metric} "
                    f"{_number(t.score(sweep.mode))} · {t.state}",
                    t.index,
                )
                for t in order
            ],
            description="trial",
            layout=w.Layout(width="auto", min_width="420px"),
        )
        self.button = w.Button(
            description="Resume",
            tooltip="carry the trial on in the notebook's group (its config and checkpoint)",
        )
        self.message = w.HTML()
        self.activity = w.Box(list(activity), layout=w.Layout(flex_flow="column"))
        self.button.on_click(lambda _b: self._act())
        super().__init__(
            [w.HBox([self.pick, self.button]), self.message, self.activity],
            layout=w.Layout(width="100%"),
        )
        self.add_class("rtnb-sweep-resume")

    def _act(self) -> None:
        _resume_into(self._resume, self.pick.value, self.message, self.activity)


def _resume_into(resume, pick: int | None, message, activity) -> None:
    """Run a Resume: its line in ``message``, its live view (if any) in ``activity``."""
    try:
        outcome = resume(pick)
        if isinstance(outcome, tuple):
            outcome, view = outcome
            for old in activity.children:
                close_view(old)
            activity.children = (view,)
        message.value = html.escape(str(outcome or ""))
    except Exception as exc:  # noqa: BLE001 - shown to the user, one line
        message.value = (
            f'<span style="{_ERROR_STYLE}">{html.escape(f"Resume failed: {exc}")}</span>'
        )


class SweepProgress:
    """A sweep in a notebook with no live frontend (papermill, ``rtnb run``): a line as
    each trial ends, then the figure and the table."""

    def __init__(self, sweep, out=print) -> None:
        self.sweep = sweep
        self._out = out
        self._lock = threading.Lock()
        self._unsubscribe = sweep.subscribe(self._on_event)

    def _on_event(self, event) -> None:
        kind = str(event.kind)
        if kind == "done":
            self.finish()
        elif kind == "ended" and event.trial is not None:
            trial = self.sweep.trials[event.trial]
            score = trial.score(self.sweep.mode)
            with self._lock:
                self._out(
                    f"rtnb: trial {trial.index} ({_config_text(trial.config)}) {trial.state} after "
                    f"{trial.iterations} iterations, {self.sweep.metric} {_number(score)}"
                    + (f": {trial.note}" if trial.note else "")
                )

    def finish(self) -> None:
        """The figure and the table, once the sweep ended (before its wait() returns)."""
        from IPython.display import display

        self._unsubscribe()
        if self.sweep.trials:
            bundle = sweep_bundle(self.sweep)
            table = bundle.pop("text/plain")
            display({**bundle, "text/plain": self.sweep.state_text()}, raw=True)
            print(table)
