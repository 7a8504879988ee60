"""Replay: the ranks' state put back on a new group from the run's journal.

:class:`Replayer` replays a journal exactly: the same pushes and cells, in the same
order, on the same ranks (a rank that no longer exists after a scale-down is left
out), with every replayed cell's ``get_checkpoint()`` returning the run's latest
committed checkpoint (so a training cell written in the resume pattern costs about
its set-up time). The controller (``control/_controller.py``) replays onto every group that
keeps the ranks' state: after a recovery, a scale, ``restart --replay`` and ``start
--replay`` in a new kernel. It runs cells through a callable the cell flow gives it,
so this module never imports the cell module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rtnb.driver.lifecycle import ReplayReport
from rtnb.errors import WorkerGroupError
from rtnb.storage._journal import EntryKind, Journal, JournalEntry

__all__ = ["Replayer"]

# Runs one replayed cell on ``ranks``; returns {rank: error} for ranks whose cell
# raised, and raises RankDied when a rank died.
ReplayCell = Callable[[JournalEntry, list[int]], dict[int, tuple]]


class Replayer:
    """Replays a journal onto the current group."""

    def __init__(
        self,
        journal: Journal,
        world_size: Callable[[], int],
        send_values: Callable[[bytes, list[int]], None],
        run_cell: ReplayCell,
        hand_datasets: Callable[[bytes], list[str]],
        set_controls: Callable[[dict[str, Any]], None],
    ) -> None:
        self.journal = journal
        self._world_size = world_size
        self._send_values = send_values
        self._run_cell = run_cell
        self._hand_datasets = hand_datasets
        self._set_controls = set_controls

    def replay(self, before: int | None = None) -> ReplayReport:
        """Replay every action since the last fresh start, up to entry ``before``.

        A replayed cell that fails raises WorkerGroupError naming it; a rank death
        raises RankDied (another failure)."""
        report = ReplayReport()
        started = time.monotonic()
        for step in self.journal.replay_plan(before):
            entry = step.entry
            if step.skipped:
                report.skipped.append(f"{_cell_name(entry)} ({step.skipped})")
                continue
            world = self._world_size()
            ranks = [r for r in (entry.ranks or range(world)) if r < world]
            if not ranks:
                report.skipped.append(
                    f"{_cell_name(entry)} (its ranks {entry.ranks} are not in a group of {world})"
                )
                continue
            if entry.kind is EntryKind.CONTROL:
                self._set_controls(entry.controls or {})
                continue
            if entry.kind is EntryKind.DATASETS:
                missing = self._hand_datasets(self.journal.read_values(entry))
                if missing:
                    report.skipped.append(
                        f"dataset{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                        "(made from the notebook's memory: pass it again)"
                    )
                continue
            if entry.values is not None:
                self._send_values(self.journal.read_values(entry), ranks)
            if entry.kind is EntryKind.PUSH:
                report.pushes += 1
                continue
            failed = self._run_cell(entry, ranks)
            if failed:
                rank, error = min(failed.items())
                raise WorkerGroupError(
                    f"replaying {_cell_name(entry)} failed on rank {rank}: {error[0]}"
                )
            report.cells += 1
        if before is not None:
            self._resend_values_of(before)
        report.duration_s = time.monotonic() - started
        return report

    def _resend_values_of(self, seq: int) -> None:
        """The cell the replay stops before runs again next: what it carried (a
        function and its config) goes to the new ranks too."""
        entry = self.journal.cell_entry(seq)
        if entry is None or entry.values is None:
            return
        world = self._world_size()
        ranks = [r for r in (entry.ranks or range(world)) if r < world]
        if ranks:
            self._send_values(self.journal.read_values(entry), ranks)


def _cell_name(entry: JournalEntry) -> str:
    return f"cell {entry.label or entry.cell_id}"
