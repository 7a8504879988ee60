"""The outcome of a run, shaped like Ray Train's ``Result``."""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field
from typing import Any

from rtnb.core._redact import redact_uri
from rtnb.core._score import ScoreRule, ScoreSource
from rtnb.core._text import format_duration, format_table, mean_over_ranks
from rtnb.errors import ConfigError
from rtnb.storage._layout import DETACHED_MARK, RUN_RECORD, committed_in_index, read_run_record
from rtnb.storage._metricslog import read_metrics
from rtnb.storage._rundir import RunDirectory

__all__ = ["Result", "RunSummary", "list_runs", "read_run_metrics"]


@dataclass
class Result:
    """``metrics``: the mean over ranks of each metric's last value (flat, as in Ray
    Train); ``metrics_per_rank``: each rank's last report; ``metrics_dataframe``:
    every report of every rank, read from the run directory. ``best_checkpoints``:
    (checkpoint, metrics) of every committed checkpoint, oldest first (as Ray Train
    lists the ones it kept); :meth:`get_best_checkpoint` picks from them."""

    path: str
    metrics: dict[str, Any] = field(default_factory=dict)
    metrics_per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    checkpoint: Any = None
    best_checkpoints: list = field(default_factory=list)
    error: BaseException | None = None
    run_name: str = ""
    # What "best" means for this run (--score, or a metric named like a loss or an
    # accuracy); None: no best unless get_best_checkpoint is told a metric.
    score_rule: ScoreRule | None = None
    # The MLflow run the run is mirrored into (--mlflow), if any.
    mlflow_run_id: str | None = None
    # Where to read the run back: ``path`` with its credentials, never shown.
    _location: str | None = field(default=None, repr=False, compare=False)

    @property
    def metrics_dataframe(self):
        import pandas as pd

        rows = read_metrics(_run_dir(self._location or self.path))
        frame = pd.DataFrame(rows)
        if frame.empty:
            return frame
        first = [c for c in ("rank", "step", "timestamp") if c in frame.columns]
        return frame[first + [c for c in frame.columns if c not in first]]

    def get_best_checkpoint(self, metric: str | None = None, mode: str | None = None):
        """The checkpoint with the lowest (``mode="min"``) or highest (``"max"``)
        ``metric``, as in Ray Train; without arguments, by the run's own rule (see
        :mod:`rtnb.core._score`). None when no checkpoint has the metric.

        In [1]: session.result().get_best_checkpoint("loss", "min")
        """
        if metric is None:
            rule = self.score_rule
        elif mode not in ("min", "max"):
            raise ConfigError(f"mode must be 'min' or 'max', got {mode!r}")
        else:
            rule = ScoreRule(metric, mode, ScoreSource.GIVEN)
        best = rule.best(self.best_checkpoints, lambda pair: pair[1]) if rule else None
        return None if best is None else best[0]

    @classmethod
    def of_run(cls, run_dir: RunDirectory, **fields: Any) -> Result:
        """The result of a live run, read back from ``run_dir`` when asked for its
        dataframe."""
        return cls(path=run_dir.uri, _location=run_dir.location, **fields)

    @classmethod
    def from_path(cls, path: str) -> Result:
        """Reload a run's result from its run directory (local path or URI)."""
        run_dir = _run_dir(path)
        record = read_run_record(run_dir)
        if record is None:
            raise ConfigError(f"{path!r} is not an rtnb run directory (no {RUN_RECORD})")
        last: dict[int, dict] = {}
        for row in read_metrics(run_dir):
            last[int(row["rank"])] = row
        per_rank = {
            r: {k: v for k, v in row.items() if k not in ("rank", "timestamp")}
            for r, row in last.items()
        }
        return cls(
            path=path,
            metrics=mean_over_ranks(per_rank),
            metrics_per_rank=per_rank,
            run_name=record.run_name,
            mlflow_run_id=record.mlflow.get("run_id"),
        )

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.metrics.items()
        )
        return f"Result(run={self.run_name!r}, metrics={{{shown}}}, path={self.path!r}, error={self.error!r})"


def _run_dir(path: str) -> RunDirectory:
    location, _, query = path.partition("?")
    if "://" not in location:
        location = os.path.abspath(os.path.expanduser(location))
    base, _, name = location.rstrip("/").rpartition("/")
    return RunDirectory((base or "/") + (f"?{query}" if query else ""), name)


# run.json statuses of a run whose session has its worker group up.
_LIVE = ("starting", "ready", "running", "restarting", "stopping")


@dataclass
class RunSummary:
    name: str
    status: str
    workers: int
    updated: float
    path: str
    started: float = 0.0
    last_step: int = 0  # -1: nothing reported yet
    checkpoints: int = 0
    config: dict = field(default_factory=dict)
    mlflow: dict = field(default_factory=dict)  # the run's MLflow run (run.json)
    detached: bool = False  # a detached group's host runs it (no kernel needed)

    @property
    def mlflow_link(self) -> str:
        """The MLflow run: its page on a tracking server, else its run id."""
        run_id = self.mlflow.get("run_id")
        if not run_id:
            return ""
        uri = str(self.mlflow.get("tracking_uri") or "")
        if uri.startswith(("http://", "https://")) and "***" not in uri:
            experiment = self.mlflow.get("experiment_id", "0")
            return f"{uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"
        return run_id

    @property
    def state(self) -> str:
        """live (a session has its group up), failed, or finished."""
        if self.status in _LIVE:
            return "live"
        return "failed" if self.status == "failed" else "finished"

    @property
    def shown_state(self) -> str:
        """The state as the runs table shows it: a live run a detached group's host
        runs (no kernel needed) says so."""
        return "live, detached" if self.detached and self.state == "live" else self.state

    @property
    def steps(self) -> int:
        """Steps trained on the run's current line (its steps count from 0)."""
        return max(0, self.last_step + 1)

    @property
    def duration_s(self) -> float:
        return max(0.0, self.updated - self.started) if self.started else 0.0


@dataclass
class RunTable:
    storage: str
    runs: list[RunSummary]

    def __str__(self) -> str:
        import time

        if not self.runs:
            return f"no rtnb runs in {redact_uri(self.storage)}"

        def when(t: float) -> str:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"

        rows = [
            [
                "run",
                "status",
                "ranks",
                "started",
                "updated",
                "duration",
                "steps",
                "checkpoints",
                "path",
            ]
        ] + [
            [
                r.name,
                r.status + (" (detached)" if r.detached and r.state == "live" else ""),
                str(r.workers),
                when(r.started),
                when(r.updated),
                format_duration(r.duration_s) if r.started else "-",
                str(r.steps),
                str(r.checkpoints),
                r.path,
            ]
            for r in self.runs
        ]
        return format_table(rows)

    __repr__ = __str__


def list_runs(storage: str) -> RunTable:
    """Every run directory (with a run.json) directly under ``storage``, newest first."""
    from pyarrow import fs as pafs

    probe = RunDirectory(storage, "_")
    base = posixpath.dirname(probe.path.rstrip("/"))
    runs: list[RunSummary] = []
    infos = probe.fs.get_file_info(pafs.FileSelector(base, recursive=False, allow_not_found=True))
    for info in infos:
        if info.type != pafs.FileType.Directory:
            continue
        run_dir = RunDirectory(storage, info.base_name)
        record = read_run_record(run_dir)
        if record is None:
            continue
        runs.append(
            RunSummary(
                name=record.run_name or info.base_name,
                status=record.status,
                workers=record.workers,
                updated=record.updated,
                path=run_dir.uri,
                started=record.started,
                last_step=record.steps_taken_to,
                config=record.config,
                checkpoints=committed_in_index(run_dir),
                mlflow=record.mlflow,
                detached=run_dir.exists(DETACHED_MARK),
            )
        )
    runs.sort(key=lambda r: r.updated, reverse=True)
    return RunTable(storage, runs)


def read_run_metrics(storage: str, run: str) -> list[dict]:
    """Every report of run ``run`` under ``storage`` (live or finished, local or a URI),
    as :func:`read_metrics` rows; one ConfigError line when there is no such run."""
    from rtnb.core._config import check_name

    check_name(run, "run")
    run_dir = RunDirectory(storage, run)
    if not run_dir.exists(RUN_RECORD):
        raise ConfigError(
            f"no run {run!r} in {redact_uri(storage)!r}: `%rtnb runs {redact_uri(storage)}` "
            "lists the runs there"
        )
    return read_metrics(run_dir)
