"""Where everything of a run lives in its run directory, and its run record.

Every path of a run comes from here (as Ray Train's ``StorageContext``): the driver,
the ranks, the batch runner and the readers of finished runs all name files through
these functions, relative to the run directory ``{storage}/{run}/``::

    run.json                    the run record (RunRecord)
    checkpoints/{id}/           a checkpoint's files; _manifest.json written last
    checkpoints/{id}/state-rank{r}.pt   Checkpoint.from_state: each rank's state
    checkpoints/index.json      a summary of the checkpoints for people and tools
    metrics/rank-{r}/           each rank's reports (append-log chunks)
    logs/rank-{r}/              each rank's printed lines
    journal/                    the run journal (write-ahead; replay reads it)
    journal/ahead-{ns}-{pid}.jsonl   the lines written ahead (on object storage: in
                                this machine's RTNB_HOME/journal-spool/{hash}/ instead)
    tensorboard/                TensorBoard event files (--tensorboard)
    notebooks/                  the output notebooks of `rtnb run` / `rtnb submit`

and a sweep's folder ``{storage}/{sweep}/`` holds ``sweep.json`` (SWEEP_RECORD) beside
its trials' run directories.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "CHECKPOINTS",
    "JOURNAL",
    "LOGS",
    "JOURNAL_SPOOL",
    "MANIFEST",
    "METRICS",
    "SYSTEM_METRICS",
    "RUN_RECORD",
    "RunRecord",
    "SWEEP_RECORD",
    "checkpoint_dir",
    "checkpoint_file",
    "checkpoint_index",
    "committed_in_index",
    "is_journal_ahead",
    "journal_ahead_file",
    "notebook",
    "rank_file",
    "rank_folder",
    "read_run_record",
    "state_file",
    "state_file_rank",
    "profile_rank_trace",
    "profile_trace",
    "tensorboard_dir",
    "validation_file",
    "write_run_record",
    "DETACHED_MARK",
]

RUN_RECORD = "run.json"
CHECKPOINTS = "checkpoints"
METRICS = "metrics"
# What each rank's process used (CPU, memory, GPU): kept apart from the training
# metrics, which readers take step by step.
SYSTEM_METRICS = "metrics/system"
LOGS = "logs"
JOURNAL = "journal"
TENSORBOARD = "tensorboard"
MLFLOW_STORE = "mlflow.db"  # --mlflow without a URI: its SQLite store
MLFLOW_ARTIFACTS = "mlflow-artifacts"
NOTEBOOKS = "notebooks"
PROFILES = "profiles"  # %rtnb profile: each rank's trace and the merged one
# A checkpoint's validation result (report(validation=...)): apart from the
# checkpoint's own folder, whose files the manifest fixes once committed.
VALIDATIONS = "validations"
_INDEX = "index.json"
# This machine's copy of the lines a run on object storage writes ahead (under
# RTNB_HOME): object stores cannot append.
JOURNAL_SPOOL = "journal-spool"
_AHEAD = "ahead-"
_STATE_PREFIX, _STATE_SUFFIX = "state-rank", ".pt"
SWEEP_RECORD = "sweep.json"
# Present while a detached group's host runs the run (%rtnb start --detached): who
# holds it is the host's to say; the runs table shows the run as detached.
DETACHED_MARK = "detached.json"
# In a checkpoint's folder, written last: a folder without it is not a checkpoint.
MANIFEST = "_manifest.json"
# 1: the first versioned record (earlier ones had no version field and are read the
# same way; those without "line" counted steps from 1).
RUN_RECORD_VERSION = 1


def checkpoint_dir(checkpoint_id: str) -> str:
    return posixpath.join(CHECKPOINTS, checkpoint_id)


def checkpoint_file(checkpoint_id: str, name: str) -> str:
    return posixpath.join(CHECKPOINTS, checkpoint_id, name)


def validation_file(checkpoint_id: str) -> str:
    return posixpath.join(VALIDATIONS, checkpoint_id + ".json")


def checkpoint_index() -> str:
    return posixpath.join(CHECKPOINTS, _INDEX)


def committed_in_index(run_dir) -> int:
    """How many committed checkpoints ``checkpoints/index.json`` of ``run_dir`` (a
    RunDirectory) lists: 0 when it has none or it cannot be read (it is a summary;
    the manifests are the truth)."""
    try:
        if not run_dir.exists(checkpoint_index()):
            return 0
        index = run_dir.read_json(checkpoint_index())
    except (OSError, ValueError):
        return 0
    return sum(1 for c in index.get("checkpoints", []) if c.get("status") == "committed")


def state_file(rank: int) -> str:
    """The file ``Checkpoint.from_state`` saves a rank's state in, in a checkpoint."""
    return f"{_STATE_PREFIX}{rank}{_STATE_SUFFIX}"


def state_file_rank(name: str) -> int | None:
    """The rank whose state file ``name`` is; None when it is not one."""
    if not (name.startswith(_STATE_PREFIX) and name.endswith(_STATE_SUFFIX)):
        return None
    number = name[len(_STATE_PREFIX) : -len(_STATE_SUFFIX)]
    return int(number) if number.isdigit() else None


def journal_ahead_file(now_ns: int, pid: int) -> str:
    """A writer's file of journal lines written ahead: one per process, in order."""
    return f"{_AHEAD}{now_ns}-{pid}.jsonl"


def is_journal_ahead(name: str) -> bool:
    return name.startswith(_AHEAD)


def profile_rank_trace(profile_id: str, rank: int) -> str:
    """One rank's trace of a profile: ``profiles/{id}/rank-N.json``."""
    return f"{PROFILES}/{profile_id}/rank-{rank}.json"


def profile_trace(profile_id: str) -> str:
    """A profile's merged trace, every rank in it: ``profiles/{id}/trace.json``."""
    return f"{PROFILES}/{profile_id}/trace.json"


def rank_file(rank: int, suffix: str) -> str:
    """A rank's append-only file in a local metrics or logs folder."""
    return f"rank-{rank}{suffix}"


def rank_folder(rank: int) -> str:
    """A rank's folder of numbered chunks in an object store's metrics or logs folder."""
    return f"rank-{rank}"


def notebook(name: str) -> str:
    return posixpath.join(NOTEBOOKS, name)


def mlflow_store(run_path: str) -> str:
    """The SQLite file ``--mlflow`` without a URI keeps the run's tracking in."""
    return posixpath.join(run_path, MLFLOW_STORE)


def mlflow_artifacts(run_path: str) -> str:
    return posixpath.join(run_path, MLFLOW_ARTIFACTS)


def tensorboard_dir(run_path: str) -> str:
    """The TensorBoard folder under a run directory's filesystem path."""
    return posixpath.join(run_path, TENSORBOARD)


@dataclass
class RunRecord:
    """``run.json``: what a run directory says of its run. Written by the session that
    holds the run (at its start, each state change and each training cell's end);
    read by ``list_runs``, ``Result.from_path``, the CLI and a session carrying the
    run on. ``line``/``last_step``/``branches`` are where training was (see
    ``CheckpointCoordinator``); ``line`` is None in records written before lines
    were recorded."""

    run_name: str = ""
    status: str = "?"
    config: dict[str, Any] = field(default_factory=dict)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    started: float = 0.0
    updated: float = 0.0
    line: int | None = None
    last_step: int = -1
    branches: dict[str, Any] = field(default_factory=dict)
    # The MLflow run this run is mirrored into (tracking_uri masked, run_id), if any.
    mlflow: dict[str, Any] = field(default_factory=dict)
    version: int = RUN_RECORD_VERSION

    @property
    def workers(self) -> int:
        return int(self.config.get("workers", 0) or 0)

    @property
    def steps_taken_to(self) -> int:
        """The last step, counted from 0 (records without lines counted from 1)."""
        return self.last_step - (self.line is None)

    def to_json(self) -> dict[str, Any]:
        # Shallow: its values are plain already (JSON-ready dicts and lists), and a
        # training cell writes the record at its end (asdict's deep copy was most
        # of that write's ~0.5 ms).
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> RunRecord:
        known = {f.name for f in fields(cls)}
        record = cls(**{k: v for k, v in payload.items() if k in known})
        record.started = float(record.started or 0.0)
        record.updated = float(record.updated or 0.0)
        record.last_step = int(record.last_step if record.last_step is not None else -1)
        record.line = None if record.line is None else int(record.line)
        record.config = dict(record.config or {})
        record.branches = dict(record.branches or {})
        record.mlflow = dict(record.mlflow or {})
        return record


def read_run_record(run_dir) -> RunRecord | None:
    """The run record of ``run_dir`` (a RunDirectory), or None when it has none."""
    if not run_dir.exists(RUN_RECORD):
        return None
    return RunRecord.from_json(run_dir.read_json(RUN_RECORD))


def write_run_record(run_dir, record: RunRecord) -> None:
    run_dir.write_json(RUN_RECORD, record.to_json())
