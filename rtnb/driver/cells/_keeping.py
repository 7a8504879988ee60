"""What the session keeps of each rank's update, as a cell observer: its reports
(the metrics store, and through it the metrics log and its exporters), its resource
samples, its checkpoint offers (the commits') and its output (the ranks' logs). A
replayed cell's are not published: its ranks rebuild state. A write that fails
stops the cell at one step (``CellView.storage_failed``). Essential: an error here
ends the cell instead of leaving it running with nothing kept."""

from __future__ import annotations

from rtnb.core._messages import RankUpdate
from rtnb.driver.cells._observers import CellObserver, CellView, ObserverContext

__all__ = ["Keeper", "observe"]


class Keeper(CellObserver):
    essential = True

    def __init__(self, context: ObserverContext) -> None:
        self._context = context

    def update(self, cell: CellView, update: RankUpdate) -> None:
        for failure in self._kept(update, cell.replay):
            cell.storage_failed(failure)

    def _kept(self, update: RankUpdate, replay: bool) -> list[str]:
        """Keep ``update``; the storage writes that failed, in one line each."""
        rank, metrics, failed = update.rank, self._context.metrics, []
        if update.storage_error is not None:
            failed.append(update.storage_error)
        if update.reports:
            metrics.add(rank, update.reports)
            if metrics.log is not None and metrics.log.failure:
                failed.append(f"the metrics record could not be written: {metrics.log.failure}")
        if update.resources and not replay:
            metrics.add_system(rank, update.resources)
        for offer in update.checkpoints:
            self._context.checkpoints.offer(rank, offer)
        logs = self._context.logs
        if logs is not None and not replay:
            for _stream, text in update.output:
                logs.add(rank, text)
            if update.output and logs.failure:
                failed.append(f"the ranks' output could not be kept: {logs.failure}")
        return failed


def observe(cell: CellView, context: ObserverContext) -> Keeper:
    return Keeper(context)
