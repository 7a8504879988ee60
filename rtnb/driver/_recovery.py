"""Recovery: the failure policy and the one component that replays the journal.

After a rank dies the group is rebuilt and :class:`Replayer` replays the run's
journal onto it, exactly: the same pushes and cells, in the same order, on the same
ranks (a rank that no longer exists after a scale-down is left out), with every
replayed cell's ``get_checkpoint()`` returning the run's latest committed
checkpoint (so a training cell written in the resume pattern costs about its
set-up time). Replay also rebuilds a group for ``scale``, ``restart --replay``
and ``start --replay`` in a new kernel. :class:`FailurePolicy` owns the failure
count that ``--max-failures`` bounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rtnb.errors import WorkerGroupError
from rtnb.storage._journal import EntryKind, Journal

if TYPE_CHECKING:
    from rtnb.driver._session import Session

__all__ = ["FailurePolicy", "RecoveryOutcome", "ReplayReport", "Replayer"]


class FailurePolicy:
    """How many group rebuilds after a rank died ``--max-failures`` still allows."""

    def __init__(self, max_failures: int) -> None:
        self.max_failures = max_failures
        self.failures = 0

    def can_recover(self) -> bool:
        return self.failures < self.max_failures

    def record_failure(self) -> str:
        self.failures += 1
        return self.describe()

    def describe(self) -> str:
        return f"recovery {self.failures} of {self.max_failures}"

    def reset(self) -> None:
        self.failures = 0


@dataclass
class ReplayReport:
    cells: int = 0
    pushes: int = 0
    duration_s: float = 0.0
    skipped: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        parts = [f"{self.cells} cell{'s' if self.cells != 1 else ''}"]
        if self.pushes:
            parts.append(f"{self.pushes} push{'es' if self.pushes != 1 else ''}")
        text = f"{' and '.join(parts)} replayed in {self.duration_s:.2f} s"
        if self.skipped:
            text += f" (not replayed: {'; '.join(self.skipped)})"
        return text


@dataclass
class RecoveryOutcome:
    attempt: str  # "recovery 1 of 3"
    replay: ReplayReport
    died: dict[int, str] = field(default_factory=dict)  # ranks that died during it


class Replayer:
    """Replays a journal onto the session's current group."""

    def __init__(self, session: Session, journal: Journal) -> None:
        self.session = session
        self.journal = journal

    def replay(self, before: int | None = None) -> ReplayReport:
        """Replay every action since the last fresh start, up to entry ``before``.

        A replayed cell that fails raises WorkerGroupError naming it; a rank death
        raises the cell's restart signal to the caller (another failure)."""
        from rtnb.driver._cell import CellHandle

        session = self.session
        report = ReplayReport()
        started = time.monotonic()
        for step in self.journal.replay_plan(before):
            entry = step.entry
            if step.skipped:
                report.skipped.append(f"{_cell_name(entry)} ({step.skipped})")
                continue
            world = session._require_group().world_size
            ranks = [r for r in (entry.ranks or range(world)) if r < world]
            if not ranks:
                report.skipped.append(
                    f"{_cell_name(entry)} (its ranks {entry.ranks} are not in a group of {world})"
                )
                continue
            if entry.values is not None:
                session._send_values(self.journal.read_values(entry), ranks)
            if entry.kind is EntryKind.PUSH:
                report.pushes += 1
                continue
            handle = CellHandle(
                session, entry.cell_id or 0, entry.code or "", ranks, replay=True, label=entry.label
            )
            handle.drive_replay()
            failed = {r: u for r, u in handle._finished.items() if u.error is not None}
            if failed:
                rank, update = min(failed.items())
                raise WorkerGroupError(
                    f"replaying {_cell_name(entry)} failed on rank {rank}: {update.error[0]}"
                )
            report.cells += 1
        report.duration_s = time.monotonic() - started
        return report


def _cell_name(entry) -> str:
    return f"cell {entry.label or entry.cell_id}"
