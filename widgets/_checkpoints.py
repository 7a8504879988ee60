"""``CheckpointBrowser``: a table of a run's checkpoints with Resume, Load and Delete."""

from __future__ import annotations

import html
import time

import ipywidgets as w

__all__ = ["CheckpointBrowser"]

_NONE = "(choose a checkpoint)"


class CheckpointBrowser(w.VBox):
    """Lists committed (and incomplete) checkpoints: id, step, time, metrics, size,
    ranks, status. Sortable by any metric. The buttons call the given actions:
    ``resume(id)``, ``load(id)``, ``delete(id)``; ``list_checkpoints()`` returns
    :class:`rtnb.CheckpointInfo` rows. It refreshes when ``subscribe`` reports a commit.
    An action returns a message, or a ``(message, widget)`` pair whose widget (e.g.
    the resumed cell's live view) is shown under the buttons.
    """

    def __init__(
        self,
        list_checkpoints,
        *,
        resume=None,
        load=None,
        delete=None,
        subscribe=None,
        title: str = "",
    ) -> None:
        self._list = list_checkpoints
        self._actions = {"Resume": resume, "Load": load, "Delete": delete}
        self._title = w.HTML(f"<b>{html.escape(title)}</b>" if title else "")
        self._sort = w.Dropdown(
            options=[("step", "step")],
            value="step",
            description="sort by",
            layout=w.Layout(width="220px"),
        )
        self._descending = w.Checkbox(value=True, description="descending", indent=False)
        self._table = w.HTML()
        self._choice = w.Dropdown(
            options=[(_NONE, None)],
            value=None,
            description="checkpoint",
            layout=w.Layout(width="320px"),
        )
        self._buttons = {name: w.Button(description=name, disabled=True) for name in self._actions}
        # Delete asks twice: the first click names what would go and arms the button.
        self._armed: str | None = None
        self._refreshing = False
        self._latest: str | None = None
        self._choice.observe(lambda _c: self._update_buttons(), names="value")
        self.message = w.HTML()
        self.activity = w.Box(layout=w.Layout(flex_flow="column"))
        for name, button in self._buttons.items():
            button.on_click(lambda _b, name=name: self._act(name))
        self._sort.observe(self._on_sort, names="value")
        self._descending.observe(lambda _c: self.refresh(), names="value")
        super().__init__(
            [
                self._title,
                w.HBox([self._sort, self._descending]),
                self._table,
                w.HBox([self._choice, *self._buttons.values()]),
                self.message,
                self.activity,
            ]
        )
        if subscribe is not None:
            subscribe(lambda _info: self.refresh())
        self.refresh()

    def _on_sort(self, change) -> None:
        if self._refreshing:
            return  # the options were renewed, not chosen by the user
        # Newest first by step; lowest first by a metric (a loss: the best on top).
        self._descending.value = change["new"] == "step"
        self.refresh()

    def _update_buttons(self) -> None:
        chosen = self._choice.value
        if chosen != self._armed:
            self._armed = None
            self._buttons["Delete"].description = "Delete"
            self._buttons["Delete"].button_style = ""
        for name, button in self._buttons.items():
            # Nothing chosen, nothing to do; the latest committed checkpoint is what a
            # recovery resumes from, so it is never offered for deletion.
            button.disabled = (
                self._actions[name] is None
                or chosen is None
                or (name == "Delete" and chosen == self._latest)
            )
        if self._buttons["Delete"].disabled and self._actions["Delete"] is not None and chosen:
            self._buttons["Delete"].tooltip = "the latest committed checkpoint is kept"
        else:
            self._buttons["Delete"].tooltip = ""

    def rows(self):
        rows = self._list()
        key = self._sort.value
        if key == "step":
            rows = sorted(rows, key=lambda c: c.step, reverse=self._descending.value)
        else:
            present = [c for c in rows if isinstance(c.metrics.get(key), (int, float))]
            missing = [c for c in rows if c not in present]
            rows = (
                sorted(present, key=lambda c: c.metrics[key], reverse=self._descending.value)
                + missing
            )
        return rows

    def refresh(self) -> None:
        rows = self.rows()
        metrics = sorted({k for c in rows for k in c.metrics})
        options = [("step", "step")] + [(m, m) for m in metrics]
        if list(self._sort.options) != options:
            current = self._sort.value
            self._refreshing = True
            try:
                self._sort.options = options
                self._sort.value = current if current in dict(options).values() else "step"
            finally:
                self._refreshing = False
        committed = [c for c in rows if c.status == "committed"]
        self._latest = max(committed, key=lambda c: (c.step, c.time)).id if committed else None
        right = ' style="text-align:right;padding:2px 10px"'
        left = ' style="text-align:left;padding:2px 10px"'
        columns = ["id", "step", "time", *metrics, "size", "ranks", "status"]
        numeric = {"step", "size", *metrics}
        head = "".join(
            f"<th{right if h in numeric else left}>{html.escape(h)}</th>" for h in columns
        )
        body = []
        for c in rows:
            badge = " (latest)" if c.id == self._latest else ""
            cells = [
                c.id + badge,
                str(c.step),
                time.strftime("%H:%M:%S", time.localtime(c.time)) if c.time else "-",
            ]
            cells += [
                f"{c.metrics[m]:.4g}" if isinstance(c.metrics.get(m), (int, float)) else ""
                for m in metrics
            ]
            cells += [_size(c.size), ",".join(map(str, c.ranks)), c.status]
            body.append(
                "<tr>"
                + "".join(
                    f"<td{right if h in numeric else left}>{html.escape(x)}</td>"
                    for h, x in zip(columns, cells)
                )
                + "</tr>"
            )
        self._table.value = (
            '<table class="rtnb-checkpoints" style="border-collapse:collapse">'
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        )
        chosen = self._choice.value
        ids = [c.id for c in committed]
        self._choice.options = [(_NONE, None)] + [
            (c.id + (" (latest)" if c.id == self._latest else ""), c.id) for c in committed
        ]
        self._choice.value = chosen if chosen in ids else None
        self._update_buttons()

    def _act(self, name: str) -> None:
        action, cid = self._actions[name], self._choice.value
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
                    old.close()
                self.activity.children = (view,)
            self.message.value = html.escape(
                f"{name}: {cid}" + (f" — {outcome}" if isinstance(outcome, str) else "")
            )
        except Exception as exc:  # noqa: BLE001 - shown to the user, one line
            self.message.value = (
                f'<span style="color:#c0392b">{html.escape(f"{name} {cid} failed: {exc}")}</span>'
            )
        self.refresh()


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
