"""What runs inside one rank: its namespace, the cell thread, output capture, and
the long-poll that carries everything to the driver.

This module is plain Python (no Ray) so it can be tested in-process; the Ray actor
in ``_actor.py`` is a thin shell around :class:`RankRuntime`. What it sends to the
driver is one :class:`~rtnb.core._messages.RankUpdate` per poll
(docs/architecture.md, "The rank↔driver protocol").

A cell runs in one long-lived thread per rank. Control calls (poll, stop, pull)
arrive on other threads while it runs, which is what lets the driver stream output,
read variables and stop a cell cooperatively. The runtime holds the cell's state
and hands one condition to its parts, each in its own module: the cell's code
(``_code``), reports and checkpoints (``_reporting``), the stop and the hold for a
live change (``_stopping``), controls and triggers (``_controls``), the profiler
(``_profile``) and the debugger (``_debug``).
"""

from __future__ import annotations

import bdb
import ctypes
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from rtnb.core._context import set_current_rank
from rtnb.core._messages import CellRequest, CellState, RankUpdate
from rtnb.core._profile import PROFILE_STOP
from rtnb.core._reports import ReportColumns
from rtnb.core._resources import ResourceSampler
from rtnb.core._stacks import RankStack, thread_stack
from rtnb.core._values import to_portable
from rtnb.worker._capture import flush_std, install_capture, install_thread_capture
from rtnb.worker._code import CellSources, error_summary, split_last_expression, user_traceback
from rtnb.worker._controls import RankControls
from rtnb.worker._debug import DebugStopped, RankDebugger
from rtnb.worker._folder import RankFolder
from rtnb.worker._profile import RankProfiling
from rtnb.worker._reporting import RankReports
from rtnb.worker._shards import ShardWaits
from rtnb.worker._stopping import CellStopped, RankStop

__all__ = ["RankContext", "RankRuntime", "current_runtime"]

# Output beyond this many characters between two polls is dropped with a notice,
# so a print storm cannot exhaust the rank's memory while nobody reads it.
_MAX_PENDING_CHARS = 8_000_000
# Reports buffered when a batch is due (500 in 0.1 s: 5,000 reports/s) from which the
# batch is held three times as long.
_BUSY_REPORTS = 500
_BUSY_FACTOR = 3


class Command(Protocol):
    """What the runtime needs of a control call: a ``RankCommand``
    (:mod:`rtnb.worker._commands`, which reads this module: named here by shape)."""

    def apply(self, runtime: RankRuntime, payload: Any = None) -> Any: ...


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


def current_runtime() -> RankRuntime | None:
    return _CURRENT


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
        self._sources = CellSources()
        # Cell state, guarded by _cond.
        self._cell_id: int | None = None
        # The last dispatch token started: a cell relayed through rank 0 may also
        # arrive as a direct call, and starts once.
        self._token = 0
        self._state = CellState.IDLE
        self._value: tuple[bytes | None, str] | None = None
        self._error: tuple[str, str] | None = None
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
        self.stop = RankStop(self._cond)
        self.controls = RankControls(
            self._cond,
            step=lambda: self.reports.step,
            say=lambda text: self._add_output(
                "stderr", f"[rtnb] rank {context.world_rank}: {text}\n"
            ),
            profile=lambda name, step: self.profiling.trigger(name, step),
            as_checkpoint=_as_checkpoint,
        )
        self.reports = RankReports(
            self._cond,
            context.world_rank,
            context.storage_path,
            context.run_name,
            self.stop,
            self.controls,
            recording=lambda: self.profiling.recording,
        )
        self.profiling = RankProfiling(
            context.world_rank,
            self._cond,
            cell_thread=lambda: self._cell_thread,
            run_directory=self.reports.run_directory,
            stop_at=self._stop_profile_at,
        )
        self.debugger = RankDebugger(
            context.world_rank,
            self._cond,
            stopping=lambda: self.stop.wanted,
            cell_thread=lambda: self._cell_thread,
            replaying=lambda: self.reports.replaying,
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
        self.reports.make_current()
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
        self.reports.make_current(False)
        if _CURRENT is self:
            _CURRENT = None

    @property
    def step(self) -> int:
        """The last step reported (-1: none yet)."""
        return self.reports.step

    @property
    def line(self) -> int:
        """The line of training the step belongs to (0 unless a resume branched)."""
        return self.reports.line

    def set_step(self, step: int, line: int = 0) -> None:
        """Go on from ``step`` on ``line`` (a rank added by a scale, a resume)."""
        self.reports.move_to(step, line)

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
            self._value = None
            self._error = None
            self.reports.cell_starts_locked(request)
            self.stop.reset_locked()
            self.debugger.cell_starts()
            self.controls.cell_starts_locked(request.controls, request.triggers)
            self.reports.refresh_boundary_locked()
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
        self._sources.add(filename, code)
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
            error = (error_summary(exc), user_traceback(exc, filename))
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
                self.reports.finish_uploads()
            except BaseException as exc:  # noqa: BLE001 - the upload's own error
                if state is CellState.DONE:
                    state = CellState.ERROR
                    error = (error_summary(exc), error_summary(exc) + "\n")
            flush_std()
        with self._cond:
            self._state, self._value, self._error = state, value, error
            self._exception = exception
            self.stop.reset_locked()
            self.controls.cell_ends_locked()
            self.reports.refresh_boundary_locked()
            self._cond.notify_all()

    def _end_cell_tools(self) -> None:
        """A profile still recording ends with the cell (its trace is awaited briefly,
        so the cell's last update carries it, unless a stop is under way: the stop's
        grace is for the ranks to leave); a debugger stepped past the cell's end goes."""
        self.profiling.cell_ends(self.reports.step, stopping=self.stop.wanted)
        self.debugger.cell_ends()

    # ---- the long-poll ---------------------------------------------------------------
    def wait(self, timeout: float = 0.5, batch_s: float = 0.02) -> RankUpdate:
        """Long-poll: return when the cell ends, when output or reports have waited
        ``batch_s`` to be batched, when a rank pauses for a stop, or at ``timeout``."""
        deadline = time.monotonic() + timeout
        first_event: float | None = None
        reports = self.reports
        with self._cond:
            while True:
                now = time.monotonic()
                if (
                    self._state is not CellState.RUNNING
                    or self.stop.pause_unreported
                    or self.debugger.waiting_unreported
                ):
                    break
                buffered = reports.buffered()
                if self._output or buffered:
                    first_event = first_event or now
                    # A loop reporting thousands of times a second gets longer
                    # batches: each answered poll costs the kernel and Ray a
                    # millisecond or two of CPU, taken from the ranks on a small machine.
                    window = batch_s * (_BUSY_FACTOR if buffered >= _BUSY_REPORTS else 1)
                    if now - first_event >= window:
                        break
                    wake = min(deadline, first_event + window)
                else:
                    wake = deadline
                if now >= deadline:
                    break
                self._cond.wait(wake - now)
            update, columns = self._drain_locked()
        # Packed outside the lock, so report() in the training loop never waits on it.
        update.reports = columns.take()
        if self._sampler is None:
            self._sampler = ResourceSampler(gpu_index=_gpu_index(self.context.device))
        if self._sampler.due() and update.state is CellState.RUNNING and not reports.replaying:
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
                and self.stop.paused_at is None
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
        if self._output or self._dropped_chars:
            return True
        if self.controls.undelivered_locked() or self.profiling.has_result:
            return True
        return self.reports.undelivered_locked()

    def _drain_locked(self) -> tuple[RankUpdate, ReportColumns]:
        output, self._output, self._output_chars = self._output, [], 0
        if self._dropped_chars:
            output.append(
                ("stderr", f"[rtnb: {self._dropped_chars} characters of output dropped]\n")
            )
            self._dropped_chars = 0
        reports, checkpoints = self.reports.take_locked()
        self.stop.pause_taken_locked()
        update = self._update_locked(output, checkpoints)
        update.debugging = self.debugger.where_reported_locked()
        update.profile = self.profiling.take_result_locked()
        self.controls.drain_locked(update)
        return update, reports

    def _update_locked(self, output: list, checkpoints: list) -> RankUpdate:
        reports = self.reports
        uploading, upload_waited_s = reports.uploading_locked()
        return RankUpdate(
            rank=self.context.world_rank,
            cell=self._cell_id,
            state=self._state,
            # The driver commits a step once every rank has passed it, so a step
            # whose files are still uploading is not passed yet.
            step=reports.committable_step_locked(),
            uploading=uploading,
            upload_waited_s=upload_waited_s,
            paused_at=self.stop.paused_at,
            output=output,
            checkpoints=checkpoints,
            value=self._value if self._state is CellState.DONE else None,
            error=self._error if self._state is CellState.ERROR else None,
            exception=self._exception if self._state is CellState.ERROR else None,
            loaded_checkpoint=reports.loaded_checkpoint,
            line=reports.line,
            storage_error=reports.storage_error,
            data_waits=self.shard_waits.snapshot() if self.datasets else {},
        )

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

    # ---- control calls (any thread) -------------------------------------------------
    def command(self, command: Command, payload: Any = None) -> Any:
        """A control call from the driver (:mod:`rtnb.worker._commands`)."""
        return command.apply(self, payload)

    def wake_poll(self) -> None:
        """Let a long-poll waiting to batch output answer now (it looks again)."""
        with self._cond:
            self._cond.notify_all()

    def request_stop(self) -> int:
        with self._cond:
            if self._state is CellState.RUNNING:
                self.stop.request_locked()
                self.reports.refresh_boundary_locked()
                self._cond.notify_all()
            return self.reports.step

    def set_stop_target(self, step: int) -> None:
        with self._cond:
            self.stop.set_target_locked(step)
            self._cond.notify_all()

    def interrupt(self) -> bool:
        """Raise CellStopped inside the cell thread (reaches pure-Python code only)."""
        with self._cond:
            if self._state is not CellState.RUNNING:
                return False
            self.stop.interrupt_locked()
            self.reports.refresh_boundary_locked()
            self._cond.notify_all()
        ident = self._cell_thread
        if ident is None:
            return False
        hit = ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(ident), ctypes.py_object(CellStopped)
        )
        return hit == 1

    def hold(self, change: int = 0) -> int | None:
        """Pause at the next report until :meth:`release`; the rank's step now (it
        pauses at this step + 1 at the latest), None when no cell can take a change
        (none running, a replay, a stop under way) or change ``change`` was released
        already."""
        with self._cond:
            if self._state is not CellState.RUNNING or self.reports.replaying:
                return None
            if not self.stop.hold_locked(change):
                return None
            self.reports.refresh_boundary_locked()  # what report() checks, in C too
            return self.reports.step

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
            self.stop.release_locked(change)
            self.controls.release_locked(changes, from_step, triggers)
            self.reports.refresh_boundary_locked()
            self._cond.notify_all()

    def _stop_profile_at(self, step: int) -> None:
        with self._cond:
            self.controls.due_at_locked(step, PROFILE_STOP)
            self.reports.refresh_boundary_locked()

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
