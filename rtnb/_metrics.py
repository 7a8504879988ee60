"""Driver-side store of what the ranks report, with callbacks for live views."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["MetricsStore", "Report"]


@dataclass(frozen=True)
class Report:
    rank: int
    step: int
    time: float
    metrics: dict


class MetricsStore:
    """Every report of every rank in arrival order, plus the last one per rank."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reports: list[Report] = []
        self.last: dict[int, Report] = {}
        self._subscribers: list[Callable[[list[Report]], None]] = []

    def subscribe(self, callback: Callable[[list[Report]], None]) -> Callable[[], None]:
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def add(self, rank: int, records: list[tuple[int, float, dict]]) -> None:
        if not records:
            return
        batch = [Report(rank, step, t, metrics) for step, t, metrics in records]
        with self._lock:
            self.reports.extend(batch)
            self.last[rank] = batch[-1]
        for callback in list(self._subscribers):
            try:
                callback(batch)
            except Exception:  # noqa: BLE001 - a broken view must not stop training
                pass

    def count(self, rank: int | None = None) -> int:
        if rank is None:
            return len(self.reports)
        return sum(1 for r in self.reports if r.rank == rank)
