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

What its readers see of the cell is its base, :class:`~rtnb.driver.cells._record.CellRecord`;
each run of it on a group, an :class:`~rtnb.driver.cells._attempt.Attempt`; whether and
why it stops, its :class:`~rtnb.driver.cells._cell_stop.CellStop`. A handle gets a
:class:`CellContext` — the few calls it makes — never the session.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from rtnb.core._changes import CellChanges
from rtnb.core._messages import CellRequest, RankUpdate
from rtnb.core._values import PerRank
from rtnb.driver.cells._attempt import Attempt
from rtnb.driver.cells._controls import CellControls
from rtnb.driver.cells._observers import CellObservers, ObserverContext
from rtnb.driver.cells._outcome import (
    WatchedGroup,
    failed_rank_first,
    ray_lost_ending,
)
from rtnb.driver.cells._record import CellRecord
from rtnb.driver.cells._saves import CellSaves
from rtnb.driver.lifecycle import Failure, RankDied, RecoveryOutcome
from rtnb.driver.ranks import Execution, RankGroup
from rtnb.errors import (
    CellInterrupted,
    ClusterError,
    RtnbError,
    WorkerGroupError,
    one_line,
)
from rtnb.storage._checkpoint import Checkpoint

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


class CellHandle(CellRecord):
    """Drives a cell on the ranks (what its readers see is its :class:`CellRecord`):
    dispatch, the driving loop, stop escalation, recovery and the finish."""

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
        super().__init__(
            context,
            lambda rank: context.logs.where(rank) if context.logs is not None else "the run",
            cell_id,
            code,
            ranks,
            label,
            timeout_s,
            background,
            replay,
        )
        self._context = context
        self.journal_seq = journal_seq
        self._saves = CellSaves(context, self.stop)
        self.controls = CellControls(lambda: self.name, code, replay, controls, triggers, saved)
        for step, text in self.controls.saved_markers():
            context.metrics.add_marker(step, text)
        # The features that follow the cell (cells/_observers.py' FEATURES).
        self.observers = CellObservers(self, context)

    def stop(self, reason: str = "stopped by the user", final: bool = False) -> None:
        """Ask every rank to stop (cooperatively first); returns at once.

        ``final``: the group is about to go away (stop, restart, scale): after the
        cooperative grace the cell just ends; whoever asked removes the group."""
        self._stopping.request(reason, final)

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
        return {r: u.error for r, u in self.attempt.finished.items() if u.error is not None}

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
        self.attempt.execution = group.execute(request, self.ranks)

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
                execution = self.attempt.execution
                lost = Failure.of_ranks(
                    self.name,
                    execution.dead if execution is not None else {},
                    self.unfinished(),
                    self._stopping.reason,
                    self._stopping.for_failure,
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
            failed = self._stopping.for_failure
            self._finish(error=failed_rank_first(outcome.error, self.attempt.finished, failed))
        else:
            return self._restart_on_new_group(outcome)
        return False

    def _drive(self) -> None:
        attempt = self.attempt
        execution = attempt.execution
        assert execution is not None, "a cell is dispatched before it is driven"
        while not execution.over:
            if self._context.ray_lost:
                raise _RayLost()
            self._apply(execution.take(_TICK_S))
            if execution.dead:
                raise _Restart()
            # A rank whose cell raised leaves the others waiting for it in their next
            # collective, for ever: they are stopped, as Ray Train ends every worker
            # when one fails.
            self._stopping.check(
                attempt.finished, attempt.unfinished(), self.elapsed_s, self.timeout_s
            )
            self._saves.commit(self)
            self.observers.tick()
            self._make_asked_changes(execution)
            if execution.advance_stop(self._stopping.protocol, attempt.steps):
                self.observers.stop_ran_out(execution.last)
                raise _Restart()

    def _failed_cell(self) -> Failure | None:
        """A cell whose code raised, for the controller's failure policy to decide on
        (the one place that does: a sweep's trial runs again, as with Tune's
        FailureConfig; a notebook cell keeps its error); None when there is nothing to
        decide (no error, a replay, the user's own stop, a storage failure)."""
        if self.replay or self._saves.failed:
            return None
        return self._stopping.failure(self.name, self.attempt.finished)

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
        self.recoveries += 1
        self.note(outcome.restart_note(self.name))
        self._stopping.forgive_failure()
        self.attempt = Attempt(remaining)
        self.observers.restart()
        self._dispatch()
        return True

    def _apply(self, updates: list[RankUpdate]) -> None:
        """The updates a turn of the loop took, in order: stage by stage over all of
        them (a fanned-out cell brings 16 or more at once)."""
        if not updates:
            return
        took, controls = self.attempt.took, self.controls.took
        for update in updates:
            took(update)
            self.reported = self.reported or bool(update.reports)
            applied = controls(update)
            if applied:
                self._context.metrics.add_controls_applied(update.rank, applied)
        # The observers keep the updates before their output reaches the viewers, so a
        # view that opens on the first report finds the reports that came with it.
        self.observers.updates(updates)
        for update in updates:
            for stream, text in update.output:
                self._output.write(update.rank, stream, text)

    # ---- what its observers may ask -----------------------------------------------------
    def storage_failed(self, what: str) -> None:
        """A write to the run's storage failed: the cell stops at one step."""
        self._saves.storage_failed(what)

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

    # ---- outcomes ----------------------------------------------------------------------
    def _finish_normally(self) -> None:
        finished = self.attempt.finished
        error = self._saves.ending_error(self.name, finished, self._stopping.protocol.target)
        if error is not None:
            self._finish(error=error)
            return
        outcome = self._stopping.judge(self.name, finished)
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
        self.attempt.ended()
        if not self.replay:
            self._context.cell_ended(self)
        self.controls.close()  # changes asked too late: their callers get None
        self._end.ended(self)
