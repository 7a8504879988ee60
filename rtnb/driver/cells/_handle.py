"""Running one cell on the ranks: streaming, results, errors, and the stop protocol.

:class:`CellHandle` drives a cell from the driver: it long-polls every rank, feeds
output, reports and checkpoint offers to the session as they arrive (each poll
answer is one :class:`~rtnb.core._messages.RankUpdate`), and turns the ranks'
outcomes into a :class:`PerRank` value or one rtnb error. Stopping (interrupt,
timeout, ``handle.stop()``) goes through the phases of its
:class:`~rtnb.driver.ranks._stopping.StopProtocol`. A rank that dies (or a stop that does not end) is a
:class:`~rtnb.driver.lifecycle._policies.Failure` the cell hands to its context: the recovery
flow decides and rebuilds, and the cell follows the outcome (runs again on the new
group, or ends with its error); it never rebuilds the group itself.

A handle gets a :class:`CellContext` — the few calls it makes — never the session.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from rtnb.core._changes import CellChanges
from rtnb.core._messages import CellRequest, CellState, RankUpdate
from rtnb.core._output import CellOutput, OutputSink
from rtnb.core._stacks import GroupStacks
from rtnb.core._values import PerRank
from rtnb.driver.cells._controls import CellControls
from rtnb.driver.cells._observers import CellObservers, ObserverContext
from rtnb.driver.cells._outcome import (
    Completion,
    WatchedGroup,
    failed_rank_first,
    first_cause,
    judge,
    ray_lost_ending,
)
from rtnb.driver.cells._saves import CellSaves
from rtnb.driver.cells._watch_breakpoints import BreakpointWatch
from rtnb.driver.cells._watch_hang import HangDoctor
from rtnb.driver.cells._watch_restart import RestartOrigin
from rtnb.driver.lifecycle import Failure, RankDied, RecoveryOutcome
from rtnb.driver.ranks import Execution, RankGroup, StopProtocol
from rtnb.errors import (
    CellInterrupted,
    ClusterError,
    RtnbError,
    WorkerGroupError,
    one_line,
)
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._logs import RankLogs

__all__ = ["CellContext", "CellHandle"]

# How often the driver loop wakes to check stop deadlines and Ctrl-C.
_TICK_S = 0.1


class _Restart(Exception):
    """Internal: a rank died, or the cell could not be stopped in place."""


class _RayLost(Exception):
    """Internal: the Ray under the group is gone; nothing to rebuild on."""


class CellContext(WatchedGroup, ObserverContext, Protocol):
    """What a cell needs of the session's other flows (the cell flow gives it): what
    its waiters read of the group, what its observers need, and more."""

    run_name: str

    def check_ray_lost(self, settle_s: float = 0.0) -> str | None: ...

    def require_group(self, wait_s: float = 0.0) -> RankGroup: ...

    def checkpoint_for(self, replay: bool) -> Checkpoint | None: ...

    def commit(self, handle: CellHandle) -> None: ...

    def latest_checkpoint_id(self) -> str | None: ...

    def recover(self, failure: Failure, before: int | None) -> RecoveryOutcome: ...

    def cell_ended(self, handle: CellHandle) -> None: ...

    def record_controls(
        self, handle: CellHandle, values: dict[str, Any], step: int, triggers: tuple[str, ...]
    ) -> None: ...


class CellHandle:
    """A cell running (or finished) on the ranks of a session.

    ``wait()`` returns its :class:`PerRank` value or raises its error; ``stop()``
    stops it on every rank; ``log`` keeps the recent output for late viewers.
    ``loaded`` maps each rank to the checkpoint its ``get_checkpoint()`` handed
    out; after a recovery ``restarted_from`` is what the ranks really loaded.
    """

    def __init__(
        self,
        context: CellContext,
        cell_id: int,
        code: str,
        ranks: list[int],
        timeout_s: float | None = None,
        background: bool = False,
        *,
        replay: bool = False,
        journal_seq: int | None = None,
        label: str | None = None,
        controls: tuple[tuple[str, Any, int], ...] = (),
        triggers: tuple[tuple[int, str], ...] = (),
        saved: CellChanges | None = None,
    ) -> None:
        """``saved``: the changes the saved notebook's cell received (``rtnb run``)."""
        self._context = context
        self.cell_id = cell_id
        self.label = label  # Jupyter's "[4]" for the header and errors, else rtnb's number
        self.code = code
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.background = background
        self.replay = replay  # rebuilding state after a failure: nothing is published
        self.journal_seq = journal_seq
        self.started_at = time.time()
        self.ended_at: float | None = None
        self._output = CellOutput(lambda rank: _kept_where(context.logs, rank))
        self.reported, self.recoveries = False, 0
        self.recovering = False  # the group is being rebuilt for this cell right now
        self._stopped_for_failure = False  # the stop asked because a rank's cell raised
        self._end = Completion()
        self._checkpoint: Any = None  # the checkpoint this cell's dispatch carries
        self._begin_attempt()
        self._stopping = StopProtocol(context.stop_grace_s)
        self._saves = CellSaves(context, self.stop)
        self.controls = CellControls(lambda: self.name, code, replay, controls, triggers, saved)
        for step, text in self.controls.saved_markers():
            context.metrics.add_marker(step, text)
        # The features that follow the cell (cells/_observers.py' FEATURES).
        self.observers = CellObservers(self, context)

    def _begin_attempt(self) -> None:
        """What one run of the cell on one group knows of its ranks; all of it starts
        again when the cell runs again on a rebuilt group. Kept on self so the driver
        loop can be re-entered after Ctrl-C."""
        self.steps: dict[int, int] = {r: -1 for r in self.ranks}  # -1: not heard from yet
        self.states: dict[int, str] = {r: "running" for r in self.ranks}
        self.loaded: dict[int, str | None] = {}
        self.lines: dict[int, int] = {}  # each rank's line of training (see _commits)
        self.data_waits: dict[int, dict[str, float]] = {}  # RankUpdate.data_waits, running
        # This attempt's run on the group: the ranks' calls and answers.
        self._execution: Execution | None = None

    @property
    def _finished(self) -> dict[int, RankUpdate]:
        return self._execution.finished if self._execution is not None else {}

    # ---- public ------------------------------------------------------------------------
    def add_sink(self, sink: OutputSink, replay: bool = True) -> None:
        """Send this cell's output to ``sink(rank, stream, text)`` (past output first)."""
        self._output.add_sink(sink, replay)

    @property
    def log(self) -> list[tuple[int, str, str]]:
        """The recent output, (rank, stream, text), for views opened late."""
        return self._output.log

    @property
    def hang(self) -> GroupStacks | None:
        """Every rank's stack, once the hang doctor read them (until they move)."""
        doctor = self.observers.find(HangDoctor)
        return doctor.stacks if doctor is not None else None

    @property
    def restarted_from(self) -> str | None:
        """What the ranks loaded when the cell ran again after a recovery."""
        origin = self.observers.find(RestartOrigin)
        return origin.origin if origin is not None else None

    @property
    def debugging(self) -> list[int]:
        """Ranks a background cell left at a breakpoint (``%rtnb debug`` attaches)."""
        return self.observers.find(BreakpointWatch).debugging

    @property
    def stopping(self) -> bool:
        """A stop of this cell is under way."""
        return self._stopping.requested

    def before_end(self, last_words: Callable[[], None]) -> None:
        """Call ``last_words()`` as the cell ends, before its output is flushed, so
        what it notes (a pipeline's summary) is still the cell's."""
        self._end.before_end(last_words)

    def add_done_callback(self, callback: Callable[[CellHandle], None]) -> None:
        self._end.add_callback(callback, self)

    def done(self) -> bool:
        return self._end.done()

    def wait(self, timeout: float | None = None) -> PerRank:
        """Block until the cell ends; its value per rank, or its error raised.

        Never hangs on a group that is gone: a cell whose group was stopped and that
        has not ended within the stop grace raises one SessionError line; one whose
        Ray went away, the cell's own ClusterError line within a second."""
        return self._end.wait(timeout, self.name, self._context)

    result = wait

    def wait_left(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the cell to end; True when every rank left it
        by itself (dead or stuck ranks never do)."""
        self._end.wait_done(timeout)
        return self.done() and len(self._finished) == len(self.ranks)

    @property
    def error(self) -> BaseException | None:
        return self._end.error

    @property
    def elapsed_s(self) -> float:
        return (self.ended_at or time.time()) - self.started_at

    def stop(self, reason: str = "stopped by the user", final: bool = False) -> None:
        """Ask every rank to stop (cooperatively first); returns at once.

        ``final``: the group is about to go away (stop, restart, scale): after the
        cooperative grace the cell just ends; whoever asked removes the group."""
        self._stopping.request(reason, final)

    @property
    def name(self) -> str:
        """What messages call this cell: ``cell [4]`` (the notebook's execution
        count) when it came from a notebook cell, else ``cell 3`` (rtnb's number)."""
        return f"cell {self.label or self.cell_id}"

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<rtnb cell {self.cell_id} on ranks {self.ranks}: {state}, {self.elapsed_s:.1f} s>"

    # ---- driving -----------------------------------------------------------------------
    def run_here(self) -> PerRank:
        """Drive the cell in this thread until it ends (Ctrl-C stops it on every rank)."""
        self._dispatch()
        while not self.done():
            try:
                self._loop()
            except KeyboardInterrupt:
                self.stop("interrupted (Ctrl-C / kernel interrupt)")
        return self.wait(0)

    def run_in_background(self) -> None:
        self._dispatch()
        thread = threading.Thread(target=self._loop, name=f"rtnb-cell-{self.cell_id}", daemon=True)
        thread.start()

    def drive_replay(self) -> dict[int, tuple]:
        """Run a replayed cell to its end in this thread: {rank: error} of the ranks
        it failed on; a rank death raises RankDied."""
        self._dispatch()
        try:
            self._drive()
        except _Restart:
            raise RankDied() from None
        return {r: u.error for r, u in self._finished.items() if u.error is not None}

    def _dispatch(self) -> None:
        group = self._context.require_group()
        self._checkpoint = self._context.checkpoint_for(self.replay)
        request = CellRequest(
            self.cell_id,
            self.code,
            self._checkpoint,
            self.replay,
            label=self.label,
            controls=tuple(self.controls.schedule),
            triggers=tuple(self.controls.triggers),
        )
        self._execution = group.execute(request, self.ranks)

    def _loop(self) -> None:
        while True:
            try:
                self._drive()
                failed = self._failed_cell()
                if failed is None:
                    self._finish_normally()
                    return
                if self._follow(self._hand_to_recovery(failed)):
                    continue
                return
            except _RayLost:
                self._finish_ray_lost()
                return
            except _Restart:
                if self._context.check_ray_lost():
                    self._finish_ray_lost()
                    return
                if self._stopping.final:
                    self._finish_abandoned()
                    return
                lost = Failure.of_ranks(
                    self.name,
                    self._execution.dead if self._execution is not None else {},
                    self.unfinished(),
                    self._stopping.reason,
                    self._stopped_for_failure,
                )
                if self._follow(self._hand_to_recovery(lost)):
                    continue
                return
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - never leave a handle hanging
                # A GCS that just went away shows first as an unknown object owner.
                if not isinstance(exc, RtnbError) and self._context.check_ray_lost(settle_s=2.5):
                    self._finish_ray_lost()
                    return
                self._finish(
                    error=exc
                    if isinstance(exc, RtnbError)
                    else WorkerGroupError(f"lost contact with the ranks: {one_line(exc)}")
                )
                return

    def _follow(self, outcome: RecoveryOutcome) -> bool:
        """Do what the controller decided; True when the cell runs again."""
        if outcome.ray_lost:
            self._finish_ray_lost()
        elif outcome.keep_error:
            self._finish_normally()  # the cell ends with its own error
        elif outcome.error is not None:
            failed = self._stopped_for_failure
            self._finish(error=failed_rank_first(outcome.error, self._finished, failed))
        else:
            return self._restart_on_new_group(outcome)
        return False

    def _drive(self) -> None:
        execution = self._execution
        assert execution is not None, "a cell is dispatched before it is driven"
        while not execution.over:
            if self._context.ray_lost:
                raise _RayLost()
            for update in execution.take(_TICK_S):
                self._apply(update)
            if execution.dead:
                raise _Restart()
            self._stop_after_a_failed_rank()
            self._saves.commit(self)
            if self._stopping.timed_out(self.elapsed_s, self.timeout_s):
                self.stop(f"timed out after {self.timeout_s:g} s (--timeout)")
            self.observers.tick()
            self._make_asked_changes(execution)
            if execution.advance_stop(self._stopping, self.steps):
                self.observers.stop_ran_out(execution.last)
                raise _Restart()

    def _stop_after_a_failed_rank(self) -> None:
        """A rank whose cell raised leaves the others waiting for it in their next
        collective, for ever: stop them (cooperatively, then as any stop escalates),
        as Ray Train ends every worker when one fails."""
        if self._stopping.requested or not self.unfinished():
            return
        cause = first_cause(self._finished)
        if cause is not None:
            self._stopped_for_failure = True
            self.stop(
                f"stopped: rank {cause[0]} failed ({cause[1]}); the other ranks would wait "
                "for it in their next collective"
            )

    def _failed_cell(self) -> Failure | None:
        """A cell whose code raised, for the controller's failure policy to decide on
        (the one place that does: a sweep's trial runs again, as with Tune's
        FailureConfig; a notebook cell keeps its error); None when there is nothing to
        decide (no error, a replay, the user's own stop, a storage failure)."""
        cause = first_cause(self._finished)
        own_stop = self._stopping.requested and not self._stopped_for_failure
        if cause is None or self.replay or own_stop or self._saves.failed:
            return None
        return Failure(self.name, error=f"rank {cause[0]}: {cause[1]}")

    def _hand_to_recovery(self, failure: Failure) -> RecoveryOutcome:
        """The failure, to the controller, which decides and rebuilds."""
        self.recovering = True
        try:
            return self._context.recover(failure, self.journal_seq)
        finally:
            self.recovering = False

    def _restart_on_new_group(self, outcome: RecoveryOutcome) -> bool:
        """Run this cell again on the rebuilt group (the journal was replayed up to
        it); ``rtnb.get_checkpoint()`` returns the checkpoint in force (the latest
        committed one, unless one chosen for this cell has not been superseded).
        False (the cell ended with an error) when none of its ranks is in it."""
        # A policy that shrank the group: the cell goes on on the ranks that remain.
        remaining = outcome.ranks_kept(self.ranks)
        if not remaining:
            self._finish(error=outcome.ranks_left_out(self.name, self.ranks))
            return False
        self.ranks = remaining
        self.recoveries += 1
        self.note(outcome.restart_note(self.name))
        if self._stopped_for_failure:
            # That stop ended with the failed attempt; kept, it would stop the rerun's
            # ranks once its grace ran out. A stop the user asked for still holds.
            self._stopping = StopProtocol(self._context.stop_grace_s)
            self._stopped_for_failure = False
        # The new ranks start again from the checkpoint's step, below what the dead
        # ones had reached: a stale step left over would let a checkpoint commit
        # before every new rank offered its shard.
        self._begin_attempt()
        self.observers.restart()
        self._dispatch()
        return True

    def note(self, text: str) -> None:
        """A line from rtnb itself to this cell's viewers (rank -1 for the sinks)."""
        self._output.note(text)

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint this cell's ranks went on from, when it moved their step
        count back (a resume); with the branch it started, if any."""
        checkpoint = self._checkpoint
        resume = getattr(checkpoint, "resume", None)
        if self.replay or resume is None or not self.loaded:
            return None
        line = max(self.lines.values(), default=0)
        return checkpoint.id + (f" (branch {line})" if line else "")

    def _apply(self, update: RankUpdate) -> None:
        rank = update.rank
        self.steps[rank] = update.step
        self.lines[rank] = update.line
        self.states[rank] = "paused" if update.paused_at is not None else str(update.state)
        self.data_waits[rank] = update.data_waits if update.state is CellState.RUNNING else {}
        if update.loaded_checkpoint is not None and rank not in self.loaded:
            self.loaded[rank] = update.loaded_checkpoint
        self.reported = self.reported or bool(update.reports)
        applied = self.controls.took(update)
        if applied:
            self._context.metrics.add_controls_applied(rank, applied)
        # The observers keep the update before its output reaches the viewers, so a
        # view that opens on the first report finds the reports that came with it.
        self.observers.update(update)
        for stream, text in update.output:
            self._output.write(rank, stream, text)

    # ---- what its observers may ask -----------------------------------------------------
    def storage_failed(self, what: str) -> None:
        """A write to the run's storage failed: the cell stops at one step."""
        self._saves.storage_failed(what)

    def show(self, rank: int, text: str) -> None:
        """``text`` as rank ``rank``'s own output (a debugger's lines)."""
        self._output.send(rank, "stdout", text)

    # ---- live controls (``controls``: what the ranks declared, what a saved notebook keeps)
    def _make_asked_changes(self, execution: Execution) -> None:
        made = self.controls.make_asked(
            execution,
            self._stopping.requested,
            self.steps,
            lambda values, step, triggers: self._context.record_controls(
                self, values, step, triggers
            ),
            self.done,
        )
        for step, shown in made:
            self._context.metrics.add_marker(step, shown)
            self.note(f"[rtnb] {shown} at step {step} on every rank\n")

    # ---- stopping ----------------------------------------------------------------------
    def unfinished(self) -> list[int]:
        """The ranks whose cell has not ended."""
        execution = self._execution
        return execution.unfinished() if execution is not None else list(self.ranks)

    # ---- outcomes ----------------------------------------------------------------------
    def _finish_normally(self) -> None:
        finished = self._finished
        error = self._saves.ending_error(self.name, finished, self._stopping.target)
        if error is not None:
            self._finish(error=error)
            return
        outcome = judge(self.name, finished, self._stopping, self._stopped_for_failure)
        if outcome.note:
            self.note(outcome.note)
        self._finish(outcome.value, outcome.error)

    def _finish_abandoned(self) -> None:
        """The group is going away under this cell (stop, restart, scale)."""
        self._finish(
            error=CellInterrupted(
                f"{self.name} {self._stopping.reason}; the ranks' variables go with the group",
                kept=False,
            )
        )

    def _finish_ray_lost(self) -> None:
        lost = self._context.ray_lost or "the Ray under the worker group is gone"
        self._finish(error=ClusterError(ray_lost_ending(self.name, lost)))

    def _finish(self, value: PerRank | None = None, error: BaseException | None = None) -> None:
        self._end.begin()
        value, error = self._saves.last_commit(self, value, error)
        self.observers.end()
        self._end.last_words()
        self._output.flush()
        self._end.ending(value, error)
        self.ended_at = time.time()
        for rank in self.ranks:
            if self.states.get(rank) in ("running", "paused"):
                self.states[rank] = "stopped"
        if not self.replay:
            self._context.cell_ended(self)
        self.controls.close()  # changes asked too late: their callers get None
        self._end.ended(self)


def _kept_where(logs: RankLogs | None, rank: int) -> str:
    return logs.where(rank) if logs is not None else "the run"
