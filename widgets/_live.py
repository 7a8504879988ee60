"""``LiveMetrics``: the live per-rank plot, header and log panel of a running cell."""

from __future__ import annotations

import html
import re
import threading
import time
from collections import deque

import ipywidgets as w
from rtnb.widgets._chips import RankChips
from rtnb.widgets._comms import close_tree
from rtnb.widgets._figure import missed_updates
from rtnb.widgets._header import format_header
from rtnb.widgets._late import update_within_a_cell
from rtnb.widgets._plot import (
    BAND_FROM_RANKS,
    RANK_COLORS,
    build_figure,
    ema_control,
    robust_range,
    series_xy,
    trace_keys,
    x_axis_control,
)
from rtnb.widgets._subshell import answer_while_busy
from rtnb.widgets._theme import follow_theme

__all__ = ["LiveMetrics", "LiveOnFirstReport"]

_MAX_LOG_LINES = 2000
_SHOWN_LOG_LINES = 200
_MAX_LINE_CHARS = 2000
# The plot is redrawn at least this often while reports arrive, whatever a redraw
# costs: what a user reads off it must be about the step the header shows.
_MAX_LAG_S = 1.0


def _log_line(rank: int, line: str) -> str:
    """A rank's line tagged with it; rtnb's own notes (rank -1) as they are."""
    return f"[rank {rank}] {line}" if rank >= 0 else line


def _changes_bundle(record: dict | None, text: str) -> dict:
    """The cell's printed lines, with its live changes (if any) under their MIME
    type: what ``rtnb run`` of the saved notebook makes again at the same steps."""
    from rtnb.core._changes import CHANGES_MIME, CellChanges

    if record is None:
        return {"text/plain": text}
    said = f"rtnb: live changes in this cell: {CellChanges.from_json(record).describe()}"
    return {"text/plain": "\n".join(filter(None, [text, said])), CHANGES_MIME: record}


class LiveMetrics(w.VBox):
    """One subplot per metric, one trace per rank plus the mean; redrawn at most
    ``max_hz`` times a second from a bounded snapshot of ``store``.

    ``handle`` (an :class:`rtnb.CellHandle`, optional) supplies state and output.
    The widget never calls Ray: it only reads the store and subscribes to callbacks.
    """

    def __init__(
        self,
        store,
        handle=None,
        *,
        max_hz: float = 10.0,
        max_points: int = 1000,
        label: str | None = None,
        replay_output: bool = True,
        stacks=None,
        set_controls=None,
    ) -> None:
        """``stacks``: a callable giving every rank's stack (``Session.stacks``) for
        the view's Stacks button; ``set_controls``: ``Session.set_controls``, for an
        input per live control the cell declared (``rtnb.control``) and a Set
        button. Their messages go to a subshell of the kernel (ipykernel 7), so they
        act while a foreground cell keeps the kernel busy; where the kernel has no
        subshells they are offered for a background cell only."""
        self.store = store
        self.handle = handle
        # The cell's name in the header: Jupyter's "[5]", as its handle knows it.
        self.label = label or getattr(handle, "label", None)
        self.max_points = max_points
        self._period = 1.0 / max_hz
        self._header = w.HTML(value="starting…")
        # Every rank's stack: the hang doctor's (a quiet cell) or the Stacks button's.
        self._stacks_view = w.HTML(value="", layout=w.Layout(max_height="320px", overflow="auto"))
        self._shown_hang = None
        self._read_stacks = stacks
        self._stacks_button = w.Button(
            description="Stacks",
            tooltip="where every rank's cell is now (%rtnb stacks)",
            layout=w.Layout(width="80px"),
        )
        self._stacks_button.on_click(self._on_stacks)
        # One input per control the ranks declared, and Set.
        self._set_controls = set_controls
        self._control_inputs: dict[str, w.Text] = {}
        self._set_button = w.Button(description="Set", layout=w.Layout(width="60px"))
        self._set_button.on_click(self._on_set)
        # Clicks heard while the kernel is busy (a subshell), else only when it is free.
        busy_ok = answer_while_busy(self._stacks_button, self._set_button)
        if not busy_ok and not getattr(handle, "background", False):
            self._read_stacks = self._set_controls = None
        if self._read_stacks is None:
            self._stacks_button.layout.display = "none"
        self._set_said = w.HTML(value="")
        self._controls_box = w.HBox([], layout=w.Layout(flex_flow="row wrap"))
        self._controls_box.add_class("rtnb-controls")
        self._x_axis = x_axis_control(layout=w.Layout(width="160px"))
        self._smoothing = ema_control(layout=w.Layout(width="240px"))
        self._log_y = w.Checkbox(
            value=False, description="log y", indent=False, layout=w.Layout(width="80px")
        )
        self._ranks = RankChips()
        self._outliers = w.Checkbox(
            value=True,
            description="ignore outliers",
            indent=False,
            layout=w.Layout(width="130px"),
        )
        self._controls = w.HBox(
            [
                self._x_axis,
                self._smoothing,
                self._log_y,
                self._outliers,
                self._ranks,
                self._stacks_button,
            ],
            layout=w.Layout(flex_flow="row wrap"),
        )
        # The full output width (plotly's autosize follows the box as it resizes).
        self._plot_box = w.Box(layout=w.Layout(width="100%", display="block"))
        self._log_filter = w.Dropdown(
            options=[("all ranks", -1)], value=-1, description="log", layout=w.Layout(width="180px")
        )
        self._log_view = w.HTML(layout=w.Layout(max_height="240px", overflow="auto"))
        self._logs: deque[tuple[int, str]] = deque(maxlen=_MAX_LOG_LINES)
        self._log_partial: dict[int, str] = {}
        super().__init__(
            [
                self._header,
                self._stacks_view,
                self._controls_box,
                self._controls,
                self._plot_box,
                w.HBox([self._log_filter]),
                self._log_view,
            ],
            layout=w.Layout(width="100%"),
        )
        self.figure = None
        # Where the view was shown with show(): at the cell's end it is replaced there
        # by output that lasts in the saved notebook (see _leave_lasting_output).
        self._display = None
        self._logs_display = None
        self._reports_at_start = store.count()
        self._leave_lock = threading.Lock()
        self._left = False
        self._keys: list = []
        self._y_type = "linear"
        self._drawn_generation = -1
        self._trace_axes: list[str] = []  # the figure's y axes, in trace order
        self._y_ranges_set: dict[str, list[float] | None] = {}  # None: autorange
        self._markers_drawn = 0
        # Ranks the user took off the plot (few ranks), or picked to add to the band
        # (many): kept here, not read back from the list, whose options change under
        # it and whose frontend may echo a selection back late.
        self._hidden: set[int] = set()
        self._picked: set[int] = set()
        self._setting_ranks = False
        self._dirty_controls = True
        self._logs_dirty = False
        self.redraws = 0
        self.builds = 0  # figures built (the first draw, a new metric or rank count)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._closed = False
        follow_theme(self, lambda: [self.figure], self._lock)
        for control in (self._x_axis, self._smoothing, self._log_y, self._outliers):
            control.observe(self._on_control, names="value")
        self._ranks.observe(self._on_ranks, names="value")
        self._log_filter.observe(self._on_log_filter, names="value")
        if handle is not None:
            handle.add_sink(self._on_output, replay=replay_output)
            handle.add_done_callback(lambda _h: self._finish())
        self._thread = threading.Thread(target=self._loop, name="rtnb-live-metrics", daemon=True)
        self._thread.start()

    # ---- inputs ------------------------------------------------------------------------
    def _on_control(self, _change) -> None:
        self._dirty_controls = True
        self._redraw_after_end()

    def _on_ranks(self, change) -> None:
        if self._setting_ranks:
            return  # the view renewed the list itself
        chosen, shown = set(change["new"]), set(self._ranks.options)
        if len(shown) >= BAND_FROM_RANKS:
            self._picked = chosen
        else:
            self._hidden = shown - chosen
        self._on_control(change)

    def _redraw_after_end(self) -> None:
        # The cell has ended and the redraw thread with it; a user who now ticks
        # log-y or moves the EMA slider still expects the plot to follow. A redraw
        # itself sets controls (the ranks list), which lands here in the same thread
        # while the lock is held: then there is nothing to do, that redraw goes on.
        if not self._stopped.is_set() or self._closed:
            return
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._redraw_locked()
        except Exception:  # noqa: BLE001 - a drawing error must not reach the user
            pass
        finally:
            self._lock.release()

    def _on_stacks(self, _button) -> None:
        if self._read_stacks is None or self._stopped.is_set():
            return
        try:
            self._stacks_view.value = self._read_stacks().html()
        except Exception as exc:  # noqa: BLE001 - one line in the view, never a traceback
            self._stacks_view.value = f"<i>stacks unavailable: {html.escape(str(exc))}</i>"

    def _on_set(self, _button) -> None:
        if self._set_controls is None or self._stopped.is_set():
            return
        from rtnb.core._changes import control_value

        values = {name: control_value(box.value) for name, box in self._control_inputs.items()}
        try:
            step = self._set_controls(values)
            shown = ", ".join(f"{n} = {v!r}" for n, v in values.items())
            where = f"from step {step}" if step is not None else "from the next cell"
            self._set_said.value = html.escape(f"{shown} {where}")
        except Exception as exc:  # noqa: BLE001 - one line in the view, never a traceback
            self._set_said.value = f"<i>{html.escape(str(exc))}</i>"

    def _show_control_inputs(self) -> None:
        controls = getattr(self.handle, "controls", None)
        declared = controls.declared if controls is not None else None
        if self._set_controls is None or not declared or set(declared) == set(self._control_inputs):
            return
        for name, default in declared.items():
            if name not in self._control_inputs:
                box = w.Text(value=repr(default), description=name, layout=w.Layout(width="220px"))
                answer_while_busy(box)  # its value reaches the kernel before Set's click
                self._control_inputs[name] = box
        self._controls_box.children = (
            *self._control_inputs.values(),
            self._set_button,
            self._set_said,
        )

    def _mark_logs(self) -> None:
        self._logs_dirty = True

    def _on_log_filter(self, _change) -> None:
        self._mark_logs()
        self._redraw_after_end()

    def _on_output(self, rank: int, stream: str, text: str) -> None:
        text = self._log_partial.pop(rank, "") + text
        lines = text.split("\n")
        self._log_partial[rank] = lines.pop()
        for line in lines:
            # at most _MAX_LOG_LINES lines of at most _MAX_LINE_CHARS each
            self._logs.append((rank, line[:_MAX_LINE_CHARS]))
        self._logs_dirty = True

    # ---- drawing -----------------------------------------------------------------------
    def _loop(self) -> None:
        next_plot = 0.0
        while not self._stopped.is_set():
            started = time.monotonic()
            try:
                if started >= next_plot:
                    built = self.builds
                    self.redraw()
                    cost = time.monotonic() - started
                    # The plot at most max_hz, taking ~10% of the kernel's CPU however
                    # many traces and points there are (a redraw of a big figure can
                    # cost tens of milliseconds in plotly), but never more than
                    # _MAX_LAG_S behind the header. Building the figure (its first draw,
                    # a new metric) is a one-off, not what the next redraws cost.
                    wait = self._period if self.builds != built else max(self._period, 10 * cost)
                    next_plot = started + min(wait, _MAX_LAG_S)
                else:
                    # ... while the header (state, step, restarts) follows at max_hz.
                    with self._lock:
                        self._draw_header()
            except Exception:  # noqa: BLE001 - a drawing error must not kill the loop
                pass
            self._stopped.wait(self._period)

    def show(self) -> LiveMetrics:
        """Display the view; when its cell ends, the same place gets a static figure
        (and the cell's output as text), so the saved notebook keeps the curves."""
        from IPython.display import display

        shown = display(self, display_id=True)
        # An empty output below the view, for the cell's printed lines at its end.
        logs = display({"text/plain": ""}, raw=True, display_id=True)
        # Both at once: a cell that ends while the view is being shown (a short
        # background cell) must find both displays or neither, never the view alone
        # (its lasting figure then failed half-way and the widget stayed).
        with self._leave_lock:
            self._display, self._logs_display = shown, logs
        if self._stopped.is_set():  # the cell ended before the view was shown
            self._leave_lasting_output()
        return self

    def _finish(self) -> None:
        for rank, rest in list(self._log_partial.items()):
            if rest:
                self._logs.append((rank, rest))
        self._log_partial.clear()
        self._logs_dirty = True
        self._stopped.set()
        try:
            self.redraw()
        except Exception:  # noqa: BLE001 - the lasting figure below matters more
            pass
        try:
            self._leave_lasting_output()
        except Exception as exc:  # noqa: BLE001 - the live view stays: worse, but not lost
            self._header.value += f" (the lasting figure failed: {html.escape(str(exc))})"

    def _leave_lasting_output(self) -> None:
        """Replace the widget (whose state a saved notebook does not keep: reopened, it
        reads "model not found") by a static figure with its own buttons for log y,
        outliers and smoothing, plus the cell's output as text; a cell that reported
        nothing leaves only its text."""
        from rtnb.widgets._static import redraw_for_the_page_theme, static_figure_bundle

        with self._leave_lock:
            if self._display is None or self._closed or self._left:
                return
            self._left = True
        header = html.unescape(re.sub(r"<[^>]+>", "", self._header.value))
        logs = "\n".join(_log_line(r, line) for r, line in self._logs)
        if len(self._logs) == self._logs.maxlen:
            logs = f"(the last {len(self._logs)} lines; every line is in the run's logs/)\n" + logs
        bundle = None
        reported = getattr(self.handle, "reported", None)
        if reported is None:  # no cell: whatever arrived while the view was up
            reported = self.store.count() > self._reports_at_start
        if reported:
            bundle = static_figure_bundle(self.store, title=header, max_points=self.max_points)
        # The cell's live changes, kept in the saved notebook for `rtnb run`.
        controls = getattr(self.handle, "controls", None)  # a cell of this kernel's
        record = controls.record() if controls is not None else None
        updates = []
        if bundle is None:
            updates.append((self._display, {"text/plain": "\n".join(filter(None, [header, logs]))}))
            if record is not None and self._logs_display is not None:
                updates.append((self._logs_display, _changes_bundle(record, "")))
        else:
            updates.append((self._display, bundle))
            if (logs or record is not None) and self._logs_display is not None:
                updates.append((self._logs_display, _changes_bundle(record, logs)))
        update_within_a_cell(updates)
        if bundle is not None:
            redraw_for_the_page_theme(self._display, self.store, header, self.max_points)
        self.close()

    def close(self) -> None:
        self._closed = True
        self._stopped.set()
        # Every widget of the tree: a box left open that lists a closed child makes a
        # reloaded page wait for that child forever, and with it every widget of the
        # notebook ("Loading widget..."), the live ones included.
        close_tree(self)

    def _state(self) -> str:
        h = self.handle
        if h is None:
            return "live"
        if not h.done():
            return "restarting" if getattr(h, "recovering", False) else "running"
        return "done" if h.error is None else f"{type(h.error).__name__}"

    def redraw(self) -> None:
        with self._lock:
            self._redraw_locked()

    def _draw_header(self) -> None:
        progress = self.store.progress()
        handle = self.handle
        states = getattr(handle, "states", None)
        self._header.value = format_header(
            progress,
            self._state(),
            getattr(handle, "cell_id", None),
            getattr(handle, "recoveries", 0),
            getattr(handle, "restarted_from", None),
            label=self.label,
            resumed_from=getattr(handle, "resumed_from", None),
            running_ranks=({r for r, s in states.items() if s == "running"} if states else None),
            resources=self.store.system_latest(),
            climbing=self.store.memory_climbing(),
        )
        self._show_control_inputs()
        hang = getattr(handle, "hang", None)
        if hang is not self._shown_hang:
            # The hang doctor's stacks while the cell is quiet; gone once it moves on.
            self._shown_hang = hang
            self._stacks_view.value = hang.html() if hang is not None else ""

    def _redraw_locked(self) -> None:
        store = self.store
        self._draw_header()
        if self._logs_dirty:
            self._logs_dirty = False
            self._render_logs()
        # Every rank of the running cell from the first draw, reported yet or not.
        expected = list(getattr(self.handle, "ranks", None) or ())
        ranks = sorted(set(store.ranks()) | set(expected))
        banded = len(ranks) >= BAND_FROM_RANKS
        # Few ranks: every rank is drawn but those the user took off. Many: the band
        # view picks outliers itself and the list adds the ranks the user picked.
        drawn = sorted(self._picked) if banded else [r for r in ranks if r not in self._hidden]
        if list(self._ranks.options) != ranks or tuple(self._ranks.value) != tuple(drawn):
            self._setting_ranks = True
            try:
                if list(self._ranks.options) != ranks:
                    # The chips' colours are the traces' (a legend to click).
                    self._ranks.colors = [RANK_COLORS[r % len(RANK_COLORS)] for r in ranks]
                    self._ranks.options = ranks
                    self._log_filter.options = [("all ranks", -1)] + [
                        (f"rank {r}", r) for r in ranks
                    ]
                self._ranks.value = list(drawn)
            finally:
                self._setting_ranks = False
        if store.generation == self._drawn_generation and not self._dirty_controls:
            return
        self._drawn_generation = store.generation
        self._dirty_controls = False
        keys = trace_keys(store, drawn, expected)
        if not keys:
            return
        markers = len(store.markers)
        if (
            keys != self._keys
            or self.figure is None
            or markers != self._markers_drawn
            or missed_updates(self.figure)
        ):
            # A control change's line is drawn by a new figure (few: by hand).
            self._markers_drawn = markers
            self._keys = keys
            self._y_type = "log" if self._log_y.value else "linear"
            self.figure = build_figure(
                store,
                keys,
                widget=True,
                x_axis=self._x_axis.value,
                weight=self._smoothing.value,
                log_y=self._log_y.value,
                max_points=self.max_points,
                on_missed=lambda: self._on_control(None),  # drawn anew at the next redraw
            )
            old, self._plot_box.children = self._plot_box.children, (self.figure,)
            for figure in old:
                close_tree(figure)
            self.builds += 1
            # Read once a figure: through plotly, the traces and layout cost more
            # than the rest of a redraw.
            self._trace_axes = [t.yaxis or "y" for t in self.figure.data]
            self._y_ranges_set = {}
            changes = self._y_range_changes([t.y for t in self.figure.data])
            if changes:
                self.figure.plotly_relayout(changes)
        else:
            import numpy as np  # not at `%load_ext`: ~0.1 s a next kernel need not wait

            xs_by_trace, ys_by_trace = [], []
            for key in keys:
                xs, ys = series_xy(
                    store, key, self._x_axis.value, self._smoothing.value, self.max_points
                )
                # float64 arrays: plotly sends them to the page as binary buffers; a
                # list (or an int64 array, which plotly turns into one) is walked
                # element by element by ipywidgets, ~40 % of a redraw's cost.
                xs_by_trace.append(np.asarray(xs, dtype=float))
                ys_by_trace.append(np.asarray(ys, dtype=float))
            y_type = "log" if self._log_y.value else "linear"
            if y_type != self._y_type:
                self._y_type = y_type
                self.figure.update_yaxes(type=y_type)
            # One message to the page a redraw, the traces and the y ranges together;
            # plotly_update takes the points as they are, where setting trace.x
            # re-validates every array (another ~30 % of a redraw).
            self.figure.plotly_update(
                restyle_data={"x": xs_by_trace, "y": ys_by_trace},
                relayout_data=self._y_range_changes(ys_by_trace),
                trace_indexes=list(range(len(keys))),
            )
        self.redraws += 1

    def _y_range_changes(self, ys_by_trace: list) -> dict:
        """Each subplot's y range without outliers unless unticked (or log y), as
        the layout changes that make it so (none where the range set last holds);
        ``ys_by_trace``: the traces' points, in their order."""
        import numpy as np

        robust = self._outliers.value and not self._log_y.value
        by_axis: dict[str, list] = {}
        for axis, ys, (_name, rank) in zip(self._trace_axes, ys_by_trace, self._keys):
            if rank not in ("low", "high") and ys is not None:
                by_axis.setdefault(axis, []).append(np.asarray(ys, dtype=float))
        changes: dict = {}
        for axis, ys in by_axis.items():
            name = "yaxis" + axis[1:]
            span = robust_range(ys) if robust and ys else None
            if self._y_ranges_set.get(name, "unset") != span:
                self._y_ranges_set[name] = span
                changes.update({f"{name}.autorange": span is None, f"{name}.range": span})
        return changes

    def _render_logs(self) -> None:
        wanted = self._log_filter.value
        lines = [_log_line(r, line) for r, line in self._logs if wanted == -1 or r == wanted][
            -_SHOWN_LOG_LINES:
        ]
        self._log_view.value = (
            '<pre style="margin:0;font-size:12px;line-height:1.3">'
            + html.escape("\n".join(lines))
            + "</pre>"
        )


class LiveOnFirstReport:
    """A foreground cell's output in a live frontend: printed plainly (``printer``)
    until the cell's first report, then the live view appears under it and takes the
    output from there on. A cell that never reports gets no widget at all.

    Use it as the cell's output sink, then :meth:`attach` the cell's handle; the
    view is shown from the thread that drives the cell (the reports arrive there), so
    it lands in that cell's output."""

    def __init__(
        self, store, printer, label: str | None = None, stacks=None, set_controls=None
    ) -> None:
        self.store = store
        self.label = label
        self._stacks, self._set_controls = stacks, set_controls
        self.view: LiveMetrics | None = None
        self._printer = printer
        self._handle = None
        self._unsubscribe = store.subscribe(self._on_reports)

    def __call__(self, rank: int, stream: str, text: str) -> None:
        if self.view is None:
            self._printer(rank, stream, text)

    def flush(self) -> None:
        flush = getattr(self._printer, "flush", None)
        if flush is not None:
            flush()

    def attach(self, handle) -> None:
        self._handle = handle

    def _on_reports(self, _rank, _batch) -> None:
        if self.view is not None or self._handle is None or self._handle.done():
            return
        self.flush()  # a half-printed line goes out before the view
        self.view = LiveMetrics(
            self.store,
            self._handle,
            label=self.label,
            replay_output=False,
            stacks=self._stacks,
            set_controls=self._set_controls,
        ).show()

    def close(self) -> None:
        self._unsubscribe()
