"""Display updates made by a thread between two cells, made again as the next starts.

A view's end (a background cell's lasting figure, a sweep's) runs in the thread that
ended the cell. ipykernel sends a thread's output with the parent of the last cell it
was asked to run; sent after that cell went idle and before the next one began,
nbclient (papermill, ``rtnb run``, a notebook's Run All saved by a script) takes it for
a late message of a finished cell and drops it, and the saved notebook keeps the
widget ("model not found" when reopened). JupyterLab updates a display whatever the
message's parent, so the update is sent at once all the same, and made again,
identically, when the next cell starts.

Which cell runs is known from the shell's ``pre_run_cell``/``post_run_cell`` events
(:func:`follow_cells`, done when the extension loads); a process where nobody follows
them (no kernel) sends once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["follow_cells", "stop_following_cells", "update_within_a_cell"]

# How often an update is made again while cells keep starting and ending under it
# before it is left to the next cell's start.
_TRIES = 3


class _CellWindow:
    """Whether a cell runs now, and a count of cell starts and ends, so that a send
    can tell whether it fell wholly inside one running cell."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.followed = False
        self.running = False
        self.changes = 0
        self.again_at_next_cell: list[Callable[[], None]] = []

    def cell_starts(self, *_info) -> None:
        with self.lock:
            self.running, self.changes = True, self.changes + 1
            pending, self.again_at_next_cell = self.again_at_next_cell, []
        for send in pending:  # this cell's parent now: nbclient takes it
            try:
                send()
            except Exception:  # noqa: BLE001 - one view's update must not break a cell
                pass

    def cell_ends(self, *_info) -> None:
        with self.lock:
            self.running, self.changes = False, self.changes + 1


_WINDOW = _CellWindow()


def follow_cells(shell) -> None:
    """Follow the shell's cells (once per shell; again after stop_following_cells)."""
    with _WINDOW.lock:
        if _WINDOW.followed:
            return
        _WINDOW.followed = True
        # The extension loads inside a cell, which has started already.
        _WINDOW.running = True
    shell.events.register("pre_run_cell", _WINDOW.cell_starts)
    shell.events.register("post_run_cell", _WINDOW.cell_ends)


def stop_following_cells(shell) -> None:
    with _WINDOW.lock:
        if not _WINDOW.followed:
            return
        _WINDOW.followed = False
        _WINDOW.again_at_next_cell.clear()
    for name, callback in (
        ("pre_run_cell", _WINDOW.cell_starts),
        ("post_run_cell", _WINDOW.cell_ends),
    ):
        try:
            shell.events.unregister(name, callback)
        except ValueError:
            pass


def update_within_a_cell(updates: list[tuple[Any, dict]]) -> None:
    """Each ``(display handle, raw bundle)`` updated now, and again until one round
    fell wholly inside a running cell; else once more when the next cell starts."""

    def send() -> None:
        for shown, data in updates:
            shown.update(data, raw=True)

    for _ in range(_TRIES):
        with _WINDOW.lock:
            followed, running, changes = _WINDOW.followed, _WINDOW.running, _WINDOW.changes
        send()
        if not followed:
            return
        with _WINDOW.lock:
            if running and _WINDOW.changes == changes:
                return
            if not _WINDOW.running:  # between cells: the next one's start sends it
                _WINDOW.again_at_next_cell.append(send)
                return
    with _WINDOW.lock:
        _WINDOW.again_at_next_cell.append(send)
