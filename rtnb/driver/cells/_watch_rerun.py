"""A training cell run again, as a cell observer. ``rtnb.get_checkpoint()`` hands a
cell the run's latest committed checkpoint, as Ray Train hands a restored run's
``train_loop_per_worker`` its latest: a cell run a second time goes on from where
the first ended (the live view's header says "resumed from"). When that leaves its
loop nothing to do, the cell would end having trained nothing and said nothing; this
says so once, with the two ways on. Not for a replayed cell: its ranks rebuild
state, and skipping the loop is what a replay is for."""

from __future__ import annotations

from rtnb.core._messages import RankUpdate
from rtnb.driver.cells._observers import CellObserver, CellView, ObserverContext

__all__ = ["RerunNote", "observe"]


class RerunNote(CellObserver):
    def __init__(self) -> None:
        self._loaded: str | None = None
        self._reported = False

    def update(self, cell: CellView, update: RankUpdate) -> None:
        if update.loaded_checkpoint is not None and self._loaded is None:
            self._loaded = update.loaded_checkpoint
        if update.reports:
            self._reported = True

    def restart(self, cell: CellView) -> None:
        self._loaded, self._reported = None, False

    def end(self, cell: CellView) -> None:
        if self._loaded is None or self._reported:
            return
        cell.note(
            f"[rtnb] {cell.name} went on from {self._loaded}, the checkpoint "
            "rtnb.get_checkpoint() returned (the run's latest), and reported no step: "
            "its loop had nothing left to train. To train on, raise the loop's end; "
            "to train from the start, begin a new run (%rtnb stop, then %rtnb start)\n"
        )


def observe(cell: CellView, context: ObserverContext) -> RerunNote | None:
    return None if cell.replay else RerunNote()
