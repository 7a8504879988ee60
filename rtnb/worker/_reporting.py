"""A rank's reports and checkpoints, a part of its runtime: ``rtnb.report()``'s
path (its hot case also recorded in C, rtnb/worker/_fastreport.c, into this object's
fields), the step and line of training, each checkpoint's placement in the run
directory (now, or uploading beside the loop), and the checkpoint a cell's
``get_checkpoint()`` hands out.

The report boundary is where work waits (a stop, a live change's hold, a trigger):
``_stop_requested`` says so to the C path, which then leaves the report to Python.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rtnb.core._messages import CellRequest, CheckpointOffer
from rtnb.core._reports import ReportColumns
from rtnb.worker._debug import DebugStopped
from rtnb.worker._stopping import CellStopped, RankStop
from rtnb.worker._uploads import (
    CheckpointUploadMode,
    CheckpointUploads,
    SaveOptions,
    Upload,
    limit_from_env,
)

if TYPE_CHECKING:
    from rtnb.worker._controls import RankControls

__all__ = ["RankReports", "current_reports"]

# The reports of the rank in this process: what rtnb.report's C path records into
# (it reads this module's namespace; see rtnb.worker._api).
_CURRENT: RankReports | None = None
_now = time.time


def current_reports() -> RankReports | None:
    return _CURRENT


class RankReports:
    """The rank's report buffer, step, line and checkpoint offers, under the
    runtime's condition; asks the stop part to wait at a boundary, the controls to
    fire what is due, and the profiler whether it records."""

    def __init__(
        self,
        cond: threading.Condition,
        rank: int,
        storage_path: str,
        run_name: str,
        stop: RankStop,
        controls: RankControls,
        recording: Callable[[], Any],
    ) -> None:
        self._cond = cond
        self._rank = rank
        self._storage_path = storage_path
        self._run_name = run_name
        self._stop = stop
        self._controls = controls
        self._recording = recording
        # Guards _reports and the step of plain reports; taken inside _cond, never
        # the other way round. The C path reads these fields by name.
        self._reports_lock = threading.Lock()
        self._reports = ReportColumns()
        # The last step reported (-1: none yet, so the first default step is 0) and
        # the line of training it belongs to (a resume from an earlier checkpoint
        # starts a branch: its own checkpoint ids, the steps counted from there).
        self.step = -1
        self.line = 0
        self._replay = False  # rebuilding state after a failure: nothing is published
        self._stop_requested = False  # work waits at the next report (see refresh)
        self._checkpoints: list[CheckpointOffer] = []
        self._run_dir: Any = None
        # Checkpoints uploading beside the loop (ASYNC, and rtnb's own temp files);
        # an upload's error other than storage's is raised at the next report.
        self._uploads = CheckpointUploads(
            cond, self._upload_landed, self._upload_failed, limit_from_env()
        )
        self._upload_error: BaseException | None = None
        self._storage_error: str | None = None  # set by a failed checkpoint write
        # The first step whose files this rank could not write, in the running cell:
        # the step published stays below it, so no checkpoint from it on commits with
        # the other ranks' files alone.
        self._unwritten_step: int | None = None
        self._reported_checkpoint: str | None = None  # the id of the last one reported
        # The checkpoint get_checkpoint() returns in the running cell (given with the
        # cell), and the id it actually handed out, reported back to the driver.
        self._checkpoint: Any = None
        self._checkpoint_calls = 0
        self.loaded_checkpoint: str | None = None

    def make_current(self, current: bool = True) -> None:
        """Be (or stop being) what ``rtnb.report()`` records into in this process."""
        global _CURRENT
        if current:
            _CURRENT = self
        elif _CURRENT is self:
            _CURRENT = None

    @property
    def replaying(self) -> bool:
        return self._replay

    # ---- a cell's start and end (under the condition) ---------------------------------
    def cell_starts_locked(self, request: CellRequest) -> None:
        self._checkpoint = request.checkpoint
        self._checkpoint_calls = 0
        self.loaded_checkpoint = None
        self._replay = request.replay
        self._storage_error = None
        self._unwritten_step = None

    def refresh_boundary_locked(self) -> None:
        """Whether the next report has work: a stop, a hold, a trigger due."""
        self._stop_requested = self._stop.pending or bool(self._controls.due)

    def _at_boundary_locked(self) -> None:
        if not self._stop.at_boundary_locked(self.step):
            self.refresh_boundary_locked()

    def move_to(self, step: int, line: int) -> None:
        """Go on from ``step`` on ``line`` (a scaled or resumed group's ranks)."""
        with self._cond, self._reports_lock:
            self.step, self.line = step, line

    # ---- what a poll takes (under the condition) --------------------------------------
    def undelivered_locked(self) -> bool:
        if self._checkpoints:
            return True
        with self._reports_lock:
            return bool(len(self._reports))

    def buffered(self) -> int:
        return len(self._reports)

    def take_locked(self) -> tuple[ReportColumns, list[CheckpointOffer]]:
        with self._reports_lock:
            reports, self._reports = self._reports, ReportColumns()
        checkpoints, self._checkpoints = self._checkpoints, []
        return reports, checkpoints

    def committable_step_locked(self) -> int:
        """The step the driver may commit up to for this rank: files still uploading
        or never written keep it below their step. ``step`` and the uploads in flight
        only change together, under the condition."""
        passed = [self.step]
        if (oldest := self._uploads.lowest_step()) is not None:
            passed.append(oldest - 1)
        if self._unwritten_step is not None:
            passed.append(self._unwritten_step - 1)
        return min(passed)

    def uploading_locked(self) -> tuple[list[int], float]:
        """The steps whose files are on their way, and how long report() waited for
        a slot among them."""
        return self._uploads.steps(), self._uploads.waited_s

    @property
    def storage_error(self) -> str | None:
        return self._storage_error

    # ---- the cell thread ----------------------------------------------------------------
    def report_plain(self, metrics: dict) -> None:
        """``rtnb.report(metrics)``: no checkpoint, rtnb counts the step. The hot
        path of a fast loop: one plain lock, no Condition; the poll thread is woken
        only by a batch's first report."""
        if self._upload_error is None and not self._replay and not self._controls.due:
            self._add_plain(self.step + 1, metrics)
        else:
            self.report(metrics)

    def _add_plain(self, step: int, metrics: dict) -> None:
        # acquire/release: half the interpreter's work of a with-statement here.
        lock = self._reports_lock
        lock.acquire()
        try:
            self.step = step
            buffered = self._reports.add(step, _now(), metrics)
        finally:
            lock.release()
        if buffered == 1 or self._stop_requested:
            self.after_plain_report()

    def after_plain_report(self) -> None:
        """After a plain report that was a batch's first (wake the poll thread) or
        met work at the boundary (do it here). The C path records plain reports
        (atomically under the GIL, so without the lock) and asks for this the same
        way."""
        with self._cond:
            if len(self._reports) == 1:
                self._cond.notify_all()
            if self._stop_requested:
                self._at_boundary_locked()

    def report(
        self,
        metrics: dict,
        step: int | None = None,
        checkpoint=None,
        options: SaveOptions | None = None,
    ) -> int:
        """Record one report; it is also where a requested stop takes effect.

        A checkpoint's files are uploaded to the run directory (this rank's part
        only); the driver commits the checkpoint once every rank has reported this
        step. ``SYNC`` copies before returning; ``ASYNC`` (the default for files only
        rtnb holds, ``Checkpoint.from_state``) queues a snapshot and returns, the
        copy landing beside the loop (see rtnb.worker._uploads); the cell's end and a
        stop wait for what is in flight. ``NO_UPLOAD`` and a ``checkpoint_upload_fn``
        commit the files where they are (see ``describe_in_place``); a validation
        request goes with the files' offer.
        """
        step = int(step) if step is not None else self.step + 1
        if self._controls.due:
            checkpoint = self._controls.fire_due(step, checkpoint, self._replay)
            with self._cond:
                self.refresh_boundary_locked()
        profiler = self._recording()
        if profiler is not None:
            with profiler.record("rtnb.report"):
                return self._report(metrics, step, checkpoint, options)
        return self._report(metrics, step, checkpoint, options)

    def _report(self, metrics: dict, step: int, checkpoint, options=None) -> int:
        if checkpoint is None and self._upload_error is None and not self._replay:
            self._add_plain(step, metrics)
            return step
        self._raise_upload_error()
        when = time.time()
        if checkpoint is not None and self._storage_error is not None:
            # Storage refused this rank's last files: write no more until the stop.
            if getattr(checkpoint, "_temporary", False):
                checkpoint.discard()
            checkpoint = None
        if self._replay:
            # Rebuilding state after a failure: the first run already published
            # these reports and committed these checkpoints.
            if checkpoint is not None and getattr(checkpoint, "_temporary", False):
                checkpoint.discard()
            with self._cond:
                self.step = step
                if self._stop_requested:
                    self._at_boundary_locked()
            return self.step
        options = options or SaveOptions()
        if checkpoint is not None and options.mode_for(checkpoint) is CheckpointUploadMode.ASYNC:
            return self._queue_upload(metrics, step, when, checkpoint, options)
        files = None
        if checkpoint is not None:
            try:
                files = self._place(*self._checkpoint_target(step, checkpoint), options)
            except OSError as exc:  # pyarrow's I/O errors are OSErrors too
                self._storage_failed(step, exc)
        with self._cond:
            # The step and its checkpoint offer are published together: a poll in
            # between would let the driver commit this step without this rank's files.
            self.step = step
            self._publish_locked(step, when, metrics, files, options.validation)
            if self._stop_requested:
                self._at_boundary_locked()
        return self.step

    def _publish_locked(
        self, step: int, when: float, metrics: dict, files, validation=None
    ) -> None:
        with self._reports_lock:
            self._reports.add(step, when, metrics)
        if files is not None:
            self._checkpoints.append(
                CheckpointOffer(step, when, metrics, files, self.line, validation)
            )
        if len(self._reports) == 1:
            self._cond.notify_all()

    def _queue_upload(
        self, metrics: dict, step: int, when: float, checkpoint, options: SaveOptions
    ) -> int:
        """Queue ``checkpoint`` for the upload thread and go on: its metrics are
        published now, its files offered once they landed."""
        from rtnb.storage._checkpoint import snapshot

        source, dest_fs, dest_path, dest_uri = self._checkpoint_target(step, checkpoint)
        # Taken now: the cell may delete or reuse its folder once report returns.
        source = snapshot(source, given_up=options.delete_local)
        upload = Upload(
            step,
            when,
            metrics,
            self.line,
            copy=lambda: self._place(source, dest_fs, dest_path, dest_uri, options),
            after=source.discard,
            validation=options.validation,
        )
        with self._cond:
            self._uploads.add(upload, stopping=lambda: self._stop_requested)
            # With the upload queued: a poll never sees the step without knowing
            # that its files are still on their way.
            self.step = step
            self._publish_locked(step, when, metrics, None)
            if self._stop_requested:
                self._at_boundary_locked()
        return self.step

    def _upload_landed(self, upload: Upload, files: list[dict]) -> None:
        self._checkpoints.append(
            CheckpointOffer(
                upload.step, upload.when, upload.metrics, files, upload.line, upload.validation
            )
        )

    def _upload_failed(self, upload: Upload, exc: BaseException) -> None:
        if isinstance(exc, OSError):  # pyarrow's I/O errors are OSErrors too
            self._storage_failed(upload.step, exc)
            self._uploads.drop()
        else:
            self._upload_error = exc

    def _storage_failed(self, step: int, exc: BaseException) -> None:
        """This rank's checkpoint files for ``step`` could not be written: say so in
        the next poll and pause at the next report, so that the driver stops every
        rank at one step (the cell goes on otherwise, as a collective needs)."""
        from rtnb.errors import one_line
        from rtnb.storage._checkpoints import checkpoint_id
        from rtnb.storage._layout import checkpoint_dir

        where = (
            self._run_dir.shown(checkpoint_dir(checkpoint_id(step, self.line)))
            if self._run_dir is not None
            else self._storage_path
        )
        with self._cond:
            if self._unwritten_step is None or step < self._unwritten_step:
                self._unwritten_step = step
            if self._storage_error is None:
                self._storage_error = (
                    f"rank {self._rank} could not write its checkpoint files "
                    f"to {where} ({one_line(exc)})"
                )
            self._stop.want_locked()
            self._stop_requested = True
            self._cond.notify_all()

    def reported_checkpoints(self, mode: Any, timeout_s: float | None = None) -> list:
        """Every committed checkpoint of the run, once the last one this rank reported
        is committed (and validated, with ``VALIDATED``); a stop ends the wait."""
        from rtnb.errors import CheckpointError
        from rtnb.storage._checkpoints import CheckpointConsistencyMode, CheckpointStore

        mode = CheckpointConsistencyMode.named(mode)
        self.finish_uploads()
        store = CheckpointStore(self.run_directory())
        waited = self._reported_checkpoint
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waited is not None and not mode.satisfied_by(store.info(waited)):
            if deadline is not None and time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {waited} was not {mode.value.lower()} within {timeout_s} s"
                )
            with self._cond:
                if self._stop_requested:
                    self._at_boundary_locked()
                self._cond.wait(0.1)
        return store.reported()

    def finish_uploads(self) -> None:
        """Wait for every checkpoint in flight; raise an upload's error in the cell.

        A stop's interrupt does not end the wait: the files in flight land first,
        unless the stop's grace runs out and the group is removed (the driver then
        says which were dropped)."""
        with self._cond:
            while True:
                try:
                    self._uploads.drain()
                    break
                except (CellStopped, DebugStopped):
                    continue
        self._raise_upload_error()

    def _raise_upload_error(self) -> None:
        error, self._upload_error = self._upload_error, None
        if error is not None:
            raise error

    @staticmethod
    def _place(source, dest_fs, dest_path: str, dest_uri: str, options: SaveOptions) -> list:
        """Put ``source``'s files in the run as ``options`` say: rtnb's copy, the
        user's upload function, or where they are (NO_UPLOAD); their manifest entries."""
        from rtnb.storage._checkpoint import Checkpoint, describe_in_place, upload_directory

        if options.upload_fn is None and options.mode is not CheckpointUploadMode.NO_UPLOAD:
            return upload_directory(source, dest_fs, dest_path)
        placed = source
        try:
            if options.upload_fn is not None:
                placed = options.upload_fn(source, dest_uri)
                if not hasattr(placed, "path"):
                    raise TypeError(
                        "checkpoint_upload_fn(checkpoint, destination) returns the Checkpoint "
                        f"it wrote, got {type(placed).__name__}"
                    )
                placed = Checkpoint(placed.path, getattr(placed, "filesystem", None))
            return describe_in_place(placed, dest_fs, dest_path)
        finally:
            if placed is not source:
                source.discard()  # rtnb's own temp copy or snapshot, once placed

    def _checkpoint_target(self, step: int, checkpoint):
        """Where ``checkpoint``'s files go for ``step``; refuses a committed id at once."""
        from rtnb.errors import CheckpointError
        from rtnb.storage._checkpoint import MANIFEST, Checkpoint
        from rtnb.storage._checkpoints import checkpoint_id
        from rtnb.storage._layout import checkpoint_dir, checkpoint_file

        if not isinstance(checkpoint, Checkpoint):
            # ray.train.Checkpoint and look-alikes: a path plus a pyarrow filesystem.
            checkpoint = Checkpoint(checkpoint.path, getattr(checkpoint, "filesystem", None))
        run_dir = self.run_directory()
        cid = checkpoint_id(step, self.line)
        if run_dir.exists(checkpoint_file(cid, MANIFEST)):
            raise CheckpointError(
                f"checkpoint {cid} is already committed; report the new checkpoint with a later step"
            )
        self._reported_checkpoint = cid
        folder = checkpoint_dir(cid)
        return checkpoint, run_dir.fs, f"{run_dir.path}/{folder}", run_dir.location_of(folder)

    def run_directory(self):
        from rtnb.storage._rundir import RunDirectory

        if self._run_dir is None:
            self._run_dir = RunDirectory(self._storage_path, self._run_name)
        return self._run_dir

    def hand_out_checkpoint(self):
        """``get_checkpoint()``: the cell's checkpoint, remembered as loaded."""
        checkpoint = self._checkpoint
        if checkpoint is not None:
            self.loaded_checkpoint = getattr(checkpoint, "id", None)
            resume = getattr(checkpoint, "resume", None)
            if resume is not None and self._checkpoint_calls == 0:
                # Training goes on from the checkpoint's state, so the step count
                # does too (on a branch when later checkpoints of this line exist).
                with self._cond, self._reports_lock:
                    self.step, self.line = resume
                    self._controls.drop_passed_locked()
                    self.refresh_boundary_locked()
            self._checkpoint_calls += 1
        return checkpoint
