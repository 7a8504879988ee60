"""Mirrors a run into an MLflow run: its options, every report, its checkpoints.

Every report goes to MLflow as ``NAME/rankN`` and, once every rank of the cell has
reported a step, the mean across ranks as ``NAME`` (what the live plot draws as
the mean). Metrics are sent in batches (MLflow's ``log_batch``) at most every
``_FLUSH_S`` seconds and at each cell's end, from a thread of the kernel's own:
nothing runs on the ranks or on the thread that drives a cell, so a slow tracking
server delays no report, stop or commit, and one that goes away costs the training
nothing (the first error is kept and said once). The run's end waits for what is
still unsent, up to ``_DRAIN_S``.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rtnb.core._redact import redact_text, redact_uri
from rtnb.core._text import to_number
from rtnb.errors import ConfigError, one_line

__all__ = ["EXPERIMENT", "MlflowMirror", "default_tracking_uri"]

EXPERIMENT = "rtnb"
_FLUSH_S = 2.0
_DRAIN_S = 60.0
_BATCH = 1000  # MLflow's most metrics per log_batch
_PARAM_CHARS = 6000
_NOT_A_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


def default_tracking_uri(store_path: str) -> str:
    """The URI of a SQLite store at ``store_path`` (MLflow's file store is in
    maintenance mode and refuses to start by default)."""
    return "sqlite:///" + os.path.abspath(store_path)


@contextlib.contextmanager
def _no_retries() -> Iterator[None]:
    """MLflow's REST client retries a refused connection for minutes by default;
    an unreachable server must be one line at start, in seconds."""
    saved = {
        k: os.environ.get(k)
        for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    }
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "5"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """MLflow and alembic log each table they create at INFO: not for the notebook."""
    import logging

    loggers = [logging.getLogger(name) for name in ("mlflow", "alembic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


class MlflowMirror:
    """One rtnb run as one MLflow run (``run_id`` given: that run, carried on)."""

    def __init__(
        self,
        tracking_uri: str,
        run_name: str,
        params: dict[str, Any],
        expected_ranks: Callable[[], int],
        run_id: str | None = None,
        artifact_location: str | None = None,
    ) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError(
                "--mlflow needs the mlflow package: pip install mlflow-skinny"
            ) from None
        self.tracking_uri = tracking_uri
        where = redact_uri(tracking_uri)
        try:
            with _no_retries(), _quiet_logs():
                client = MlflowClient(tracking_uri)
                experiment = client.get_experiment_by_name(EXPERIMENT)
                experiment_id = (
                    experiment.experiment_id
                    if experiment is not None
                    else client.create_experiment(EXPERIMENT, artifact_location=artifact_location)
                )
                run = None
                if run_id is not None:
                    with contextlib.suppress(Exception):  # deleted, or another store's id
                        run = client.get_run(run_id)
                if run is not None:
                    client.update_run(run_id, status="RUNNING")
                else:
                    run = client.create_run(
                        experiment_id, run_name=run_name, tags={"rtnb.run": run_name}
                    )
                    self._log_params(client, run.info.run_id, params)
        except Exception as exc:  # noqa: BLE001 - any store or server failure, in one line
            raise ConfigError(
                f"MLflow at {where} cannot be used ({_reason(exc)}): start its server, or "
                "pass another --mlflow URI (without one, a store in the run directory)"
            ) from None
        self.client = client
        self.run_id: str = run.info.run_id
        self.experiment_id: str = experiment_id
        self.continued = run_id is not None and run.info.run_id == run_id
        self._expected = expected_ranks
        self._lock = threading.Lock()
        self._pending: list[Any] = []
        # A step's values so far, each with its rank's time of the report.
        self._steps: dict[tuple[str, int], list[tuple[float, int]]] = {}
        self._flushed_at = time.monotonic()
        self.error: str | None = None
        self._wake = threading.Event()
        self._closing = False
        self._sender = threading.Thread(target=self._send_loop, name="rtnb-mlflow", daemon=True)
        self._sender.start()

    @staticmethod
    def _log_params(client, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        batch = [
            Param(_key(name), str(value)[:_PARAM_CHARS])
            for name, value in sorted(params.items())
            if value not in (None, "", [], {})
        ]
        for start in range(0, len(batch), 100):
            client.log_batch(run_id, params=batch[start : start + 100])

    # ---- the MetricsStore exporter interface ---------------------------------------------
    def add(self, rank: int, records: list[tuple[int, float, dict]]) -> None:
        from mlflow.entities import Metric

        expected = max(1, self._expected())
        with self._lock:
            for step, timestamp, metrics in records:
                millis = int(timestamp * 1000)
                for name, raw in metrics.items():
                    value = to_number(raw)
                    if value is None or name == "step":
                        continue
                    key = _key(name)
                    self._pending.append(Metric(f"{key}/rank{rank}", value, millis, int(step)))
                    if expected > 1:
                        seen = self._steps.setdefault((key, int(step)), [])
                        seen.append((value, millis))
                        if len(seen) >= expected:
                            del self._steps[(key, int(step))]
                            # Stamped with the step's latest report, not the one that
                            # arrived last: ranks' batches arrive out of step, and
                            # MLflow lists a history by time, so the mean's steps
                            # keep their order only with a time that grows with them.
                            mean = sum(v for v, _ in seen) / len(seen)
                            latest = max(t for _, t in seen)
                            self._pending.append(Metric(key, mean, latest, int(step)))
            due = time.monotonic() - self._flushed_at >= _FLUSH_S
        if due:
            self._wake.set()

    def flush(self) -> None:
        """Have what is pending sent now (by the sender; this returns at once)."""
        self._wake.set()

    def close(self) -> None:
        self.flush()

    def _send_loop(self) -> None:
        while True:
            self._wake.wait(_FLUSH_S)
            self._wake.clear()
            closing = self._closing
            self._send_pending()
            if closing:
                return

    def _send_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._flushed_at = time.monotonic()
            if len(self._steps) > 100_000:  # ranks that never caught up: no mean for them
                self._steps.clear()
        for start in range(0, len(pending), _BATCH):
            self._call(self.client.log_batch, self.run_id, metrics=pending[start : start + _BATCH])

    # ---- the rest of the run -------------------------------------------------------------
    def log_checkpoint(self, local_dir: str, artifact_path: str) -> None:
        self._call(self.client.log_artifacts, self.run_id, local_dir, artifact_path)

    def log_notebook(self, path: str) -> None:
        self._call(self.client.log_artifact, self.run_id, path, "notebook")

    def finish(self) -> None:
        """Send what is still pending (waiting up to ``_DRAIN_S`` for the server),
        then end the MLflow run."""
        self._closing = True
        self._wake.set()
        self._sender.join(timeout=_DRAIN_S)
        if self._sender.is_alive():
            if self.error is None:
                self.error = (
                    f"MLflow at {redact_uri(self.tracking_uri)} took over {_DRAIN_S:g} s to "
                    "take the run's last metrics; some may be missing there"
                )
            return
        self._call(self.client.set_terminated, self.run_id)

    def _call(self, method: Callable, *args: Any, **kwargs: Any) -> None:
        try:
            method(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            if self.error is None:
                self.error = f"MLflow at {redact_uri(self.tracking_uri)}: {_reason(exc)}"


def _reason(exc: BaseException) -> str:
    """The gist of an MLflow error, credentials masked (its messages quote the URL)."""
    text = one_line(exc)
    if "NewConnectionError" in text or "Max retries exceeded" in text:
        return "nothing answers there"
    return redact_text(text)


def _key(name: str) -> str:
    return _NOT_A_KEY.sub("_", str(name))[:250] or "_"
