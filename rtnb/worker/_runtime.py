"""What runs inside one rank: its namespace, the cell thread, output capture, reports.

This module is plain Python (no Ray) so it can be tested in-process; the Ray actor
in ``_actor.py`` is a thin shell around :class:`RankRuntime`. What it sends to the
driver is one :class:`~rtnb.core._messages.RankUpdate` per poll
(docs/architecture.md, "The rank↔driver protocol").

A cell runs in one long-lived thread per rank. Control calls (poll, stop, pull)
arrive on other threads while it runs, which is what lets the driver stream output,
read variables and stop a cell cooperatively.
"""

from __future__ import annotations

import ast
import bdb
import ctypes
import linecache
import os
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

from rtnb.core._context import set_current_rank
from rtnb.core._messages import (
    CellRequest,
    CellState,
    CheckpointOffer,
    RankUpdate,
)
from rtnb.core._profile import PROFILE_STOP
from rtnb.core._reports import ReportColumns
from rtnb.core._resources import ResourceSampler
from rtnb.core._stacks import RankStack, thread_stack
from rtnb.core._values import to_portable
from rtnb.worker._capture import flush_std, install_capture, install_thread_capture
from rtnb.worker._controls import RankControls
from rtnb.worker._debug import DebugStopped, RankDebugger
from rtnb.worker._folder import RankFolder
from rtnb.worker._profile import RankProfiling
from rtnb.worker._shards import ShardWaits
from rtnb.worker._uploads import (
    CheckpointUploadMode,
    CheckpointUploads,
    SaveOptions,
    Upload,
    limit_from_env,
)

__all__ = [
    "CellStopped",
    "RankContext",
    "RankRuntime",
    "current_runtime",
    "split_last_expression",
]

# Output beyond this many characters between two polls is dropped with a notice,
# so a print storm cannot exhaust the rank's memory while nobody reads it.
_MAX_PENDING_CHARS = 8_000_000
# Source of this many recent cells stays in linecache for tracebacks; older cells'
# source is dropped so a long session does not grow the rank's memory per cell.
_LINECACHE_CELLS = 256


class CellStopped(KeyboardInterrupt):
    """Raised inside a rank's cell when the user interrupts it.

    It subclasses KeyboardInterrupt so ``except Exception`` in user code does not
    swallow it and ``except KeyboardInterrupt`` cleanup code still runs.
    """


@dataclass
class RankContext:
    """What a rank knows about itself (``rtnb.get_context()``), as in Ray Train."""

    world_rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    device: str = "cpu"
    run_name: str = ""
    storage_path: str = ""
    backend: str = "gloo"
    node_ip: str = "127.0.0.1"
    pid: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    # Ray Train's TrainContext spells these as getters; users' code calls them.
    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.local_world_size

    def get_node_rank(self) -> int:
        return self.node_rank

    def get_experiment_name(self) -> str:
        return self.run_name

    def get_trial_name(self) -> str:
        return self.run_name

    def get_trial_dir(self) -> str:
        from rtnb.errors import ConfigError

        # Ray Train 2.x workers raise here too (a Tune-only name, deprecated).
        raise ConfigError(
            "get_context().get_trial_dir() is not for training workers (Ray Train 2.x "
            "raises too): save the checkpoint into tempfile.TemporaryDirectory() and "
            "report Checkpoint.from_directory(that folder)"
        )

    def get_storage(self) -> str:
        return self.storage_path


_CURRENT: RankRuntime | None = None
_now = time.time
# Reports buffered when a batch is due (500 in 0.1 s: 5,000 reports/s) from which the
# batch is held three times as long.
_BUSY_REPORTS = 500
_BUSY_FACTOR = 3


def current_runtime() -> RankRuntime | None:
    return _CURRENT


def split_last_expression(code: str, filename: str) -> tuple[CodeType, CodeType | None]:
    """Compile ``code`` into (body, last_expression_or_None), as IPython does.

    A cell run again (a loop of cells, a re-run notebook) reuses its compiled code
    under its new name: parsing and compiling were a tenth of a trivial cell's
    Python time on a rank."""
    compiled = _COMPILED.get(code)
    if compiled is None:
        tree = ast.parse(code, filename=filename, mode="exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last_node = tree.body.pop()
            last = compile(ast.Expression(last_node.value), filename, "eval")
        compiled = (compile(tree, filename, "exec"), last)
        _COMPILED[code] = compiled
        while len(_COMPILED) > _COMPILED_KEPT:
            _COMPILED.pop(next(iter(_COMPILED)))
    body, last = compiled
    if body.co_filename != filename:
        body = _renamed(body, filename)
        last = _renamed(last, filename) if last is not None else None
    return body, last


def _renamed(code: CodeType, filename: str) -> CodeType:
    """``code`` and the functions and classes it defines, named ``filename`` (what
    tracebacks show and read their source lines by)."""
    consts = tuple(_renamed(c, filename) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


# Compiled cells by their code, oldest first (a rank runs one cell at a time).
_COMPILED: dict[str, tuple[CodeType, CodeType | None]] = {}
_COMPILED_KEPT = 32


class RankRuntime:
    """One rank's persistent state and the machinery to run cells in it."""

    def __init__(
        self, context: RankContext, capture_output: bool = True, in_kernel: bool = False
    ) -> None:
        """``in_kernel``: the rank of local mode, in the kernel's own process: only
        its cell thread's output is captured (the kernel keeps its streams), and a
        cell's exception is kept with its frames for ``%debug``."""
        global _CURRENT
        self.context = context
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        # The notebook's code folders, seen in place or copied (opened by the group).
        self.folder = RankFolder()
        set_current_rank(context.world_rank)
        self._cond = threading.Condition()
        self._output: list[tuple[str, str]] = []
        self._output_chars = 0
        self._dropped_chars = 0
        self.written_chars = 0  # every character of output the cells wrote
        self._reports = ReportColumns()
        # Guards _reports and the step of plain reports; taken inside _cond, never
        # the other way round.
        self._reports_lock = threading.Lock()
        self._checkpoints: list[CheckpointOffer] = []
        self._run_dir = None
        # The last step reported (-1: none yet, so the first default step is 0) and
        # the line of training it belongs to (a resume from an earlier checkpoint
        # starts a branch: its own checkpoint ids, the steps counted from there).
        self.step = -1
        self.line = 0
        self.checkpoint_calls = 0
        # The checkpoint get_checkpoint() returns in the running cell (given with
        # the cell), and the id it actually handed out, reported back to the driver.
        self.checkpoint = None
        self._loaded_checkpoint: str | None = None
        self._replay = False
        self._cached_cells: deque[str] = deque()
        # Checkpoints uploading beside the loop (ASYNC, and rtnb's own temp files);
        # an upload's error other than storage's is raised at the next report.
        self._uploads = CheckpointUploads(
            self._cond, self._upload_landed, self._upload_failed, limit_from_env()
        )
        self._upload_error: BaseException | None = None
        self._storage_error: str | None = None  # set by a failed checkpoint write
        # The first step whose files this rank could not write, in the running cell:
        # the step published stays below it, so no checkpoint from it on commits with
        # the other ranks' files alone.
        self._unwritten_step: int | None = None
        self._reported_checkpoint: str | None = None  # the id of the last one reported
        # Cell state, guarded by _cond.
        self._cell_id: int | None = None
        # The last dispatch token started: a cell relayed through rank 0 may also
        # arrive as a direct call, and starts once.
        self._token = 0
        self._state = CellState.IDLE
        self._value: tuple[bytes | None, str] | None = None
        self._error: tuple[str, str] | None = None
        # Stop protocol, guarded by _cond.
        # _stop_wanted: a stop was asked for. _stop_requested: the next report() has
        # work at the boundary (a stop, a hold, a trigger due): report()'s C path
        # reads it and leaves such a report to the Python path.
        self._stop_wanted = False
        self._stop_requested = False
        self._stop_target: int | None = None
        self._paused_at: int | None = None
        self._pause_reported = False
        # Live controls (rtnb.control): paused at the next report until the driver
        # says from which step a change holds (``hold``/``release``), so every rank
        # takes it at the same step. Each control's schedule is (from_step, value),
        # ascending; replaced whole on a change, so control() reads it unlocked.
        self._holding = False
        self._released = 0  # the last live-control change released (see hold)
        # The cell the cell thread runs next, handed over under _cond (a queue's own
        # lock and condition cost a trivial cell's rank ~10% more CPU).
        self._job: CellRequest | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._cell_loop, name="rtnb-cell", daemon=True)
        self._thread.start()
        # The thread running the current cell (an interrupt is raised in it).
        self._cell_thread = self._thread.ident
        self._capture_output = capture_output
        self._in_kernel = in_kernel
        self._exception: BaseException | None = None  # in the kernel: the last cell's
        self._uncapture = None
        # Its parts, each handed the condition and the few questions it asks.
        self.debugger = RankDebugger(
            context.world_rank,
            self._cond,
            stopping=lambda: self._stop_wanted,
            cell_thread=lambda: self._cell_thread,
            replaying=lambda: self._replay,
        )
        self.controls = RankControls(
            self._cond,
            step=lambda: self.step,
            say=lambda text: self._add_output(
                "stderr", f"[rtnb] rank {self.context.world_rank}: {text}\n"
            ),
            profile=lambda name, step: self.profiling.trigger(name, step),
            as_checkpoint=_as_checkpoint,
        )
        self.profiling = RankProfiling(
            context.world_rank,
            self._cond,
            cell_thread=lambda: self._cell_thread,
            run_directory=self._run_directory,
            stop_at=self._stop_profile_at,
        )
        if not in_kernel:
            # Local mode answers breakpoint() in the kernel itself (driver._local).
            sys.breakpointhook = self.debugger.breakpoint
        if in_kernel and capture_output:
            self._uncapture = install_thread_capture(self._add_output, {self._thread.ident})
        # Ray Data shards by name (DataIterators), handed over by the driver.
        self.datasets: dict[str, Any] = {}
        self.shard_waits = ShardWaits()
        # CPU, memory and GPU of this process, sampled by the long-poll (≤ 1 Hz).
        # Made at the first poll: the rank's device is known by then.
        self._sampler: ResourceSampler | None = None
        _CURRENT = self

    def close(self) -> None:
        """End the cell thread once its cell (if any) ends and give the process its
        streams back (a rank in the kernel's process: local mode)."""
        global _CURRENT
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._uncapture is not None:
            self._uncapture()
            self._uncapture = None
        if _CURRENT is self:
            _CURRENT = None

    # ---- cells -------------------------------------------------------------------
    def start_cell(self, request: CellRequest, in_caller: bool = False) -> bool:
        """Run ``request``'s code in the cell thread (see :class:`CellRequest` for
        its checkpoint, replay and token). A request whose token is not newer than
        the last one started is not started again (False). ``in_caller``: the
        calling thread runs it next, with :meth:`execute` (the relay's listener,
        which runs every cell of its rank)."""
        with self._cond:
            token = request.token
            if token is not None:
                if token <= self._token:
                    return False
                self._token = token
            if self._state is CellState.RUNNING:
                raise RuntimeError(f"rank {self.context.world_rank} is still running a cell")
            self._cell_id = request.cell_id
            self._state = CellState.RUNNING
            self.checkpoint = request.checkpoint
            self.checkpoint_calls = 0
            self._loaded_checkpoint = None
            self._replay = request.replay
            self._value = None
            self._error = None
            self._storage_error = None
            self._unwritten_step = None
            self._stop_wanted = False
            self._stop_target = None
            self._paused_at = None
            self._holding = False
            self.debugger.cell_starts()
            self.controls.cell_starts_locked(request.controls, request.triggers)
            self._stop_requested = bool(self.controls.due)
            self._cell_thread = threading.get_ident() if in_caller else self._thread.ident
            if not in_caller:
                self._job = request
                self._cond.notify_all()
        return True

    def _cell_loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._job is None:
                    return
                request, self._job = self._job, None
            self.execute(request)

    def execute(self, request: CellRequest) -> None:
        """Run a started cell to its end in this thread and publish how it ended."""
        code, filename = request.code, request.filename
        self._cache_source(filename, code)
        state, value, error, exception = CellState.DONE, None, None, None
        if self._capture_output and not self._in_kernel:
            install_capture(self._add_output)
        hook = sys.breakpointhook
        if request.replay:
            # Nobody is at a replayed cell's breakpoint() (a recovery, a scale): it
            # must not wait for a debugger's commands.
            sys.breakpointhook = _no_breakpoint
        try:
            for line in self.folder.before_cell(request.files):
                if self.context.world_rank == 0 and not request.replay:
                    print(line)
            body, last = split_last_expression(code, filename)
            exec(body, self.namespace)
            if last is not None:
                result = eval(last, self.namespace)
                if result is not None:
                    value = to_portable(result)
        except (CellStopped, DebugStopped, bdb.BdbQuit):
            state = CellState.INTERRUPTED
        except BaseException as exc:  # noqa: BLE001 - the user's code may raise anything
            state = CellState.ERROR
            error = (_summary(exc), _user_traceback(exc, filename))
            if self._in_kernel:
                exception = exc
            else:
                self.debugger.cell_failed(exc.__traceback__)
        finally:
            self.folder.after_cell()
            try:
                self._end_cell_tools()
            except BaseException:  # noqa: BLE001 - an interrupt landing here ends nothing else
                pass
            if request.replay:
                sys.breakpointhook = hook
            # A cell ends only once its last checkpoint is in storage and offered.
            try:
                self._finish_uploads()
            except BaseException as exc:  # noqa: BLE001 - the upload's own error
                if state is CellState.DONE:
                    state = CellState.ERROR
                    error = (_summary(exc), _summary(exc) + "\n")
            flush_std()
        with self._cond:
            self._state, self._value, self._error = state, value, error
            self._exception = exception
            self._stop_wanted = False
            self._stop_requested = False
            self._stop_target = None
            self._paused_at = None
            self._holding = False
            self.controls.cell_ends_locked()
            self._cond.notify_all()

    def _end_cell_tools(self) -> None:
        """A profile still recording ends with the cell (its trace is awaited briefly,
        so the cell's last update carries it, unless a stop is under way: the stop's
        grace is for the ranks to leave); a debugger stepped past the cell's end goes."""
        self.profiling.cell_ends(self.step, stopping=self._stop_wanted)
        self.debugger.cell_ends()

    def _cache_source(self, filename: str, code: str) -> None:
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        self._cached_cells.append(filename)
        while len(self._cached_cells) > _LINECACHE_CELLS:
            linecache.cache.pop(self._cached_cells.popleft(), None)

    def wait(self, timeout: float = 0.5, batch_s: float = 0.02) -> RankUpdate:
        """Long-poll: return when the cell ends, when output or reports have waited
        ``batch_s`` to be batched, when a rank pauses for a stop, or at ``timeout``."""
        deadline = time.monotonic() + timeout
        first_event: float | None = None
        with self._cond:
            while True:
                now = time.monotonic()
                if (
                    self._state is not CellState.RUNNING
                    or (self._paused_at is not None and not self._pause_reported)
                    or self.debugger.waiting_unreported
                ):
                    break
                if self._output or self._reports:
                    first_event = first_event or now
                    # A loop reporting thousands of times a second gets longer
                    # batches: each answered poll costs the kernel and Ray a
                    # millisecond or two of CPU, taken from the ranks on a small machine.
                    window = batch_s * (_BUSY_FACTOR if len(self._reports) >= _BUSY_REPORTS else 1)
                    if now - first_event >= window:
                        break
                    wake = min(deadline, first_event + window)
                else:
                    wake = deadline
                if now >= deadline:
                    break
                self._cond.wait(wake - now)
            update, reports = self._drain_locked()
        # Packed outside the lock, so report() in the training loop never waits on it.
        update.reports = reports.take()
        if self._sampler is None:
            self._sampler = ResourceSampler(gpu_index=_gpu_index(self.context.device))
        if self._sampler.due() and update.state is CellState.RUNNING and not self._replay:
            sample = self._sampler.sample(update.step)
            if sample is not None:
                update.resources = [sample]
        return update

    def final_update(self, timeout: float) -> RankUpdate | None:
        """The cell's last update if it ends within ``timeout`` and nothing waits to
        be delivered with it (no output, reports or checkpoint offers), else None,
        as soon as that is known: a cell that prints or reports is handed to the
        long-poll at its first line or report, so the first points of a live plot
        are not held back. Nothing is drained: an update that gets lost on its way
        is simply asked for again (``wait``), so a relayed answer can never lose a
        rank's output."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (
                self._state is CellState.RUNNING
                and self._paused_at is None
                and not self._undelivered_locked()
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            if self._state is CellState.RUNNING or self._undelivered_locked():
                return None
            return self._update_locked([], [])

    def _undelivered_locked(self) -> bool:
        if self._output or self._dropped_chars or self._checkpoints:
            return True
        if self.controls.undelivered_locked() or self.profiling.has_result:
            return True
        with self._reports_lock:
            return bool(len(self._reports))

    def _drain_locked(self) -> tuple[RankUpdate, ReportColumns]:
        output, self._output, self._output_chars = self._output, [], 0
        if self._dropped_chars:
            output.append(
                ("stderr", f"[rtnb: {self._dropped_chars} characters of output dropped]\n")
            )
            self._dropped_chars = 0
        with self._reports_lock:
            reports, self._reports = self._reports, ReportColumns()
        checkpoints, self._checkpoints = self._checkpoints, []
        if self._paused_at is not None:
            self._pause_reported = True
        update = self._update_locked(output, checkpoints)
        update.debugging = self.debugger.where_reported_locked()
        update.profile = self.profiling.take_result_locked()
        self.controls.drain_locked(update)
        return update, reports

    def _committable_step_locked(self) -> int:
        passed = [self.step]
        if (oldest := self._uploads.lowest_step()) is not None:
            passed.append(oldest - 1)
        if self._unwritten_step is not None:
            passed.append(self._unwritten_step - 1)
        return min(passed)

    def _update_locked(self, output: list, checkpoints: list) -> RankUpdate:
        return RankUpdate(
            rank=self.context.world_rank,
            cell=self._cell_id,
            state=self._state,
            # The driver commits a step once every rank has passed it, so a step
            # whose files are still uploading is not passed yet. ``step`` and the
            # uploads in flight only change together, under this lock.
            step=self._committable_step_locked(),
            uploading=self._uploads.steps(),
            upload_waited_s=self._uploads.waited_s,
            paused_at=self._paused_at,
            output=output,
            checkpoints=checkpoints,
            value=self._value if self._state is CellState.DONE else None,
            error=self._error if self._state is CellState.ERROR else None,
            exception=self._exception if self._state is CellState.ERROR else None,
            loaded_checkpoint=self._loaded_checkpoint,
            line=self.line,
            storage_error=self._storage_error,
            data_waits=self.shard_waits.snapshot() if self.datasets else {},
        )

    # ---- output and reports (called from the cell thread) --------------------------
    def _add_output(self, stream: str, text: str) -> None:
        with self._cond:
            self.written_chars += len(text)
            if self._output_chars + len(text) > _MAX_PENDING_CHARS:
                self._dropped_chars += len(text)
                return
            if self._output and self._output[-1][0] == stream:
                self._output[-1] = (stream, self._output[-1][1] + text)
            else:
                self._output.append((stream, text))
            self._output_chars += len(text)
            self._cond.notify_all()

    def report_plain(self, metrics: dict) -> None:
        """``rtnb.report(metrics)``: no checkpoint, rtnb counts the step. The hot
        path of a fast loop: one plain lock, no Condition; the poll thread is woken
        only by a batch's first report."""
        if self._upload_error is None and not self._replay and not self.controls.due:
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
        met a stop request (pause here). rtnb.core._fastreport's ``add`` records
        plain reports in C (atomically under the GIL, so without the lock) and asks
        for this the same way."""
        with self._cond:
            if len(self._reports) == 1:
                self._cond.notify_all()
            if self._stop_requested:
                self._stop_at_boundary_locked()

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
        if self.controls.due:
            checkpoint = self.controls.fire_due(step, checkpoint, self._replay)
            with self._cond:
                self._refresh_boundary_locked()
        profiler = self.profiling.recording
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
                    self._stop_at_boundary_locked()
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
                self._stop_at_boundary_locked()
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
                self._stop_at_boundary_locked()
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
            else self.context.storage_path
        )
        with self._cond:
            if self._unwritten_step is None or step < self._unwritten_step:
                self._unwritten_step = step
            if self._storage_error is None:
                self._storage_error = (
                    f"rank {self.context.world_rank} could not write its checkpoint files "
                    f"to {where} ({one_line(exc)})"
                )
            self._stop_wanted = self._stop_requested = True
            self._cond.notify_all()

    def reported_checkpoints(self, mode: Any, timeout_s: float | None = None) -> list:
        """Every committed checkpoint of the run, once the last one this rank reported
        is committed (and validated, with ``VALIDATED``); a stop ends the wait."""
        from rtnb.errors import CheckpointError
        from rtnb.storage._checkpoints import CheckpointConsistencyMode, CheckpointStore

        mode = CheckpointConsistencyMode.named(mode)
        self._finish_uploads()
        store = CheckpointStore(self._run_directory())
        waited = self._reported_checkpoint
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waited is not None and not mode.satisfied_by(store.info(waited)):
            if deadline is not None and time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {waited} was not {mode.value.lower()} within {timeout_s} s"
                )
            with self._cond:
                if self._stop_requested:
                    self._stop_at_boundary_locked()
                self._cond.wait(0.1)
        return store.reported()

    def _finish_uploads(self) -> None:
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
        run_dir = self._run_directory()
        cid = checkpoint_id(step, self.line)
        if run_dir.exists(checkpoint_file(cid, MANIFEST)):
            raise CheckpointError(
                f"checkpoint {cid} is already committed; report the new checkpoint with a later step"
            )
        self._reported_checkpoint = cid
        folder = checkpoint_dir(cid)
        return checkpoint, run_dir.fs, f"{run_dir.path}/{folder}", run_dir.location_of(folder)

    def _stop_at_boundary_locked(self) -> None:
        if self._holding:
            # A control change: wait here until the driver says from which step it
            # holds (a step no rank has begun yet); then go on, unless a stop came.
            # Not a stop's pause: paused_at (which the stop's common step is chosen
            # from) stays unset.
            while self._holding:
                self._cond.wait(0.05)
        if not self._stop_wanted:
            self._refresh_boundary_locked()
            return
        # Pause here and let the driver pick the step every rank stops at, so that
        # no rank leaves while a peer still waits for it inside a collective.
        if self._stop_target is None:
            self._paused_at = self.step
            self._pause_reported = False
            self._cond.notify_all()
            while self._stop_wanted and self._stop_target is None:
                self._cond.wait(0.05)
            self._paused_at = None
        if self._stop_wanted and self._stop_target is not None and self.step >= self._stop_target:
            raise CellStopped(f"stopped at step {self.step}")

    # ---- control calls (any thread) -------------------------------------------------
    def wake_poll(self) -> None:
        """Let a long-poll waiting to batch output answer now (it looks again)."""
        with self._cond:
            self._cond.notify_all()

    def request_stop(self) -> int:
        with self._cond:
            if self._state is CellState.RUNNING:
                self._stop_wanted = self._stop_requested = True
                self._holding = False  # a stop ends a hold for a control change
                self._cond.notify_all()
            return self.step

    # ---- live controls ---------------------------------------------------------------
    def hold(self, change: int = 0) -> int | None:
        """Pause at the next report until :meth:`release`; the rank's step now (it
        pauses at this step + 1 at the latest), None when no cell can take a change
        (none running, a replay, a stop under way) or change ``change`` was released
        already (its calls can reach the actor out of order)."""
        with self._cond:
            if (
                self._state is not CellState.RUNNING
                or self._replay
                or self._stop_wanted
                or (change and change <= self._released)
            ):
                return None
            self._holding = True
            self._stop_requested = True  # what report() checks, in C too
            return self.step

    def release(
        self,
        changes: dict[str, Any],
        from_step: int,
        triggers: tuple[str, ...] = (),
        change: int = 0,
    ) -> None:
        """``changes`` hold from ``from_step`` on (-1: at once), ``triggers`` fire
        in the report of ``from_step``; a held rank goes on."""
        with self._cond:
            self._released = max(self._released, change)
            self.controls.release_locked(changes, from_step, triggers)
            self._holding = False
            self._refresh_boundary_locked()
            self._cond.notify_all()

    # ---- %rtnb profile ------------------------------------------------------------------
    def _stop_profile_at(self, step: int) -> None:
        with self._cond:
            self.controls.due_at_locked(step, PROFILE_STOP)
            self._refresh_boundary_locked()

    def _run_directory(self):
        from rtnb.storage._rundir import RunDirectory

        if self._run_dir is None:
            self._run_dir = RunDirectory(self.context.storage_path, self.context.run_name)
        return self._run_dir

    def _refresh_boundary_locked(self) -> None:
        self._stop_requested = self._stop_wanted or self._holding or bool(self.controls.due)

    def set_stop_target(self, step: int) -> None:
        with self._cond:
            if self._stop_wanted:
                self._stop_target = step
                self._cond.notify_all()

    def interrupt(self) -> bool:
        """Raise CellStopped inside the cell thread (reaches pure-Python code only)."""
        with self._cond:
            if self._state is not CellState.RUNNING:
                return False
            self._stop_wanted = self._stop_requested = True
            self._holding = False
            self._stop_target = -1  # any paused rank leaves at once
            self._cond.notify_all()
        ident = self._cell_thread
        if ident is None:
            return False
        hit = ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(ident), ctypes.py_object(CellStopped)
        )
        return hit == 1

    def in_cell_thread(self) -> bool:
        """Whether the caller is this rank's running cell (not the kernel's own code
        beside a local-mode rank)."""
        return threading.get_ident() == self._cell_thread

    def stack(self) -> RankStack:
        """Where the cell thread is right now (``%rtnb stacks``), from the user's
        cell code on; answered on a control thread while the cell runs."""
        with self._cond:
            running = self._state is CellState.RUNNING
            ident = self._cell_thread
        return thread_stack(self.context.world_rank, ident, running, os.getpid())

    def pull(self, name: str) -> tuple[bool, bytes | None, str]:
        if name not in self.namespace:
            return False, None, ""
        return (True, *to_portable(self.namespace[name]))

    def push(self, values: dict[str, Any]) -> None:
        self.namespace.update(values)

    def hand_out_checkpoint(self):
        """``get_checkpoint()``: the cell's checkpoint, remembered as loaded."""
        checkpoint = self.checkpoint
        if checkpoint is not None:
            self._loaded_checkpoint = getattr(checkpoint, "id", None)
            resume = getattr(checkpoint, "resume", None)
            if resume is not None and self.checkpoint_calls == 0:
                # Training goes on from the checkpoint's state, so the step count
                # does too (on a branch when later checkpoints of this line exist).
                with self._cond, self._reports_lock:
                    self.step, self.line = resume
                    self.controls.drop_passed_locked()
                    self._refresh_boundary_locked()
            self.checkpoint_calls += 1
        return checkpoint

    @property
    def state(self) -> CellState:
        return self._state

    @property
    def cell_thread_id(self) -> int | None:
        """The thread this rank's cells run in (the cell thread)."""
        return self._thread.ident


def _as_checkpoint(result: Any) -> Any:
    """What an on_save handler returned, as a checkpoint: one already (it has a
    path), else its state saved with Checkpoint.from_state."""
    if hasattr(result, "path"):
        return result
    from rtnb.storage._checkpoint import Checkpoint

    return Checkpoint.from_state(result)


def _gpu_index(device: str) -> int | None:
    """The NVML index of a rank's ``cuda:N`` device (None on CPU). NVML numbers
    every GPU of the machine; CUDA only those in ``CUDA_VISIBLE_DEVICES``."""
    if not device.startswith("cuda"):
        return None
    _, _, index = device.partition(":")
    cuda = int(index) if index.isdigit() else 0
    visible = [
        v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
    ]
    if cuda < len(visible) and visible[cuda].isdigit():
        return int(visible[cuda])
    return cuda


def _no_breakpoint(*_args, **_kwargs) -> None:
    return None


def _summary(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _user_traceback(exc: BaseException, filename: str) -> str:
    """The traceback from the first frame of the user's cell on: rtnb's own frames
    (the exec machinery) are noise to the user."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    if isinstance(exc, SyntaxError) or tb is None:
        return "".join(traceback.format_exception_only(type(exc), exc))
    return "".join(traceback.format_exception(type(exc), exc, tb))
