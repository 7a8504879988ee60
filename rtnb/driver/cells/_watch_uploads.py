"""Checkpoint uploads beside the loop, as a cell observer: one line when a rank's
``report()`` has waited over a second in all for room among the uploads in flight
(they cannot keep up), and one naming the uploads a stop's grace dropped. Not for a
replayed cell: nothing it does is published."""

from __future__ import annotations

from rtnb.core._messages import RankUpdate
from rtnb.driver.cells._observers import CellObserver, CellView, ObserverContext

__all__ = ["UploadNotes", "observe"]

# Below this much waiting in all, a report's wait for room among the uploads in
# flight is noise, not a sign that uploads cannot keep up.
_UPLOADS_BEHIND_S = 1.0


class UploadNotes(CellObserver):
    def __init__(self) -> None:
        self._said_behind = False

    def update(self, cell: CellView, update: RankUpdate) -> None:
        if update.upload_waited_s < _UPLOADS_BEHIND_S or self._said_behind:
            return
        self._said_behind = True
        at = update.uploading[-1] if update.uploading else update.step
        cell.note(
            f"[rtnb] checkpoint uploads fall behind the loop: rank {update.rank}'s report() "
            f"waited {update.upload_waited_s:.1f} s for room by step {at} (uploads in flight "
            "are capped by RTNB_UPLOADS_IN_FLIGHT; raise it, or checkpoint less often)\n"
        )

    def stop_ran_out(self, cell: CellView, last: dict[int, RankUpdate]) -> None:
        steps = sorted({step for update in last.values() for step in update.uploading})
        if steps:
            cell.note(
                f"[rtnb] checkpoint uploads of step {', '.join(map(str, steps))} were still "
                "in flight when the stop's grace ran out (--stop-grace): dropped, never listed\n"
            )


def observe(cell: CellView, context: ObserverContext) -> UploadNotes | None:
    return None if cell.replay else UploadNotes()
