"""Breakpoints as a cell observer. A rank at a ``breakpoint()`` says where in its
update; in a foreground cell the user answers its pdb prompt in the cell's input
box (the driving loop waits meanwhile), a background or replayed cell says once how
to attach (``%rtnb debug RANK``), and ``debugging`` keeps those ranks."""

from __future__ import annotations

from rtnb.core._messages import CellState, RankUpdate
from rtnb.driver.cells._observers import CellObserver, CellView, ObserverContext
from rtnb.driver.tools import Breakpoints

__all__ = ["BreakpointWatch", "observe"]


class BreakpointWatch(CellObserver):
    def __init__(self, cell: CellView, context: ObserverContext) -> None:
        self.points = Breakpoints(not (cell.background or cell.replay), cell.note)
        self._context = context

    @property
    def debugging(self) -> list[int]:
        return sorted(self.points.noted)

    def update(self, cell: CellView, update: RankUpdate) -> None:
        running = update.state is CellState.RUNNING
        self.points.took(update.rank, update.debugging, running)

    def tick(self, cell: CellView) -> None:
        if self.points.waiting:
            self.points.serve(cell.stopping, lambda rank: self._answer(cell, rank))

    def _answer(self, cell: CellView, rank: int) -> None:
        """The user answers ``rank``'s pdb prompt in the cell's input box; pdb's
        lines are the rank's own output."""
        self._context.attach_debugger(rank, lambda text: cell.show(rank, text), cell.note)


def observe(cell: CellView, context: ObserverContext) -> BreakpointWatch:
    return BreakpointWatch(cell, context)
