"""Where a cell run again went on from, as a cell observer. After a recovery the
ranks load the checkpoint in force and each says which in its update; once every
rank has (or the cell ends first), the cell says it in one line — the ranks report
it, the driver does not guess — and ``origin`` keeps it (``restarted_from``)."""

from __future__ import annotations

from rtnb.core._messages import RankUpdate
from rtnb.driver.cells._observers import CellObserver, CellView, ObserverContext

__all__ = ["RestartOrigin", "observe"]


class RestartOrigin(CellObserver):
    def __init__(self) -> None:
        self.origin: str | None = None
        self._due = False  # restarted, and not yet said where from

    def restart(self, cell: CellView) -> None:
        self.origin, self._due = None, True

    def update(self, cell: CellView, update: RankUpdate) -> None:
        if update.loaded_checkpoint is not None and len(cell.loaded) >= len(cell.ranks):
            self._say(cell)

    def end(self, cell: CellView) -> None:
        self._say(cell)

    def _say(self, cell: CellView) -> None:
        if not self._due:
            return
        self._due = False
        by_rank = {r: cell.loaded.get(r) for r in cell.ranks}
        ids = sorted({c for c in by_rank.values() if c})
        if not ids:
            cell.note(f"[rtnb] {cell.name} restarted without loading a checkpoint\n")
            return
        self.origin = ids[-1] if len(ids) == 1 else ", ".join(ids)
        which = (
            "every rank"
            if all(by_rank.values())
            else "ranks " + ", ".join(str(r) for r, c in by_rank.items() if c)
        )
        cell.note(f"[rtnb] {cell.name} restarted from {self.origin} ({which} loaded it)\n")


def observe(cell: CellView, context: ObserverContext) -> RestartOrigin:
    return RestartOrigin()
