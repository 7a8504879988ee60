"""The run's files beside its group: ``run.json`` kept current (``RunRecorder``) and
the outputs a started group writes into (metrics log, ranks' logs, TensorBoard)."""

from __future__ import annotations

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

    def write(self, state: str, config: SessionConfig, group: RankGroup | None) -> None:
        self.carry_on()
        write_run_record(
            self._run_dir,
            RunRecord(
                run_name=self._run_name,
                started=self._started_at or time.time(),
                status=state,
                config=self._recorded(config),
                ranks=[vars(r) for r in group.ranks] if group is not None else [],
                updated=time.time(),
                mlflow=self._tracking_record(),
                **self._commits.record(),
            ),
        )
