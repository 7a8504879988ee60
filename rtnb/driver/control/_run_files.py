"""The run's files beside its group: ``run.json`` kept current (``RunRecorder``) and
the outputs a started group writes into (metrics log, ranks' logs, TensorBoard)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from rtnb.core._config import SessionConfig
from rtnb.driver.cells import CheckpointCoordinator
from rtnb.driver.ranks import RankGroup
from rtnb.errors import ConfigError
from rtnb.metrics._store import MetricsStore
from rtnb.metrics._tensorboard import TensorBoardExporter
from rtnb.storage._layout import (
    SYSTEM_METRICS,
    RunRecord,
    read_run_record,
    tensorboard_dir,
    write_run_record,
)
from rtnb.storage._logs import RankLogs
from rtnb.storage._metricslog import MetricsLog
from rtnb.storage._rundir import RunDirectory

__all__ = ["RunRecorder", "attach_run_outputs"]


def attach_run_outputs(
    run_dir: RunDirectory, config: SessionConfig, metrics: MetricsStore, logs: RankLogs | None
) -> RankLogs:
    """The metrics' logs, the ranks' logs and (``--tensorboard``) the event files of
    the run, opened once; the ranks' logs returned."""
    if metrics.log is None:
        metrics.log = MetricsLog(run_dir)
        metrics.system_log = MetricsLog(run_dir, SYSTEM_METRICS)
    if config.tensorboard and metrics.exporter is None:
        if not run_dir.is_local:
            raise ConfigError(
                "--tensorboard writes event files next to the run: it needs a local --storage"
            )
        metrics.exporter = TensorBoardExporter(tensorboard_dir(run_dir.path))
    return logs if logs is not None else RankLogs(run_dir)


class _NewestRecord:
    """Writes ``run.json`` records so that a newer one is never overwritten by an
    older: each gets a number when it is made; a write waits for the one before it
    and skips a record older than the file's. A record handed over with
    :meth:`later` is written by a thread of its own, and only the newest of those
    waiting, at most once per ``_SPACING_S``: a cell's end does not wait on storage
    for a summary file (on S3, several requests), and a fast loop of cells writes
    it a few times a second, not once per cell."""

    _IDLE_S = 10.0  # how long the writing thread waits for more before it ends
    _SPACING_S = 0.5  # the least time between two background writes

    def __init__(self, write: Callable[[RunRecord], None]) -> None:
        self._write = write
        self._cond = threading.Condition()
        self._writing = threading.Lock()  # held while a record is being written
        self._made = 0  # numbers the records handed over
        self._written = 0  # the number of the record in the file
        self._pending: tuple[int, RunRecord] | None = None
        self._thread: threading.Thread | None = None

    def now(self, record: RunRecord) -> None:
        """Written before this returns (its error raised here)."""
        with self._cond:
            self._made += 1
            number = self._made
        self._write_if_newest(number, record)

    def later(self, record: RunRecord) -> None:
        with self._cond:
            self._made += 1
            self._pending = (self._made, record)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="rtnb-run-record", daemon=True
                )
                self._thread.start()
            else:
                self._cond.notify()

    def _write_if_newest(self, number: int, record: RunRecord) -> None:
        with self._writing:
            if number <= self._written:
                return  # a newer record is in the file already
            self._write(record)
            self._written = number

    def _run(self) -> None:
        wrote = float("-inf")
        while True:
            with self._cond:
                if self._pending is None:
                    self._cond.wait(self._IDLE_S)
                if self._pending is None:
                    self._thread = None
                    return
                # Newer records that come meanwhile replace the one waiting.
                while (left := wrote + self._SPACING_S - time.monotonic()) > 0:
                    self._cond.wait(left)
                (number, record), self._pending = self._pending, None
            # A summary file: the next state change or cell's end writes it again.
            with contextlib.suppress(Exception):
                self._write_if_newest(number, record)
            wrote = time.monotonic()


class RunRecorder:
    """Keeps the run's ``run.json`` current: its state, options and ranks, where its
    training is (line and step) and its MLflow run. A run carried on by a new
    session keeps the time it first started and where its training was."""

    def __init__(
        self,
        run_dir: RunDirectory,
        run_name: str,
        commits: CheckpointCoordinator,
        tracking_record: Callable[[], dict],
    ) -> None:
        self._run_dir = run_dir
        self._run_name = run_name
        self._commits = commits
        self._tracking_record = tracking_record
        self._started_at: float | None = None  # run.json's "started"
        self._config: tuple[SessionConfig, dict] | None = None  # (config, as recorded)
        self._file = _NewestRecord(lambda record: write_run_record(run_dir, record))

    def carry_on(self) -> None:
        if self._started_at is not None:
            return
        try:
            earlier = read_run_record(self._run_dir)
        except (OSError, ValueError, TypeError):
            earlier = None
        self._started_at = (earlier.started if earlier is not None else 0.0) or time.time()
        self._commits.restore(earlier)

    def _recorded(self, config: SessionConfig) -> dict:
        # A session's config is frozen and replaced, never changed: recorded once.
        if self._config is None or self._config[0] is not config:
            self._config = (config, config.to_dict())
        return self._config[1]

    def write(
        self, state: str, config: SessionConfig, group: RankGroup | None, wait: bool = True
    ) -> None:
        """The record as of now, in the file when this returns; with ``wait=False``
        written in the background (see :class:`_NewestRecord`)."""
        self.carry_on()
        record = RunRecord(
            run_name=self._run_name,
            started=self._started_at or time.time(),
            status=state,
            config=self._recorded(config),
            ranks=[vars(r) for r in group.ranks] if group is not None else [],
            updated=time.time(),
            mlflow=self._tracking_record(),
            **self._commits.record(),
        )
        if wait:
            self._file.now(record)
        else:
            self._file.later(record)
