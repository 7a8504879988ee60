"""The one owner of a session's experiment tracking (``--mlflow``).

At start it opens the run's MLflow run (the one the run record names, so a resumed
or replayed run carries on the same MLflow run; else a new one with the session's
options as parameters) and mirrors every report into it; each committed checkpoint
is copied in as artifacts by a thread of its own (a big checkpoint never holds up
a cell); at stop the notebook (where the kernel knows it) is logged and the MLflow
run ended.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from typing import Any

from rtnb.core._config import SessionConfig
from rtnb.core._redact import redact_uri
from rtnb.errors import ConfigError
from rtnb.metrics._mlflow import MlflowMirror, default_tracking_uri
from rtnb.metrics._store import MetricsStore
from rtnb.storage._checkpoints import CheckpointInfo, CheckpointStore
from rtnb.storage._layout import checkpoint_dir, mlflow_artifacts, mlflow_store, read_run_record
from rtnb.storage._rundir import RunDirectory

__all__ = ["TrackingFlow"]

# Where the kernel's notebook is: Jupyter Server names it for its kernels; `rtnb run`
# names the notebook it executes.
_NOTEBOOK_ENV = ("RTNB_NOTEBOOK", "JPY_SESSION_NAME")


class TrackingFlow:
    def __init__(
        self,
        config: SessionConfig,
        run_name: str,
        run_dir: RunDirectory,
        metrics: MetricsStore,
        checkpoints: CheckpointStore,
    ) -> None:
        self.config = config
        self.run_name = run_name
        self.run_dir = run_dir
        self.metrics = metrics
        self.checkpoints = checkpoints
        self.mirror: MlflowMirror | None = None
        self._unsubscribe = None
        self._uploads: queue.Queue[tuple[str, str] | None] | None = None
        self._uploader: threading.Thread | None = None

    @property
    def record(self) -> dict[str, Any]:
        """What run.json says of the MLflow run (no secret: the URI is masked)."""
        mirror = self.mirror
        if mirror is None:
            return {}
        return {
            "tracking_uri": redact_uri(mirror.tracking_uri),
            "experiment_id": mirror.experiment_id,
            "run_id": mirror.run_id,
        }

    def open(self) -> None:
        if self.config.mlflow is None or self.mirror is not None:
            return
        uri = self.config.mlflow
        artifacts = None
        if not uri:
            if not self.run_dir.is_local:
                raise ConfigError(
                    "--mlflow without a URI keeps its store in the run directory, which "
                    "needs a local --storage: pass a tracking URI (--mlflow http://HOST:5000)"
                )
            uri = default_tracking_uri(mlflow_store(self.run_dir.path))
            artifacts = os.path.abspath(mlflow_artifacts(self.run_dir.path))
        earlier = None
        with contextlib.suppress(Exception):
            earlier = read_run_record(self.run_dir)
        carried = (earlier.mlflow if earlier is not None else {}) or {}
        self.mirror = MlflowMirror(
            uri,
            self.run_name,
            self.config.to_dict(),
            lambda: len(self.metrics.expected_ranks),
            run_id=carried.get("run_id"),
            artifact_location=artifacts,
        )
        self.metrics.add_exporter(self.mirror)
        self._unsubscribe = self.checkpoints.subscribe(self._committed)

    def _committed(self, info: CheckpointInfo) -> None:
        if not self.run_dir.is_local or self.mirror is None:
            return  # object storage: the checkpoint stays where it is, listed by rtnb
        if self._uploads is None:
            self._uploads = queue.Queue()
            self._uploader = threading.Thread(
                target=self._upload, name="rtnb-mlflow-artifacts", daemon=True
            )
            self._uploader.start()
        # In MLflow as in the run directory: checkpoints/<id>/.
        folder = checkpoint_dir(info.id)
        self._uploads.put((os.path.join(self.run_dir.path, folder), folder))

    def _upload(self) -> None:
        assert self._uploads is not None
        while (item := self._uploads.get()) is not None:
            mirror = self.mirror
            if mirror is not None and os.path.isdir(item[0]):
                mirror.log_checkpoint(*item)

    def close(self) -> str | None:
        """End the MLflow run (the notebook logged first); its first error, if any."""
        mirror = self.mirror
        if mirror is None:
            return None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._uploads is not None and self._uploader is not None:
            self._uploads.put(None)
            self._uploader.join(timeout=60)
            self._uploads = self._uploader = None
        notebook = next((os.environ[k] for k in _NOTEBOOK_ENV if os.environ.get(k)), None)
        if notebook and os.path.isfile(notebook):
            mirror.log_notebook(notebook)
        mirror.finish()
        self.mirror = None
        return mirror.error
