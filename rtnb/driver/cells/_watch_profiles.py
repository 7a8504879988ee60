"""``%rtnb profile`` as a cell observer: each rank's profile of the armed steps
arrives in one of its updates; once every rank of the cell sent its own, the
session merges them (the run's ``profiles/``). Not for a replayed cell."""

from __future__ import annotations

from typing import Any

from rtnb.core._messages import RankUpdate
from rtnb.driver.cells._observers import CellObserver, CellView, ObserverContext

__all__ = ["ProfileCollector", "observe"]


class ProfileCollector(CellObserver):
    def __init__(self, context: ObserverContext) -> None:
        self._context = context
        self.profiles: dict[int, Any] = {}  # each rank's, as they arrive

    def update(self, cell: CellView, update: RankUpdate) -> None:
        if update.profile is None:
            return
        self.profiles[update.rank] = update.profile
        if set(self.profiles) >= set(cell.ranks):
            taken, self.profiles = self.profiles, {}
            self._context.profile_taken(cell, taken)


def observe(cell: CellView, context: ObserverContext) -> ProfileCollector | None:
    return None if cell.replay else ProfileCollector(context)
