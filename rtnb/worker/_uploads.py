"""A rank's checkpoint uploads that run beside its training loop.

``report(..., checkpoint_upload_mode=ASYNC)`` (and every ``Checkpoint.from_state``,
whose files only rtnb holds) queues the checkpoint here and returns: one thread
per rank copies the queued checkpoints into the run, oldest first, while the loop
goes on. The rank's published step stays below the oldest checkpoint still in
flight, so the driver commits checkpoints in order and never one whose files are
still on their way (a rank killed mid-upload leaves a folder without a manifest,
which is never listed).

At most ``limit`` checkpoints are in flight: a report that would queue one more
waits for the oldest to land (backpressure), and the time it waited is published so
the notebook can say once that uploads fall behind. The limit bounds the local disk
the snapshots hold, as well as how far "latest" can trail the loop.

Every method is called with the runtime's condition held, except ``run`` (the
upload thread), which takes it to publish.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rtnb.core._text import enum_member

__all__ = [
    "DEFAULT_LIMIT",
    "CheckpointUploadMode",
    "CheckpointUploads",
    "SaveOptions",
    "Upload",
    "limit_from_env",
]


class CheckpointUploadMode(Enum):
    """How ``report(checkpoint=...)`` moves a checkpoint into the run (Ray Train's
    names): ``SYNC`` before ``report`` returns, ``ASYNC`` beside the loop,
    ``NO_UPLOAD`` not at all (the files are where ``checkpoint_upload_fn`` or the
    cell put them; rtnb only records and commits them)."""

    SYNC = "SYNC"
    ASYNC = "ASYNC"
    NO_UPLOAD = "NO_UPLOAD"

    @classmethod
    def named(cls, mode: Any) -> CheckpointUploadMode:
        """``mode`` as given: this enum, Ray Train's, or its name as a string."""
        member = enum_member(cls, mode)
        if member is None:
            raise ValueError(
                f"checkpoint_upload_mode={mode!r} is not one of SYNC, ASYNC, NO_UPLOAD"
            )
        return member

    def default_delete_local_checkpoint_after_upload(self) -> bool:
        return self is CheckpointUploadMode.ASYNC


@dataclass(frozen=True)
class SaveOptions:
    """How ``report`` saves its checkpoint: the upload mode (None: ``ASYNC`` for
    rtnb's own temp files, ``SYNC`` for a folder of the user's), the user's
    ``checkpoint_upload_fn(checkpoint, destination) -> Checkpoint``, and the
    validation to run once the checkpoint is committed."""

    mode: CheckpointUploadMode | None = None
    upload_fn: Callable[[Any, str], Any] | None = None
    validation: Any = None
    # delete_local_checkpoint_after_upload: the user gives the folder up.
    delete_local: bool = False

    def mode_for(self, checkpoint: Any) -> CheckpointUploadMode:
        if self.mode is not None:
            return self.mode
        if getattr(checkpoint, "_temporary", False):
            return CheckpointUploadMode.ASYNC
        return CheckpointUploadMode.SYNC


# Two: one landing while the next is written, as a double buffer; more only helps
# when uploads are burstier than the loop, and each costs a checkpoint of local disk.
DEFAULT_LIMIT = 2
LIMIT_ENV = "RTNB_UPLOADS_IN_FLIGHT"


def limit_from_env() -> int:
    raw = os.environ.get(LIMIT_ENV, "")
    try:
        return max(1, int(raw)) if raw else DEFAULT_LIMIT
    except ValueError:
        return DEFAULT_LIMIT


@dataclass
class Upload:
    """One checkpoint on its way into the run: ``copy()`` returns its file list."""

    step: int
    when: float
    metrics: dict[str, Any]
    line: int
    copy: Callable[[], list[dict]]
    validation: Any = None  # a ValidationRequest, offered with the files
    # Run once the copy ended, landed or not (removing the user's folder when asked).
    after: Callable[[], None] = field(default=lambda: None)


class CheckpointUploads:
    def __init__(
        self,
        cond: threading.Condition,
        landed: Callable[[Upload, list[dict]], None],
        failed: Callable[[Upload, BaseException], None],
        limit: int = DEFAULT_LIMIT,
    ) -> None:
        self._cond = cond
        self._landed = landed
        self._failed = failed
        self.limit = limit
        self._queue: deque[Upload] = deque()
        self._thread: threading.Thread | None = None
        # Seconds reports waited for room, in all (published with each poll), and
        # since when the report now waiting (if one) has.
        self._waited_s = 0.0
        self._waiting_since: float | None = None

    # ---- with the runtime's condition held -------------------------------------------
    def lowest_step(self) -> int | None:
        """The oldest step whose files are still on their way."""
        return self._queue[0].step if self._queue else None

    @property
    def waited_s(self) -> float:
        """Seconds reports have waited for room, the wait going on included."""
        since = self._waiting_since
        return self._waited_s + (time.monotonic() - since if since is not None else 0.0)

    def steps(self) -> tuple[int, ...]:
        return tuple(u.step for u in self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, upload: Upload, stopping: Callable[[], bool]) -> None:
        """Queue ``upload``; with ``limit`` in flight, wait for the oldest to land
        first (unless a stop came: the stop's own wait covers what is in flight)."""
        if len(self._queue) >= self.limit:
            self._waiting_since = time.monotonic()
            try:
                while len(self._queue) >= self.limit and not stopping():
                    self._cond.wait(0.05)
            finally:
                self._waited_s += time.monotonic() - self._waiting_since
                self._waiting_since = None
        self._queue.append(upload)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self.run, name="rtnb-upload", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every queued checkpoint landed (or failed)."""
        while self._queue:
            self._cond.wait(0.05)

    def drop(self) -> list[int]:
        """Forget the checkpoints not yet started (storage refused this rank's files):
        their snapshots go, the one being copied finishes; the steps dropped."""
        dropped = []
        while len(self._queue) > 1:
            upload = self._queue.pop()
            dropped.append(upload.step)
            upload.after()
        return sorted(dropped)

    # ---- the upload thread -------------------------------------------------------------
    def run(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._thread = None
                    return
                upload = self._queue[0]
            files: list[dict] | None = None
            error: BaseException | None = None
            try:
                files = upload.copy()
            except BaseException as exc:  # noqa: BLE001 - reported to the cell, not lost
                error = exc
            finally:
                upload.after()
            with self._cond:
                # Published before it leaves the queue: a poll in between sees the
                # offer with the step still held back, never the step without it.
                if error is None and files is not None:
                    self._landed(upload, files)
                else:
                    self._failed(upload, error or RuntimeError("upload ended without files"))
                self._queue.popleft()
                self._cond.notify_all()
