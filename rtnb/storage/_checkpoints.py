"""A run's checkpoints in storage: commit (manifest last), list, retention, delete.

Committed manifests never change, so each is read from storage once and kept;
listing a run of a thousand checkpoints costs one directory listing, not a
thousand reads.
"""

from __future__ import annotations

import posixpath
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from rtnb.core._config import check_name
from rtnb.core._messages import CheckpointOffer
from rtnb.core._redact import redact_uri
from rtnb.core._text import enum_member, format_table, mean_over_ranks, to_number
from rtnb.errors import CheckpointError, one_line
from rtnb.storage._checkpoint import MANIFEST, Checkpoint, settle_same_names
from rtnb.storage._layout import (
    CHECKPOINTS,
    RUN_RECORD,
    checkpoint_dir,
    checkpoint_file,
    checkpoint_index,
    read_run_record,
    validation_file,
)
from rtnb.storage._rundir import RunDirectory

__all__ = [
    "CheckpointConsistencyMode",
    "CheckpointInfo",
    "CheckpointStore",
    "ReportedCheckpoint",
    "checkpoint_id",
    "parse_checkpoint_id",
]

_INDEX_EVERY_S = 1.0


_ID = re.compile(r"(?:step-)?(\d{1,18})(?:-b(\d{1,9}))?")


def checkpoint_id(step: int, line: int = 0) -> str:
    """``step-000000120`` on the run's first line; ``step-000000120-b2`` on branch 2
    (a resume from an earlier checkpoint trains a branch whose steps repeat the
    original's, and a committed id is never rewritten). Zero-padded so that
    storage listings sort by step."""
    return f"step-{step:09d}" if not line else f"step-{step:09d}-b{line}"


def parse_checkpoint_id(name: str) -> tuple[int, int] | None:
    """(step, line) of a checkpoint name (``step-000000012``, ``step-12``, ``12``,
    ``step-12-b1``); None when it is not one."""
    found = _ID.fullmatch(name) if name.isascii() else None
    return (int(found.group(1)), int(found.group(2) or 0)) if found else None


def _step_in(name: str) -> int | None:
    parsed = parse_checkpoint_id(name)
    return parsed[0] if parsed else None


@dataclass
class CheckpointInfo:
    """One row of a run's checkpoints. ``status``: ``committed`` (manifest written,
    loadable), ``writing`` (this session is still collecting its shards) or
    ``incomplete`` (no manifest: never offered for loading, removed by cleanup).
    ``line`` is 0 for the run's first line of training, n for branch n (a resume
    from an earlier checkpoint)."""

    id: str
    step: int
    time: float
    metrics: dict[str, Any]
    ranks: list[int]
    files: list[dict] = field(default_factory=list)
    status: str = "committed"
    # report(validation=...): {"status": PENDING_VALIDATION | VALIDATED |
    # VALIDATION_FAILED | VALIDATION_TIMEOUT, "metrics": {...}, "error": "..."}.
    # The manifest records the request (pending); the result is its own file.
    validation: dict[str, Any] | None = None

    @property
    def reported_status(self) -> str:
        """Ray Train's ``ReportedCheckpointStatus`` name for this checkpoint."""
        if self.validation is None:
            return "COMMITTED"
        return str(self.validation.get("status", "PENDING_VALIDATION"))

    @property
    def shown_status(self) -> str:
        """``committed``, with how its validation stands when one was asked for."""
        if self.validation is None or self.status != "committed":
            return self.status
        return {
            "PENDING_VALIDATION": "committed, validating",
            "VALIDATED": "committed, validated",
            "VALIDATION_TIMEOUT": "committed, validation timed out",
        }.get(self.reported_status, "committed, validation failed")

    @property
    def all_metrics(self) -> dict[str, Any]:
        """The reported metrics with the validation's (a validation metric of the
        same name replaces the reported one)."""
        extra = (self.validation or {}).get("metrics") or {}
        return {**self.metrics, **extra}

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.files)

    @property
    def line(self) -> int:
        parsed = parse_checkpoint_id(self.id)
        return parsed[1] if parsed else 0

    @staticmethod
    def table(rows: list[CheckpointInfo]) -> str:
        """``rows`` as an aligned text table: what ``rtnb checkpoints`` prints, and
        ``%rtnb checkpoints`` where no widget can render (papermill, nbclient)."""
        metrics = sorted({k for c in rows for k in c.all_metrics})
        table = [["id", "step", "time", *metrics, "MB", "ranks", "status"]]
        for c in rows:
            table.append(
                [
                    c.id,
                    str(c.step),
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.time)) if c.time else "-",
                ]
                + [
                    f"{c.all_metrics[m]:.4g}"
                    if isinstance(c.all_metrics.get(m), (int, float))
                    else ""
                    for m in metrics
                ]
                + [f"{c.size / 1e6:.1f}", ",".join(map(str, c.ranks)), c.shown_status]
            )
        return format_table(table)


class CheckpointConsistencyMode(str, Enum):
    """What :func:`rtnb.get_all_reported_checkpoints` waits for (Ray Train's names):
    the latest reported checkpoint ``COMMITTED``, or also ``VALIDATED``."""

    COMMITTED = "COMMITTED"
    VALIDATED = "VALIDATED"

    @classmethod
    def named(cls, mode: Any) -> CheckpointConsistencyMode:
        member = enum_member(cls, mode)
        if member is None:
            raise CheckpointError(f"consistency_mode={mode!r} is not one of COMMITTED, VALIDATED")
        return member

    def satisfied_by(self, info: CheckpointInfo | None) -> bool:
        if info is None:
            return False
        return self is CheckpointConsistencyMode.COMMITTED or (
            info.reported_status != "PENDING_VALIDATION"
        )


@dataclass
class ReportedCheckpoint:
    """A committed checkpoint with its metrics (the validation's included) and
    ``status``: Ray Train's ``ReportedCheckpointStatus`` name (``COMMITTED``,
    ``PENDING_VALIDATION``, ``VALIDATED``, ``VALIDATION_TIMEOUT``,
    ``VALIDATION_FAILED``)."""

    checkpoint: Checkpoint
    metrics: dict[str, Any]
    status: str


class CheckpointStore:
    def __init__(
        self,
        run_dir: RunDirectory,
        keep: int | None = None,
        score: str | None = None,
        mode: str = "min",
    ) -> None:
        self.run_dir = run_dir
        self.keep, self.score, self.mode = keep, score, mode
        self.base = posixpath.join(run_dir.path, CHECKPOINTS)
        self._pending: dict[str, dict] = {}
        self._manifests: dict[str, CheckpointInfo] = {}
        self._index_dirty = False
        self._index_at = 0.0
        self._lock = threading.RLock()
        self._subscribers: list[Callable[[CheckpointInfo], None]] = []
        # Ids --keep and delete leave alone besides the newest: the checkpoint the
        # ranks would recover from (a new branch's parent, before it commits).
        self.protected: set[str] = set()
        # Checkpoints committed with a validation request, for the driver to start.
        self.validations_due: list[tuple[CheckpointInfo, Any]] = []

    @classmethod
    def of_run(cls, storage: str, run: str) -> CheckpointStore:
        """The checkpoints of another run in ``storage``, ranked by the ``--score``
        and ``--mode`` it was started with (read only: no ``--keep`` applied)."""
        run_dir = RunDirectory(storage, check_name(run, "--run"))
        if not run_dir.exists(RUN_RECORD):
            raise CheckpointError(f"no run {run!r} in {redact_uri(storage)} (see `%rtnb runs`)")
        try:
            record = read_run_record(run_dir)
        except (OSError, ValueError, TypeError):
            record = None  # its checkpoints are still there to browse
        options = record.config if record is not None else {}
        return cls(run_dir, score=options.get("score"), mode=options.get("mode") or "min")

    def subscribe(self, callback: Callable[[CheckpointInfo], None]) -> Callable[[], None]:
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    # ---- commit ------------------------------------------------------------------------
    def offer(self, rank: int, offer: CheckpointOffer) -> None:
        """A rank's files for the checkpoint at ``offer.step`` are in storage."""
        with self._lock:
            entry = self._pending.setdefault(
                checkpoint_id(offer.step, offer.line),
                {"step": offer.step, "time": offer.time, "ranks": {}, "metrics": {}},
            )
            entry["ranks"][rank] = offer.files
            entry["metrics"][rank] = offer.metrics
            entry["time"] = max(entry["time"], offer.time)
            if offer.validation is not None:
                entry["validation"] = offer.validation

    def commit_ready(self, last_steps: dict[int, int], expected: set[int]) -> list[CheckpointInfo]:
        """Commit every pending checkpoint whose step all expected ranks have passed
        (so every rank that saves at that step has uploaded)."""
        if not self._pending or not expected or any(r not in last_steps for r in expected):
            return []
        floor = min(last_steps[r] for r in expected)
        committed = []
        with self._lock:
            for cid in sorted(self._pending):
                if self._pending[cid]["step"] <= floor:
                    try:
                        committed.append(self._commit(cid, self._pending.pop(cid)))
                    except CheckpointError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - storage errors of any kind
                        # Storage refuses writes: what waits for a commit is dropped (its
                        # files stay an incomplete folder, never listed, cleaned up later).
                        self._pending.clear()
                        raise OSError(
                            f"checkpoint {cid} could not be committed to "
                            f"{self.run_dir.shown(checkpoint_dir(cid))} ({one_line(exc)})"
                        ) from None
        return committed

    def _commit(self, cid: str, entry: dict) -> CheckpointInfo:
        mean = mean_over_ranks(entry["metrics"])
        files = []
        for rank, rank_files in sorted(entry["ranks"].items()):
            files.extend({**f, "rank": rank} for f in rank_files)
        if len({(f.get("at"), f["path"]) for f in files}) < len(files):
            folder = posixpath.join(self.run_dir.path, checkpoint_dir(cid))
            files = settle_same_names(files, self.run_dir.fs, folder)
        request = entry.get("validation")
        info = CheckpointInfo(
            id=cid,
            step=entry["step"],
            time=entry["time"],
            metrics=mean,
            ranks=sorted(entry["ranks"]),
            files=files,
            validation={"status": "PENDING_VALIDATION"} if request is not None else None,
        )
        manifest = checkpoint_file(cid, MANIFEST)
        if cid in self._manifests or self.run_dir.exists(manifest):
            # Never rewrite a committed checkpoint: its files were verified as they are.
            raise CheckpointError(
                f"checkpoint {cid} is already committed and is never rewritten; report "
                "later steps (pass step= larger than every step saved so far)"
            )
        # The manifest is written last: its presence is what makes the checkpoint real.
        self.run_dir.write_json(manifest, asdict(info))
        self._manifests[cid] = info
        if request is not None:
            self.validations_due.append((info, request))
        try:
            self._index_dirty = True
            if not self._apply_retention() and time.monotonic() - self._index_at >= _INDEX_EVERY_S:
                self.write_index()
        except Exception as exc:  # noqa: BLE001 - storage errors of any kind
            raise CheckpointError(
                f"checkpoint {cid} is committed, but updating {checkpoint_index()} or "
                f"applying --keep failed: {one_line(exc)}"
            ) from None
        for callback in list(self._subscribers):
            try:
                callback(info)
            except Exception:  # noqa: BLE001
                pass
        return info

    # ---- listing -----------------------------------------------------------------------
    def list(self, include_incomplete: bool = False) -> list[CheckpointInfo]:
        from pyarrow import fs as pafs

        fs = self.run_dir.fs
        found: list[CheckpointInfo] = []
        infos = fs.get_file_info(
            pafs.FileSelector(self.base, recursive=False, allow_not_found=True)
        )
        for folder in sorted(
            (i for i in infos if i.type == pafs.FileType.Directory), key=lambda i: i.base_name
        ):
            info = self._manifest(folder.base_name)
            if info is not None:
                found.append(info)
            else:
                if include_incomplete:
                    step = _step_in(folder.base_name)
                    found.append(
                        CheckpointInfo(
                            id=folder.base_name,
                            step=-1 if step is None else step,
                            time=0.0,
                            metrics={},
                            ranks=[],
                            # shards still uploading in this session, or left by a crash
                            status="writing" if folder.base_name in self._pending else "incomplete",
                        )
                    )
        return sorted(found, key=lambda c: (c.status != "committed", c.step, c.line))

    def _manifest(self, cid: str) -> CheckpointInfo | None:
        info = self._manifests.get(cid)
        if info is None:
            try:
                record = self.run_dir.read_json(checkpoint_file(cid, MANIFEST))
                info = self._manifests[cid] = CheckpointInfo(**record)
            except (FileNotFoundError, OSError, ValueError, TypeError):
                return None
        if info.reported_status == "PENDING_VALIDATION":
            # Its result is written once, by whoever ran the validation: read until then.
            try:
                info.validation = self.run_dir.read_json(validation_file(cid))
            except (FileNotFoundError, OSError, ValueError):
                pass
        return info

    def info(self, cid: str) -> CheckpointInfo | None:
        """Checkpoint ``cid``'s row once committed (its validation read again until
        it is done); None before."""
        return self._manifest(cid)

    def reported(self) -> list[ReportedCheckpoint]:
        """Every committed checkpoint, oldest first, as ``get_all_reported_checkpoints``
        returns them."""
        return [
            ReportedCheckpoint(
                Checkpoint(posixpath.join(self.base, c.id), self.run_dir.fs, asdict(c)),
                c.all_metrics,
                c.reported_status,
            )
            for c in sorted(self.list(), key=lambda c: (c.time, c.step))
            if c.status == "committed"
        ]

    def record_validation(self, cid: str, result: dict[str, Any]) -> None:
        """Keep a validation's result (status, metrics or error) for checkpoint ``cid``."""
        self.run_dir.write_json(validation_file(cid), result)
        info = self._manifests.get(cid)
        if info is not None:
            info.validation = result
        for callback in list(self._subscribers):
            try:
                callback(info or self._manifest(cid))
            except Exception:  # noqa: BLE001
                pass

    def latest(self, line: int | None = None) -> CheckpointInfo | None:
        """The newest committed checkpoint of ``line`` (its highest step), or of the
        whole run (the one committed last) when ``line`` is None."""
        committed = [c for c in self.list() if c.status == "committed"]
        if line is not None:
            committed = [c for c in committed if c.line == line]
            return committed[-1] if committed else None
        return _newest(committed)

    def lines(self) -> set[int]:
        return {c.line for c in self.list(include_incomplete=True)}

    def get(self, cid: str) -> Checkpoint:
        """The committed checkpoint ``cid``: an id (``step-000000012``), a step
        (``12`` or ``step-12``) or ``latest``."""
        cid = str(cid)
        parsed = parse_checkpoint_id(cid)
        if parsed is not None:
            cid = self._resolve(*parsed, exact="-b" in cid)
        if cid == "latest":
            info = self.latest()
            if info is None:
                raise CheckpointError("this run has no committed checkpoint yet")
            cid = info.id
        if _step_in(cid) is None:
            # Also what keeps a typed name from reaching outside checkpoints/.
            raise CheckpointError(
                f"{cid!r} is not a checkpoint id: use latest, a step (12) or an id "
                "(step-000000012); see `%rtnb checkpoints`"
            )
        try:
            record = self.run_dir.read_json(checkpoint_file(cid, MANIFEST))
        except (FileNotFoundError, OSError, ValueError):
            known = ", ".join(c.id for c in self.list()) or "none"
            raise CheckpointError(
                f"no committed checkpoint {cid!r} in this run (committed: {known})"
            ) from None
        return Checkpoint(posixpath.join(self.base, cid), self.run_dir.fs, manifest=record)

    def _resolve(self, step: int, line: int, exact: bool) -> str:
        """The id a typed step names: the first line's checkpoint at that step, else
        the one branch that has it (several: the user must say which)."""
        cid = checkpoint_id(step, line)
        if exact or self._manifest(cid) is not None:
            return cid
        others = [c.id for c in self.list() if c.step == step and c.status == "committed"]
        if len(others) > 1:
            raise CheckpointError(
                f"step {step} has a checkpoint on several lines ({', '.join(others)}): "
                "name one of them"
            )
        return others[0] if others else cid

    # ---- retention ---------------------------------------------------------------------
    def write_index(self) -> None:
        """Rewrite ``checkpoints/index.json`` (a summary for people and tools; the
        manifests are the truth). Commits rewrite it at most once a second; the end
        of a cell writes the last state."""
        self._index_dirty = False
        self._index_at = time.monotonic()
        self.run_dir.write_json(
            checkpoint_index(),
            {"checkpoints": [asdict(c) for c in self.list()], "updated": time.time()},
        )

    def flush_index(self) -> None:
        if self._index_dirty:
            self.write_index()

    def _apply_retention(self) -> bool:
        """Delete what --keep does not keep; True when the index was rewritten."""
        if self.keep is None:
            return False
        committed = [c for c in self.list() if c.status == "committed"]
        if len(committed) <= self.keep:
            return False
        latest = _newest(committed)
        if self.score:
            sign = 1 if self.mode == "min" else -1
            ranked = sorted(
                committed,
                key=lambda c: (
                    to_number(c.all_metrics.get(self.score)) is None,
                    sign * (to_number(c.all_metrics.get(self.score)) or 0.0),
                ),
            )
        else:
            ranked = sorted(committed, key=lambda c: (-c.time, -c.step))
        keep_ids = {c.id for c in ranked[: self.keep]} | {latest.id} | self.protected
        # A checkpoint still being validated is ranked once its metrics are in.
        doomed = [
            c
            for c in committed
            if c.id not in keep_ids and c.reported_status != "PENDING_VALIDATION"
        ]
        for info in doomed:
            self.delete(info.id, _index=False)
        self.write_index()
        return True

    def delete(self, cid: str, _index: bool = True) -> None:
        """Delete a committed checkpoint (never the latest one)."""
        if _step_in(cid) is None or self._manifest(cid) is None:
            raise CheckpointError(f"no committed checkpoint {cid!r} in this run to delete")
        latest = self.latest()
        if latest is not None and latest.id == cid:
            raise CheckpointError(f"{cid} is the latest checkpoint of the run and is kept")
        if cid in self.protected:
            raise CheckpointError(
                f"{cid} is what the ranks would restart from (the current branch has no "
                "checkpoint of its own yet) and is kept"
            )
        folder = posixpath.join(self.base, cid)
        self._manifests.pop(cid, None)
        # Manifest first: a half-deleted checkpoint must never look committed.
        try:
            self.run_dir.fs.delete_file(posixpath.join(folder, MANIFEST))
        except (FileNotFoundError, OSError):
            pass
        self.run_dir.fs.delete_dir(folder)
        if _index:
            self.write_index()

    def drop_pending(self) -> None:
        """Forget half-offered checkpoints (their ranks died): they will never commit."""
        with self._lock:
            self._pending.clear()

    def cleanup_incomplete(self) -> list[str]:
        """Delete checkpoint directories that never got a manifest (and are not pending)."""
        removed = []
        for info in self.list(include_incomplete=True):
            if info.status == "incomplete" and info.id not in self._pending:
                try:
                    self.run_dir.fs.delete_dir(posixpath.join(self.base, info.id))
                except (FileNotFoundError, OSError):
                    continue
                removed.append(info.id)
        return removed


def _newest(committed: list[CheckpointInfo]) -> CheckpointInfo | None:
    """The checkpoint committed last (by its report time): after a resume from an
    earlier checkpoint, the branch's, not the original line's highest step."""
    return max(committed, key=lambda c: (c.time, c.step)) if committed else None
