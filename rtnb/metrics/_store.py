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

from rtnb.core._reports import ReportBatch
from rtnb.core._resources import ResourceSample, memory_climbing
from rtnb.metrics._series import BoundedSeries

_SYSTEM_KEPT = 120  # samples per rank (two minutes at 1 Hz)

__all__ = ["MetricsStore", "Progress", "Report"]

# Hard cap on steps waiting for every rank's value before their mean is plotted.
_MEAN_PENDING_CAP = 200_000
# Step rates are measured over this many seconds of recent reports.
_RATE_WINDOW_S = 5.0
# A rank is a straggler when its step rate is below this share of the median rank's.
_STRAGGLER_SHARE = 0.7
# Earlier lines kept for drawing under a resumed one (the oldest are dropped).
_EARLIER_KEPT = 4


@dataclass
class Exporters:
    """Several exporters (TensorBoard and MLflow) as one."""

    items: list[Any]

    def add(self, rank: int, records: list) -> None:
        for item in self.items:
            item.add(rank, records)

    def flush(self) -> None:
        for item in self.items:
            item.flush()

    def close(self) -> None:
        for item in self.items:
            item.close()


@dataclass(frozen=True)
class Report:
    rank: int
    step: int
    time: float
    metrics: dict


@dataclass
class Progress:
    """How far the ranks are in the current cell; what the live header shows.

    ``steps`` counts each rank's reports since the cell began (what ``--steps``
    counts); ``run_steps`` is each rank's last reported step number in the run."""

    steps: dict[int, int] = field(default_factory=dict)
    rates: dict[int, float] = field(default_factory=dict)  # reports/s, recent
    elapsed_s: float = 0.0
    total_steps: int | None = None
    stragglers: list[int] = field(default_factory=list)
    run_steps: dict[int, int] = field(default_factory=dict)

    @property
    def run_step(self) -> int:
        return min(self.run_steps.values()) if self.run_steps else 0

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


class _Mean:
    """One metric's mean over the expected ranks, at the steps every one of them
    reported (steps some rank skipped have none).

    Batches are only queued when they arrive and merged, vectorised, when the mean
    is read (a view redraws at most ~10 times a second) or the queue is long: the
    kernel does O(1) work per batch while ranks report.
    """

    def __init__(self, capacity: int) -> None:
        self.series = BoundedSeries(capacity)
        # the lowest and highest rank at the same steps: the band of a many-rank view
        self.low = BoundedSeries(capacity)
        self.high = BoundedSeries(capacity)
        self._queued: dict[int, list[tuple]] = {}
        self._queued_points = 0
        # per rank: (steps, times, values) arrays not yet matched by every rank
        self._waiting: dict[int, tuple] = {}

    def add(self, rank: int, steps, times, values, expected: set[int]) -> None:
        self._queued.setdefault(rank, []).append((steps, times, values))
        self._queued_points += len(steps)
        if self._queued_points > _MEAN_PENDING_CAP:
            self.merge(expected)

    def forget_pending(self) -> None:
        self._queued.clear()
        self._queued_points = 0
        self._waiting.clear()

    def merge(self, expected: set[int]) -> None:
        if not self._queued:
            return
        import numpy as np

        queued, self._queued, self._queued_points = self._queued, {}, 0
        waiting = self._waiting
        for rank, parts in queued.items():
            if rank not in expected:
                continue
            old = waiting.get(rank)
            arrays = [old] if old is not None else []
            arrays += [tuple(np.asarray(a) for a in part) for part in parts]
            merged = tuple(np.concatenate(column) for column in zip(*arrays))
            back = np.flatnonzero(np.diff(merged[0]) <= 0)
            if len(back):
                # The steps went back (a loop counting from 0 again): what waited can
                # never be matched, so the mean restarts there.
                waiting.clear()
                merged = tuple(a[int(back[-1]) + 1 :] for a in merged)
            waiting[rank] = merged
        for rank, arrays in waiting.items():
            if len(arrays[0]) > _MEAN_PENDING_CAP:  # a rank that others never match
                waiting[rank] = tuple(a[-_MEAN_PENDING_CAP // 2 :] for a in arrays)
        if any(rank not in waiting or not len(waiting[rank][0]) for rank in expected):
            return
        floor = min(waiting[rank][0][-1] for rank in expected)
        ready = {}
        for rank in expected:
            steps, times, values = waiting[rank]
            cut = int(np.searchsorted(steps, floor, side="right"))
            ready[rank] = (steps[:cut], times[:cut], values[:cut])
            waiting[rank] = (steps[cut:], times[cut:], values[cut:])
        parts = list(ready.values())
        common = parts[0][0]
        if not all(np.array_equal(part[0], common) for part in parts):
            for part in parts[1:]:
                common = np.intersect1d(common, part[0], assume_unique=True)
            at = [np.searchsorted(part[0], common) for part in parts]
            parts = [(common, part[1][i], part[2][i]) for part, i in zip(parts, at)]
        if len(common):
            times = np.max([part[1] for part in parts], axis=0)
            values = np.array([part[2] for part in parts])
            self.series.extend(common, times, values.mean(axis=0))
            self.low.extend(common, times, values.min(axis=0))
            self.high.extend(common, times, values.max(axis=0))


class MetricsStore:
    def __init__(self, log: Any = None, capacity: int = 2000, exporter: Any = None) -> None:
        self._lock = threading.RLock()
        self.capacity = capacity
        self.log = log
        self.exporter = exporter
        self.last: dict[int, Report] = {}
        self.counts: dict[int, int] = {}
        self._counts_at_begin: dict[int, int] = {}
        self._series: dict[tuple[str, int], BoundedSeries] = {}
        self._means: dict[str, _Mean] = {}
        self._recent: dict[int, deque[tuple[float, int]]] = {}
        self.expected_ranks: set[int] = set()
        self.started_at: float | None = None
        self.total_steps: int | None = None
        self.generation = 0  # bumps on every batch; views redraw when it moves
        # Lines of training the ranks went back from (a resume from an earlier
        # checkpoint, a recovery, a loop counting from 0 again): per metric, the
        # series drawn faded under the current line (no longer appended to).
        self.earlier: list[dict[str, BoundedSeries]] = []
        self._line_last: dict[int, int] = {}  # each rank's last step on the current line
        self._subscribers: list[Callable[[int, ReportBatch], None]] = []
        # Told each cell's ranks and step total as it begins (a detached group's
        # followers redo the begins in order with the batches).
        self._begin_listeners: list[Callable[[list[int], int | None], None]] = []
        # The ranks' resource samples: not training metrics (no subplot, no step
        # count); their own record (system_log) and the exporters get them.
        self.system: dict[int, deque[ResourceSample]] = {}
        self.system_log: Any = None
        # Live-control changes: (step, text), drawn as vertical lines on the plot.
        self.markers: list[tuple[int, str]] = []

    # ---- writing ---------------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows, capacity: int = 2000) -> MetricsStore:
        """A store holding a run's metrics record (rows as ``read_metrics`` gives them:
        rank, step, timestamp and the metrics), to draw a run that is not this
        session's."""
        per_rank: dict[int, list[tuple[int, float, dict]]] = {}
        for row in rows:
            metrics = {k: v for k, v in row.items() if k not in ("rank", "step", "timestamp")}
            per_rank.setdefault(int(row["rank"]), []).append(
                (int(row["step"]), float(row["timestamp"]), metrics)
            )
        store = cls(capacity=capacity)
        store.begin(sorted(per_rank))
        first = min((r[0][1] for r in per_rank.values() if r), default=None)
        # Where the steps went back (a resume, a recovery) a new line starts: added
        # line by line, every rank's part of one before the next, the store draws
        # it as a branch, as it did live.
        pieces = {}
        for rank, records in per_rank.items():
            cuts = [i for i in range(1, len(records)) if records[i][0] <= records[i - 1][0]]
            pieces[rank] = [records[a:b] for a, b in zip([0, *cuts], [*cuts, len(records)])]
        for line in range(max((len(p) for p in pieces.values()), default=0)):
            for rank in sorted(pieces):
                if line < len(pieces[rank]):
                    store.add(rank, ReportBatch.from_records(pieces[rank][line]))
        store.started_at = first
        return store

    def add_exporter(self, exporter: Any) -> None:
        """Mirror every report into ``exporter`` too (``add``/``flush``/``close``)."""
        with self._lock:
            if self.exporter is None:
                self.exporter = exporter
            elif isinstance(self.exporter, Exporters):
                self.exporter.items.append(exporter)
            else:
                self.exporter = Exporters([self.exporter, exporter])

    def subscribe(self, callback: Callable[[int, ReportBatch], None]) -> Callable[[], None]:
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def on_begin(self, callback: Callable[[list[int], int | None], None]) -> None:
        self._begin_listeners.append(callback)

    def begin(self, ranks: list[int], total_steps: int | None = None) -> None:
        """A cell starts: which ranks count for the mean, and its step total if known."""
        for callback in list(self._begin_listeners):
            callback(sorted(ranks), total_steps)
        with self._lock:
            self.expected_ranks = set(ranks)
            for mean in self._means.values():
                # What the last cell's ranks all reported counts before the rest goes.
                mean.merge(self.expected_ranks)
                mean.forget_pending()
            # The header counts this cell's reports, not the run's.
            self._counts_at_begin = dict(self.counts)
            self._recent.clear()
            self.total_steps = total_steps
            self.started_at = time.time()

    def add(self, rank: int, reports: ReportBatch | list[tuple[int, float, dict]]) -> None:
        """Take one rank's batch of reports (a :class:`ReportBatch`, or a list of
        ``(step, time, metrics)`` records). Costs O(metrics) Python calls per batch,
        not per report: at 32 ranks x 10 kHz the kernel must stay idle."""
        batch = reports if isinstance(reports, ReportBatch) else ReportBatch.from_records(reports)
        if not len(batch):
            return
        steps, times = batch.steps, batch.times
        with self._lock:
            last = self._line_last.get(rank)
            if last is not None and steps[0] <= last:
                self._start_line_locked()
            self._line_last[rank] = int(steps[-1])
            for name in batch.columns:
                number_steps, number_times, values = batch.numbers(name)
                if not len(values):
                    continue
                key = (name, rank)
                series = self._series.get(key)
                if series is None:
                    series = self._series[key] = BoundedSeries(self.capacity)
                series.extend(number_steps, number_times, values)
                if len(self.expected_ranks) > 1 and rank in self.expected_ranks:
                    mean = self._means.get(name)
                    if mean is None:
                        mean = self._means[name] = _Mean(self.capacity)
                    mean.add(rank, number_steps, number_times, values, self.expected_ranks)
            recent = self._recent.setdefault(rank, deque(maxlen=256))
            before = self.counts.get(rank, 0)
            recent.append((times[0], before + 1))
            if len(batch) > 1:
                recent.append((times[-1], before + len(batch)))
            self.last[rank] = Report(rank, steps[-1], times[-1], batch.last_metrics())
            self.counts[rank] = before + len(batch)
            self.generation += 1
            if self.log is not None:
                self.log.add(rank, batch)
            exporter = self.exporter
        if exporter is not None:
            # Outside the store's lock: a mirror may write to its own store here
            # (MLflow's batches), and the live view reads this store meanwhile.
            exporter.add(rank, list(batch.rows()))
        for callback in list(self._subscribers):
            try:
                callback(rank, batch)
            except Exception:  # noqa: BLE001 - a broken view must not stop training
                pass

    def add_system(self, rank: int, samples: list[ResourceSample]) -> None:
        """One rank's resource samples (CPU, memory, GPU), as ``sys/...`` metrics."""
        if not samples:
            return
        with self._lock:
            self.system.setdefault(rank, deque(maxlen=_SYSTEM_KEPT)).extend(samples)
            log, exporter = self.system_log, self.exporter
        batch = ReportBatch.from_records([(s.step, s.time, s.metrics()) for s in samples])
        if log is not None:
            log.add(rank, batch)
        if exporter is not None:
            exporter.add(rank, list(batch.rows()))

    def add_marker(self, step: int, text: str) -> None:
        with self._lock:
            self.markers.append((step, text))
            self.generation += 1

    def add_controls_applied(self, rank: int, applied: list[tuple[str, Any, int]]) -> None:
        """The steps at which one rank first used new control values, kept in the
        system record as ``control/NAME`` (numbers) beside the resource samples."""
        records = [
            (step, time.time(), {f"control/{name}": value})
            for name, value, step in applied
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        ]
        log = self.system_log
        if records and log is not None:
            log.add(rank, ReportBatch.from_records(records))

    def system_latest(self) -> dict[int, ResourceSample]:
        with self._lock:
            return {r: kept[-1] for r, kept in sorted(self.system.items()) if kept}

    def memory_climbing(self) -> list[int]:
        """Ranks whose memory has climbed steadily over their recent samples."""
        with self._lock:
            kept = {r: list(s) for r, s in self.system.items()}
        return sorted(r for r, samples in kept.items() if memory_climbing(samples))

    def _start_line_locked(self) -> None:
        """A rank's steps went back: what was drawn so far becomes an earlier line
        (the mean over the ranks, or the one rank's curve) and the plot starts a
        new one there, as a branch over it rather than a jump back."""
        segment = {}
        for name in dict.fromkeys(name for name, _rank in self._series):
            mean = self._means.get(name)
            if mean is not None:
                mean.merge(self.expected_ranks)
            series = mean.series if mean is not None and len(mean.series) else None
            if series is None:
                ranks = sorted(r for n, r in self._series if n == name)
                series = self._series[(name, ranks[0])]
            if len(series):
                segment[name] = series
        if segment:
            self.earlier = [*self.earlier, segment][-_EARLIER_KEPT:]
        self._series.clear()
        self._means.clear()
        self._line_last.clear()

    def earlier_series(self, name: str, index: int, max_points: int | None = None):
        """(steps, times, values) of earlier line ``index`` (0: the oldest kept)."""
        with self._lock:
            series = self.earlier[index].get(name)
            return series.snapshot(max_points) if series is not None else ([], [], [])

    def flush(self) -> None:
        with self._lock:
            if self.log is not None:
                self.log.flush()
            if self.system_log is not None:
                self.system_log.flush()
            exporter = self.exporter
        if exporter is not None:
            exporter.flush()  # outside the lock, as in add

    # ---- reading ---------------------------------------------------------------------
    def metric_names(self) -> list[str]:
        """Plottable metrics in the order they were first reported (as the loop
        reports them: loss before accuracy if that is what the user wrote)."""
        with self._lock:
            return list(dict.fromkeys(name for name, _rank in self._series))

    def ranks(self) -> list[int]:
        with self._lock:
            return sorted({rank for _name, rank in self._series})

    def series(self, name: str, rank: int, max_points: int | None = None):
        with self._lock:
            s = self._series.get((name, rank))
            return s.snapshot(max_points) if s is not None else ([], [], [])

    def mean_series(self, name: str, max_points: int | None = None):
        with self._lock:
            mean = self._means.get(name)
            if mean is None:
                return [], [], []
            mean.merge(self.expected_ranks)
            return mean.series.snapshot(max_points)

    def band_series(self, name: str, max_points: int | None = None):
        """(steps, times, lowest, highest) over the ranks, at the steps all reported."""
        with self._lock:
            mean = self._means.get(name)
            if mean is None:
                return [], [], [], []
            mean.merge(self.expected_ranks)
            steps, times, low = mean.low.snapshot(max_points)
            return steps, times, low, mean.high.snapshot(max_points)[2]

    def outlier_ranks(self, name: str, count: int = 2) -> list[int]:
        """The ranks a many-rank view draws on their own: the one furthest behind
        (if any is behind) and the ``count`` whose latest ``name`` is furthest from
        the ranks' mean."""
        with self._lock:
            latest = {
                rank: series._last[2]
                for (metric, rank), series in self._series.items()
                if metric == name and series._last is not None
            }
            steps = {rank: report.step for rank, report in self.last.items()}
        chosen: list[int] = []
        if steps and min(steps.values()) < max(steps.values()):
            chosen.append(min(steps, key=lambda rank: (steps[rank], rank)))
        finite = {r: v for r, v in latest.items() if v == v and abs(v) != float("inf")}
        if finite:
            mean = sum(finite.values()) / len(finite)
            far = sorted(finite, key=lambda rank: (-abs(finite[rank] - mean), rank))
            chosen += [r for r in far if r not in chosen and finite[r] != mean][:count]
        return sorted(chosen)

    def count(self, rank: int | None = None) -> int:
        with self._lock:
            return sum(self.counts.values()) if rank is None else self.counts.get(rank, 0)

    def progress(self, now: float | None = None) -> Progress:
        now = now or time.time()
        with self._lock:
            shown = [r for r in self.last if not self.expected_ranks or r in self.expected_ranks]
            steps = {r: self.counts.get(r, 0) - self._counts_at_begin.get(r, 0) for r in shown}
            rates = {}
            for rank in steps:
                window = [
                    (t, n) for t, n in self._recent.get(rank, ()) if t >= now - _RATE_WINDOW_S
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
                run_steps={r: self.last[r].step for r in shown},
            )
