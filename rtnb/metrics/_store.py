"""Driver-side store of what the ranks report: bounded plot series, progress, callbacks.

Memory is bounded however long a run is: per (metric, rank) a
:class:`BoundedSeries` of a few thousand points, plus the mean across ranks; the
full-resolution record goes to the run directory through :class:`MetricsLog`.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rtnb.core._text import to_number
from rtnb.metrics._series import BoundedSeries

__all__ = ["MetricsStore", "Progress", "Report"]

# Hard cap on steps waiting for every rank's value before their mean is plotted.
_MEAN_PENDING_CAP = 200_000
# Step rates are measured over this many seconds of recent reports.
_RATE_WINDOW_S = 5.0
# A rank is a straggler when its step rate is below this share of the median rank's.
_STRAGGLER_SHARE = 0.7


@dataclass(frozen=True)
class Report:
    rank: int
    step: int
    time: float
    metrics: dict


@dataclass
class Progress:
    """How far the ranks are; what the live header shows."""

    steps: dict[int, int] = field(default_factory=dict)
    rates: dict[int, float] = field(default_factory=dict)  # steps/s, recent
    elapsed_s: float = 0.0
    total_steps: int | None = None
    stragglers: list[int] = field(default_factory=list)

    @property
    def step(self) -> int:
        return min(self.steps.values()) if self.steps else 0

    @property
    def rate(self) -> float:
        return statistics.median(self.rates.values()) if self.rates else 0.0

    @property
    def eta_s(self) -> float | None:
        if not self.total_steps or self.rate <= 0:
            return None
        return max(0.0, (self.total_steps - self.step) / self.rate)


class MetricsStore:
    def __init__(
        self, log: Any = None, capacity: int = 2000, exporter: Any = None
    ) -> None:
        self._lock = threading.RLock()
        self.capacity = capacity
        self.log = log
        self.exporter = exporter
        self.last: dict[int, Report] = {}
        self.counts: dict[int, int] = {}
        self._series: dict[tuple[str, int], BoundedSeries] = {}
        self._means: dict[str, BoundedSeries] = {}
        self._pending_mean: dict[str, dict[int, dict[int, float]]] = {}
        self._recent: dict[int, deque[tuple[float, int]]] = {}
        self.expected_ranks: set[int] = set()
        self.started_at: float | None = None
        self.total_steps: int | None = None
        self.generation = 0  # bumps on every batch; views redraw when it moves
        self._subscribers: list[Callable[[int, list[Report]], None]] = []

    # ---- writing ---------------------------------------------------------------------
    def subscribe(self, callback: Callable[[int, list[Report]], None]) -> Callable[[], None]:
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def begin(self, ranks: list[int], total_steps: int | None = None) -> None:
        """A cell starts: which ranks count for the mean, and its step total if known."""
        with self._lock:
            self.expected_ranks = set(ranks)
            self.total_steps = total_steps
            self.started_at = time.time()

    def add(self, rank: int, records: list[tuple[int, float, dict]]) -> None:
        if not records:
            return
        with self._lock:
            series = self._series
            recent = self._recent.setdefault(rank, deque(maxlen=256))
            for step, t, metrics in records:
                for name, raw in metrics.items():
                    value = to_number(raw)
                    if value is None:
                        continue
                    key = (name, rank)
                    s = series.get(key)
                    if s is None:
                        s = series[key] = BoundedSeries(self.capacity)
                    s.append(step, t, value)
                    self._add_to_mean(name, rank, step, t, value)
                recent.append((t, step))
            last_step, last_t, last_metrics = records[-1]
            self.last[rank] = Report(rank, last_step, last_t, last_metrics)
            self.counts[rank] = self.counts.get(rank, 0) + len(records)
            self._prune_means()
            self.generation += 1
            if self.log is not None:
                self.log.add(rank, records)
            if self.exporter is not None:
                self.exporter.add(rank, records)
        batch = [Report(rank, step, t, m) for step, t, m in records] if self._subscribers else []
        for callback in list(self._subscribers):
            try:
                callback(rank, batch)
            except Exception:  # noqa: BLE001 - a broken view must not stop training
                pass

    def _add_to_mean(self, name: str, rank: int, step: int, t: float, value: float) -> None:
        expected = self.expected_ranks
        if len(expected) <= 1:
            return
        pending = self._pending_mean.setdefault(name, {})
        at_step = pending.setdefault(step, {})
        at_step[rank] = value
        if len(at_step) == len(expected):
            del pending[step]
            mean = self._means.get(name)
            if mean is None:
                mean = self._means[name] = BoundedSeries(self.capacity)
            mean.append(step, t, sum(at_step.values()) / len(at_step))
        if len(pending) > _MEAN_PENDING_CAP:
            # Only reached when steps do not increase (a user-supplied step that
            # restarts): drop the oldest half, amortised O(1).
            for old in list(pending)[: _MEAN_PENDING_CAP // 2]:
                del pending[old]

    def _prune_means(self) -> None:
        # Ranks report increasing steps, so a step below every expected rank's last
        # step can never complete: drop it. This bounds the pending steps by the
        # skew between ranks, however long the run.
        if len(self.expected_ranks) <= 1 or any(r not in self.last for r in self.expected_ranks):
            return
        floor = min(self.last[r].step for r in self.expected_ranks)
        for pending in self._pending_mean.values():
            while pending:
                oldest = next(iter(pending))
                if oldest >= floor:
                    break
                del pending[oldest]

    def flush(self) -> None:
        with self._lock:
            if self.log is not None:
                self.log.flush()
            if self.exporter is not None:
                self.exporter.flush()

    # ---- reading ---------------------------------------------------------------------
    def metric_names(self) -> list[str]:
        with self._lock:
            return sorted({name for name, _rank in self._series})

    def ranks(self) -> list[int]:
        with self._lock:
            return sorted({rank for _name, rank in self._series})

    def series(self, name: str, rank: int, max_points: int | None = None):
        with self._lock:
            s = self._series.get((name, rank))
            return s.snapshot(max_points) if s is not None else ([], [], [])

    def mean_series(self, name: str, max_points: int | None = None):
        with self._lock:
            s = self._means.get(name)
            return s.snapshot(max_points) if s is not None else ([], [], [])

    def count(self, rank: int | None = None) -> int:
        with self._lock:
            return sum(self.counts.values()) if rank is None else self.counts.get(rank, 0)

    def progress(self, now: float | None = None) -> Progress:
        now = now or time.time()
        with self._lock:
            steps = {
                r: rep.step
                for r, rep in self.last.items()
                if not self.expected_ranks or r in self.expected_ranks
            }
            rates = {}
            for rank in steps:
                window = [
                    (t, s) for t, s in self._recent.get(rank, ()) if t >= now - _RATE_WINDOW_S
                ]
                if len(window) >= 2 and window[-1][0] > window[0][0]:
                    rates[rank] = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
                else:
                    rates[rank] = 0.0
            median = statistics.median(rates.values()) if rates else 0.0
            stragglers = sorted(
                r
                for r, v in rates.items()
                if len(rates) > 1 and median > 0 and v < _STRAGGLER_SHARE * median
            )
            return Progress(
                steps=steps,
                rates=rates,
                elapsed_s=now - self.started_at if self.started_at else 0.0,
                total_steps=self.total_steps,
                stragglers=stragglers,
            )
