"""Running one cell on the ranks: streaming, results, errors, and the stop protocol.

:class:`CellHandle` drives a cell from the driver: it long-polls every rank, feeds
output, reports and checkpoint offers to the session as they arrive (each poll
answer is one :class:`~rtnb.core._messages.RankUpdate`), and turns the ranks'
outcomes into a :class:`PerRank` value or one rtnb error. Stopping (interrupt,
timeout, ``handle.stop()``) goes through the phases of its
:class:`~rtnb.driver._stopping.StopProtocol`. A rank that dies (or a stop that does not end) is a
:class:`~rtnb.driver._policy.Failure` the cell hands to its context: the recovery
flow decides and rebuilds, and the cell follows the outcome (runs again on the new
group, or ends with its error); it never rebuilds the group itself.

A handle gets a :class:`CellContext` — the few calls it makes — never the session.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rtnb.core._changes import CellChanges, change_text
from rtnb.core._messages import CellRequest, CellState, RankUpdate, StopPhase
from rtnb.core._output import OutputSink
from rtnb.core._profile import PROFILE_START
from rtnb.core._stacks import GroupStacks
from rtnb.core._values import PerRank, from_portable
from rtnb.driver._group import RankGroup, RankLost
from rtnb.driver._policy import Failure, RankDied, RecoveryOutcome
from rtnb.driver._state import GroupState
from rtnb.driver._stopping import StopProtocol
from rtnb.errors import (
    CellError,
    CellInterrupted,
    CheckpointError,
    ClusterError,
    RtnbError,
    SessionError,
    StorageError,
    WaitTimeout,
    WorkerGroupError,
    one_line,
)
from rtnb.metrics._store import MetricsStore
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import CheckpointStore
from rtnb.storage._logs import RankLogs
from rtnb.worker._actor import POLL_WAIT_S

__all__ = ["CellContext", "CellHandle"]

# How often the driver loop wakes to check stop deadlines and Ctrl-C.
_TICK_S = 0.1
# How long the ranks get to answer a hold or a release for a live-control change.
_HOLD_WAIT_S = 10.0
_CHANGE_IDS = itertools.count(1)  # live-control changes, numbered per kernel
# How long rank 0 waits for the relayed ranks' answers: a first wait, and slack for
# a busy machine to wake them. A rank that did not answer by then (a longer cell: it
# runs in the listening thread and answers only when it ends) is asked directly.
_RELAY_WAIT_S = POLL_WAIT_S + 0.25
# How long wait() gives the cell's views to finish at its end (see wait).
_SETTLE_S = 30.0
# A cell keeps at most this much of its output in memory (for views opened late);
# all of it is in {run}/logs/rank-N.log.
_LOG_BYTES = 2_000_000


class _Restart(Exception):
    """Internal: a rank died, or the cell could not be stopped in place."""


class _RayLost(Exception):
    """Internal: the Ray under the group is gone; nothing to rebuild on."""


# What gloo and NCCL raise in a rank whose peer process went away.
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "NCCL communicator was aborted",
)


def _summary(error: tuple[str, str] | None) -> str:
    return error[0] if error else ""


class CellContext(Protocol):
    """What a cell needs of the session's other flows (the cell flow gives it)."""

    run_name: str
    metrics: MetricsStore
    checkpoints: CheckpointStore

    @property
    def stop_grace_s(self) -> float: ...

    @property
    def logs(self) -> RankLogs | None: ...

    @property
    def state(self) -> GroupState: ...

    @property
    def ray_lost(self) -> str | None: ...

    def check_ray_lost(self, settle_s: float = 0.0) -> str | None: ...

    def require_group(self, wait_s: float = 0.0) -> RankGroup: ...

    def checkpoint_for(self, replay: bool) -> Checkpoint | None: ...

    def commit(self, handle: CellHandle) -> None: ...

    def latest_checkpoint_id(self) -> str | None: ...

    def recover(self, failure: Failure, before: int | None) -> RecoveryOutcome: ...

    def cell_ended(self, handle: CellHandle) -> None: ...

    @property
    def hang_after_s(self) -> float: ...

    def attach_debugger(
        self,
        group: RankGroup,
        rank: int,
        show: Callable[[str], None],
        note: Callable[[str], None],
    ) -> bool: ...

    def profile_taken(self, handle: CellHandle, profiles: dict[int, Any]) -> None: ...

    def record_controls(
        self, handle: CellHandle, values: dict[str, Any], step: int, triggers: tuple[str, ...]
    ) -> None: ...

    def stacks(
        self, ranks: list[int] | None = None, stalled_s: float | None = None
    ) -> GroupStacks: ...


@dataclass
class _ControlRequest:
    values: dict[str, Any]
    triggers: tuple[str, ...] = ()
    done: threading.Event = field(default_factory=threading.Event)
    step: int | None = None
    error: BaseException | None = None


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
        """``saved``: the changes this cell received when the notebook last ran
        (``rtnb run`` of the saved notebook), made again at their steps."""
        self._context = context
        self.cell_id = cell_id
        # The notebook's name for the cell (Jupyter's "[4]"): what the header, the
        # errors and the tracebacks call it; rtnb's own cell number otherwise.
        self.label = label
        self.code = code
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.background = background
        self.replay = replay  # rebuilding state after a failure: nothing is published
        self.journal_seq = journal_seq
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.log: list[tuple[int, str, str]] = []
        self._log_bytes = 0
        self.reported = False
        self.recoveries = 0
        self.recovering = False  # the group is being rebuilt for this cell right now
        self.restarted_from: str | None = None  # what the ranks loaded after a restart
        self._sinks: list[OutputSink] = []
        self._last_words: list[Callable[[], None]] = []
        self._stopped_for_failure = False  # the stop asked because a rank's cell raised
        self._done_callbacks: list[Callable[[CellHandle], None]] = []
        self._callbacks_lock = threading.Lock()
        self._done = threading.Event()
        self._settled = threading.Event()  # the done-callbacks have run
        self._finishing_thread: threading.Thread | None = None
        self._value: PerRank | None = None
        self._error: BaseException | None = None
        self._checkpoint: Any = None  # the checkpoint this cell's dispatch carries
        self._request: CellRequest | None = None  # what the last dispatch sent
        self._begin_attempt()
        self._stopping = StopProtocol(context.stop_grace_s)
        self._commit_error: CheckpointError | None = None
        # The first storage write that failed during this cell (a rank's checkpoint
        # files, the metrics record, the logs, a commit): the cell stops at one step.
        self._storage_failure: str | None = None
        self._restart_noted = True
        # The hang doctor: when the ranks last reported or printed, and every rank's
        # stack once they have been quiet for the context's hang_after_s.
        self._last_activity = time.monotonic()
        self.hang: GroupStacks | None = None
        self._hang_reading = False
        # Live controls: this cell's changes as (name, value, from_step) — sent again
        # when it runs again (recovery) — the controls its ranks declared (name ->
        # default), what each rank reported applying, and changes asked for, applied
        # by the driving thread between two ticks.
        self.controls_schedule: list[tuple[str, Any, int]] = list(controls)
        self.triggers_schedule: list[tuple[int, str]] = list(triggers)
        # A saved notebook's changes are scheduled from the start; the %rtnb set
        # cells that made them, run again, claim theirs instead of changing again.
        self._unclaimed: list[tuple[int, dict[str, Any], list[str]]] = []
        if saved is not None:
            self.controls_schedule += saved.controls
            self.triggers_schedule += saved.triggers
            self._unclaimed = saved.by_step()
            for step, values, fired in self._unclaimed:
                context.metrics.add_marker(step, change_text(values, fired))
        self.declared_controls: dict[str, Any] = {}
        self.controls_applied: dict[int, list[tuple[str, Any, int]]] = {}
        self._control_requests: list[_ControlRequest] = []
        # Ranks stopped at a breakpoint (where), and those a background cell has
        # already said so of.
        self._debugging: dict[int, str] = {}
        # %rtnb profile: each rank's profile of the armed steps, as they arrive.
        self.profiles: dict[int, Any] = {}
        self._debug_noted: set[int] = set()
        self._control_lock = threading.Lock()

    def _begin_attempt(self) -> None:
        """What one run of the cell on one group knows of its ranks; all of it starts
        again when the cell runs again on a rebuilt group. Kept on self so the driver
        loop can be re-entered after Ctrl-C."""
        self.steps: dict[int, int] = {r: -1 for r in self.ranks}  # -1: not heard from yet
        self.states: dict[int, str] = {r: "running" for r in self.ranks}
        self.loaded: dict[int, str | None] = {}
        self.lines: dict[int, int] = {}  # each rank's line of training (see _commits)
        self._pending: dict[Any, int] = {}  # call in flight -> its rank
        # Rank 0's relay call while it is out (groups of RELAY_FROM_RANKS and more).
        self._relay_ref: Any = None
        self._last: dict[int, RankUpdate] = {}
        self._finished: dict[int, RankUpdate] = {}
        self._dead: dict[int, str] = {}

    # ---- public ------------------------------------------------------------------------
    def add_sink(self, sink: OutputSink, replay: bool = True) -> None:
        """Send this cell's output to ``sink(rank, stream, text)`` (past output first)."""
        if replay:
            for entry in list(self.log):
                sink(*entry)
        self._sinks.append(sink)

    def before_end(self, last_words: Callable[[], None]) -> None:
        """Call ``last_words()`` as the cell ends, before its output is flushed, so
        what it notes (a pipeline's summary) is still the cell's."""
        self._last_words.append(last_words)

    def add_done_callback(self, callback: Callable[[CellHandle], None]) -> None:
        # Checked and kept under the lock the end takes its list with: a cell ending
        # between the two would otherwise never call it back.
        with self._callbacks_lock:
            if not self._done.is_set():
                self._done_callbacks.append(callback)
                return
        callback(self)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> PerRank:
        """Block until the cell ends; its value per rank, or its error raised.

        Never hangs on a group that is gone: a cell whose group was stopped and that
        has not ended within the stop grace raises one SessionError line."""
        deadline = None if timeout is None else time.monotonic() + timeout
        gone_since: float | None = None
        while not self._done.wait(0.2):
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise WaitTimeout(
                    f"{self.name} is still running after {timeout:g} s; wait again, "
                    "or stop it (`handle.stop()`, or interrupt the kernel)"
                )
            state = self._context.state
            if state in (GroupState.STOPPED, GroupState.FAILED, GroupState.NEW):
                gone_since = gone_since or now
                if now - gone_since > self._context.stop_grace_s + 1.0:
                    raise SessionError(
                        f"{self.name} lost its worker group (the group is "
                        f"{state}); nothing is left to wait for"
                    )
        if threading.current_thread() is not self._finishing_thread:
            # What the cell's views do at its end (a live view leaves its lasting
            # figure) is done when wait returns: once `%rtnb wait` returned, a frontend
            # such as nbclient no longer takes output meant for the waiting cell, and
            # the widget would stay in the saved notebook. Under load that figure took
            # over 5 s (CI); bounded all the same, so a broken view cannot hang it.
            self._settled.wait(_SETTLE_S)
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    result = wait

    def wait_left(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the cell to end; True when every rank left it
        by itself (dead or stuck ranks never do)."""
        self._done.wait(timeout)
        return self.done() and len(self._finished) == len(self.ranks)

    @property
    def error(self) -> BaseException | None:
        return self._error

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
        while not self._done.is_set():
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
        # In a relaying group every cell goes through rank 0, one on a single rank
        # too: each listening rank runs all its cells in its listening thread.
        self._request = CellRequest(
            self.cell_id,
            self.code,
            self._checkpoint,
            self.replay,
            group.next_token(),
            self.label,
            tuple(self.controls_schedule),
            tuple(self.triggers_schedule),
        )
        if group.relays:
            # One call to rank 0 starts the cell everywhere and brings back the
            # answers of ranks that finished at once; the others are asked directly.
            self._relay_ref = group.relay(self._request, self.ranks, _RELAY_WAIT_S)
            return
        for rank in self.ranks:
            self._run_on(group, rank)

    def _run_on(self, group, rank: int) -> None:
        """Start this cell on ``rank`` (unless the relay did, under the same token) and
        keep its first long-poll in flight."""
        self._pending[group.run(rank, self._request)] = rank

    def _take_relayed(self, answers, group) -> None:
        """Rank 0's relay came back: finish the ranks that answered with their last
        update; ask the rest directly (the same token: none starts the cell twice)."""
        self._relay_ref = None
        answers = group.relay_answers(answers)
        for rank in self.ranks:
            update = answers.get(rank)
            if update is not None and update.state is not CellState.RUNNING:
                self._apply(update)
                self._finished[rank] = update
            else:
                self._run_on(group, rank)

    def _loop(self) -> None:
        while True:
            try:
                self._drive()
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
                outcome = self._hand_to_recovery()
                if outcome.ray_lost:
                    self._finish_ray_lost()
                    return
                if outcome.error is not None:
                    self._finish(error=outcome.error)
                    return
                if self._restart_on_new_group(outcome):
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
            self._finish_normally()
            return

    def _drive(self) -> None:
        group = self._context.require_group()
        while len(self._finished) + len(self._dead) < len(self.ranks):
            if self._context.ray_lost:
                raise _RayLost()
            self._ensure_polled(group)
            refs = list(self._pending)
            if self._relay_ref is not None:
                refs.append(self._relay_ref)
            ready, updates = group.take_ready(refs, _TICK_S)
            for ref, update in zip(ready, updates):
                if ref is self._relay_ref:
                    self._take_relayed(update, group)
                    continue
                rank = self._pending.pop(ref)
                if isinstance(update, BaseException):
                    self._dead[rank] = one_line(update)
                    continue
                self._apply(update)
                if update.state is CellState.RUNNING:
                    self._pending[group.poll(rank)] = rank
                else:
                    self._finished[rank] = update
            if self._dead:
                raise _Restart()
            self._stop_after_a_failed_rank()
            if self._debugging:
                self._serve_debuggers(group)
            self._commit()
            self._check_timeout()
            self._watch_for_hang()
            self._take_control_requests(group)
            if self._stopping.advance(group, self._unfinished(), self._last, self.steps):
                raise _Restart()

    def _stop_after_a_failed_rank(self) -> None:
        """A rank whose cell raised leaves the others waiting for it in their next
        collective, for ever: stop them (cooperatively, then as any stop escalates),
        as Ray Train ends every worker when one fails."""
        if self._stopping.requested or not self._unfinished():
            return
        failed = sorted(r for r, u in self._finished.items() if u.error is not None)
        summaries = {r: _summary(self._finished[r].error) for r in failed}
        # A collective that lost its peer is the symptom of a rank that died: its
        # death (a recovery) is what to wait for, not a stop.
        causes = [r for r in failed if not any(s in summaries[r] for s in _PEER_LOST)]
        if causes:
            self._stopped_for_failure = True
            self.stop(
                f"stopped: rank {causes[0]} failed ({summaries[causes[0]]}); the other "
                "ranks would wait for it in their next collective"
            )

    def _commit(self) -> None:
        if self.replay or self._commit_error is not None:
            return
        try:
            self._context.commit(self)
        except CheckpointError as exc:
            # The cell fails with this line; its ranks stop at a common step first.
            self._commit_error = exc
            self.stop(f"stopped: {exc}")
        except OSError as exc:  # the manifest could not be written
            self._storage_failed(str(exc))

    def _storage_failed(self, what: str) -> None:
        """A write to the run's storage failed: stop the cell on every rank at one step
        (cooperatively, as an interrupt does) and end it with one line saying so."""
        if self._storage_failure is None:
            self._storage_failure = what
            self.stop("stopped because storage failed")

    def _storage_error(self, finished: dict[int, RankUpdate]) -> StorageError:
        steps = {u.step for u in finished.values()}
        stopped = (
            f"every rank stopped at step {steps.pop()}" if len(steps) == 1 else "every rank stopped"
        )
        latest = None
        with contextlib.suppress(Exception):
            latest = self._context.latest_checkpoint_id()
        kept = (
            f"the last committed checkpoint is {latest}"
            if latest
            else "no checkpoint of this run was committed"
        )
        return StorageError(
            f"{self.name} stopped: {self._storage_failure}; {stopped}, the worker "
            f"group and its variables are intact and {kept}. Free space there (or fix "
            "its permissions) and run the next cell, or `%rtnb start --storage ELSEWHERE "
            f"--name {self._context.run_name} --replay`",
            kept=True,
            step=max((u.step for u in finished.values()), default=None),
        )

    def _hand_to_recovery(self) -> RecoveryOutcome:
        """The failure, to the recovery flow, which decides and rebuilds."""
        failure = Failure(
            self.name,
            dead=dict(self._dead),
            stuck=tuple(self._unfinished()) if not self._dead else (),
            # A rank that died while the others were being stopped after a failed
            # rank is a failure to recover from (its peers' errors were the symptom),
            # not a stop the user asked for.
            stop_reason=None if self._dead and self._stopped_for_failure else self._stopping.reason,
        )
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
        self.restarted_from = None
        self._restart_noted = False
        self._note(outcome.restart_note(self.name))
        # The new ranks start again from the checkpoint's step, below what the dead
        # ones had reached: a stale step left over would let a checkpoint commit
        # before every new rank offered its shard.
        self._begin_attempt()
        self._dispatch()
        return True

    def note(self, text: str) -> None:
        """A line from rtnb itself to this cell's viewers (rank -1 for the sinks)."""
        self._note(text)

    def _note(self, text: str) -> None:
        for sink in list(self._sinks):
            try:
                sink(-1, "stderr", text)
            except Exception:  # noqa: BLE001
                pass

    def _note_restart_origin(self, ended: bool = False) -> None:
        """Once every rank said which checkpoint it loaded (or the cell ended), name
        it: the ranks report it, the driver does not guess."""
        if self._restart_noted or (not ended and len(self.loaded) < len(self.ranks)):
            return
        self._restart_noted = True
        loaded = {r: self.loaded.get(r) for r in self.ranks}
        ids = sorted({c for c in loaded.values() if c})
        if not ids:
            self._note(f"[rtnb] {self.name} restarted without loading a checkpoint\n")
            return
        self.restarted_from = ids[-1] if len(ids) == 1 else ", ".join(ids)
        which = (
            "every rank"
            if all(loaded.values())
            else "ranks " + ", ".join(str(r) for r, c in loaded.items() if c)
        )
        self._note(f"[rtnb] {self.name} restarted from {self.restarted_from} ({which} loaded it)\n")

    def _ensure_polled(self, group) -> None:
        # A Ctrl-C can land between taking an update and re-polling; make sure every
        # unfinished rank always has a call in flight (the relay counts for all).
        if self._relay_ref is not None:
            return
        polled = set(self._pending.values())
        for rank in self.ranks:
            if rank not in polled and rank not in self._finished and rank not in self._dead:
                self._pending[group.poll(rank)] = rank

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
        if update.output or update.reports or update.step != self.steps.get(rank, -1):
            self._last_activity = time.monotonic()
            self.hang = None
        self._last[rank] = update
        self.steps[rank] = update.step
        self.lines[rank] = update.line
        self.states[rank] = "paused" if update.paused_at is not None else str(update.state)
        if update.loaded_checkpoint is not None and rank not in self.loaded:
            self.loaded[rank] = update.loaded_checkpoint
            self._note_restart_origin()
        context = self._context
        if update.storage_error is not None:
            self._storage_failed(update.storage_error)
        if update.reports:
            self.reported = True
            context.metrics.add(rank, update.reports)
            if context.metrics.log is not None and context.metrics.log.failure:
                self._storage_failed(
                    f"the metrics record could not be written: {context.metrics.log.failure}"
                )
        if update.resources and not self.replay:
            context.metrics.add_system(rank, update.resources)
        if update.debugging is not None and update.state is CellState.RUNNING:
            self._debugging[rank] = update.debugging
        else:
            self._debug_noted.discard(rank)
        if update.profile is not None and not self.replay:
            self.profiles[rank] = update.profile
            if set(self.profiles) >= set(self.ranks):
                taken, self.profiles = self.profiles, {}
                self._context.profile_taken(self, taken)
        if update.controls_declared:
            for name, default in update.controls_declared.items():
                self.declared_controls.setdefault(name, default)
        if update.controls_applied and not self.replay:
            self.controls_applied.setdefault(rank, []).extend(update.controls_applied)
            context.metrics.add_controls_applied(rank, update.controls_applied)
        for offer in update.checkpoints:
            context.checkpoints.offer(rank, offer)
        logs = context.logs
        for stream, text in update.output:
            if logs is not None and not self.replay:
                logs.add(rank, text)
                if logs.failure:
                    self._storage_failed(f"the ranks' output could not be kept: {logs.failure}")
            self._keep_in_log(rank, stream, text)
            for sink in list(self._sinks):
                try:
                    sink(rank, stream, text)
                except Exception:  # noqa: BLE001 - a broken view must not stop the cell
                    pass

    def _keep_in_log(self, rank: int, stream: str, text: str) -> None:
        if self._log_bytes > _LOG_BYTES:
            return
        self._log_bytes += len(text)
        self.log.append((rank, stream, text))
        if self._log_bytes > _LOG_BYTES:
            logs = self._context.logs
            where = logs.where(rank) if logs is not None else "the run"
            self.log.append(
                (
                    -1,
                    "stderr",
                    f"[rtnb: output beyond {_LOG_BYTES // 1_000_000} MB is kept in {where}]\n",
                )
            )

    # ---- the debugger ------------------------------------------------------------------
    def _serve_debuggers(self, group) -> None:
        """Ranks stopped at a breakpoint: a foreground cell's user answers them here
        (the cell's input box); a background cell says how to attach, once."""
        waiting, self._debugging = self._debugging, {}
        for rank, where in sorted(waiting.items()):
            if self._stopping.requested:
                continue  # the stop reaches the rank at its prompt: it leaves pdb
            if self.background or self.replay:
                if rank not in self._debug_noted:
                    self._debug_noted.add(rank)
                    self._note(
                        f"[rtnb] rank {rank} stopped at a breakpoint ({where}): run "
                        f"`%rtnb debug {rank}` in another cell to step through it\n"
                    )
                continue

            def show(text: str, rank: int = rank) -> None:
                for sink in list(self._sinks):
                    with contextlib.suppress(Exception):
                        sink(rank, "stdout", text)

            self._context.attach_debugger(group, rank, show, self._note)
            self._last_activity = time.monotonic()

    @property
    def debugging(self) -> list[int]:
        """Ranks a background cell left at a breakpoint (``%rtnb debug`` attaches)."""
        return sorted(self._debug_noted)

    # ---- live controls -----------------------------------------------------------------
    def change_controls(
        self, values: dict[str, Any], triggers: tuple[str, ...] = (), timeout_s: float = 30.0
    ) -> int | None:
        """Apply ``values`` and fire ``triggers`` on every rank at one step (any
        thread; the driving thread does it): that step, or None when the cell ended
        first."""
        request = _ControlRequest(dict(values), tuple(triggers))
        with self._control_lock:
            if self.done():
                return None
            self._control_requests.append(request)
        if not request.done.wait(timeout_s):
            with self._control_lock:
                taken = request not in self._control_requests
                if not taken:
                    self._control_requests.remove(request)  # never made later
            if not taken or not request.done.wait(_HOLD_WAIT_S * 2):
                raise WaitTimeout(
                    f"{self.name} did not take the change within {timeout_s:g} s; nothing "
                    "was changed"
                )
        if request.error is not None:
            raise request.error
        return request.step

    def claim_saved(self, values: dict[str, Any], triggers: tuple[str, ...]) -> int | None:
        """The step of the saved notebook's change equal to this one, scheduled since
        the cell began (it is not made twice), or None."""
        with self._control_lock:
            for i, (step, saved_values, fired) in enumerate(self._unclaimed):
                if saved_values == values and tuple(fired) == tuple(triggers):
                    del self._unclaimed[i]
                    return step
        return None

    def changes_record(self) -> dict[str, Any] | None:
        """What a saved notebook keeps of this cell's live changes (``rtnb run``
        makes them again), or None when it had none."""
        # A profile is this session's look, not a change to the training.
        triggers = [t for t in self.triggers_schedule if not t[1].startswith(PROFILE_START)]
        if self.replay or not (self.controls_schedule or triggers):
            return None
        return CellChanges(self.code, list(self.controls_schedule), triggers).to_json()

    def _take_control_requests(self, group) -> None:
        with self._control_lock:
            requests, self._control_requests = self._control_requests, []
        for request in requests:
            try:
                request.step = self._change_controls(group, request.values, request.triggers)
            except Exception as exc:  # noqa: BLE001 - said to the caller, never ends the cell
                request.error = exc
            request.done.set()

    def _change_controls(
        self, group, values: dict[str, Any], triggers: tuple[str, ...]
    ) -> int | None:
        """Hold every rank at its next report, take the furthest step any rank has
        reported, and release them with the change holding from two steps past it:
        a step no rank has begun (each is paused at most one step further)."""
        ranks = self._unfinished()
        if self._stopping.requested or not ranks:
            return None
        change = next(_CHANGE_IDS)
        calls: dict[Any, int] = {}
        step: int | None = None
        silent: list[int] = []
        try:
            for rank in ranks:
                calls[group.hold(rank, change)] = rank
            held: dict[int, int | None] = {}
            deadline = time.monotonic() + _HOLD_WAIT_S
            waiting = list(calls)
            while waiting and time.monotonic() < deadline:
                ready, answers = group.take_ready(waiting, deadline - time.monotonic())
                for call, answer in zip(ready, answers):
                    waiting.remove(call)
                    held[calls[call]] = None if isinstance(answer, BaseException) else answer
            silent = [calls[call] for call in waiting]
            reported = [s for s in held.values() if s is not None]
            if reported:
                # A rank that did not answer (busy in native code holding the GIL) is
                # where its last update left it; its hold is void once released.
                chosen = max(reported + [self.steps.get(r, -1) for r in silent]) + 2
                # Written ahead: a recovery or replay of this cell applies it there.
                self._context.record_controls(self, values, chosen, triggers)
                step = chosen
                self.controls_schedule.extend((n, v, step) for n, v in values.items())
                self.triggers_schedule.extend((step, name) for name in triggers)
        finally:
            # Every held rank is released, whatever failed above (then with nothing).
            if step is None:
                values, triggers = {}, ()
            # Ranks that are done with this cell (or not in it) get the values too, so
            # every rank starts the next cell with the same ones; triggers are the
            # running ranks'.
            at = step if step is not None else -1
            releases = [
                group.release(rank, values, at, triggers if rank in ranks else (), change)
                for rank in range(group.world_size)
            ]
            with contextlib.suppress(TimeoutError, RankLost):
                group.gather(releases, _HOLD_WAIT_S)
        if step is None and silent and not self.done():
            raise SessionError(
                f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not "
                f"answer within {_HOLD_WAIT_S:g} s (busy in native code?): nothing was "
                "changed; `%rtnb stacks` shows where they are"
            )
        if step is None:
            return None
        shown = change_text(values, triggers)
        self._context.metrics.add_marker(step, shown)
        self._note(f"[rtnb] {shown} at step {step} on every rank\n")
        return step

    # ---- the hang doctor ---------------------------------------------------------------
    def _watch_for_hang(self) -> None:
        """Once the ranks have reported and printed nothing for ``hang_after_s``,
        read every rank's stack (in a thread: a rank that does not answer is read
        with py-spy, which takes a while) and say where each waits."""
        after = self._context.hang_after_s
        if not after or self.replay or self._stopping.requested or self._hang_reading:
            return
        if self._debug_noted or self._debugging:
            self._last_activity = time.monotonic()  # a rank in pdb is not hung
            return
        quiet = time.monotonic() - self._last_activity
        if self.hang is not None or quiet < after:
            return
        self._hang_reading = True
        threading.Thread(
            target=self._read_hang, args=(quiet,), name=f"rtnb-hang-{self.cell_id}", daemon=True
        ).start()

    def _read_hang(self, quiet: float) -> None:
        try:
            stacks = self._context.stacks(self._unfinished(), stalled_s=quiet)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must never end the cell
            self._note(
                f"[rtnb] {self.name}: no report or output for {quiet:.0f} s ({one_line(exc)})\n"
            )
            return
        finally:
            self._hang_reading = False
        if time.monotonic() - self._last_activity < quiet or self.done():
            return  # it moved on while the stacks were read
        self.hang = stacks
        self._note(
            f"[rtnb] {self.name} has reported and printed nothing for {quiet:.0f} s: "
            f"{stacks.headline()} (`%rtnb stacks` for the full stacks)\n"
        )

    # ---- stopping ----------------------------------------------------------------------
    def _check_timeout(self) -> None:
        if (
            self.timeout_s is not None
            and not self._stopping.requested
            and self.elapsed_s > self.timeout_s
        ):
            self.stop(f"timed out after {self.timeout_s:g} s (--timeout)")

    def _unfinished(self) -> list[int]:
        return [r for r in self.ranks if r not in self._finished and r not in self._dead]

    # ---- outcomes ----------------------------------------------------------------------
    def _finish_normally(self) -> None:
        finished = self._finished
        if self._commit_error is not None:
            self._finish(error=self._commit_error)
            return
        if self._storage_failure is not None:
            self._finish(error=self._storage_error(finished))
            return
        interrupted = [u for u in finished.values() if u.state is CellState.INTERRUPTED]
        stopping = self._stopping
        failures = {r: u.error for r, u in finished.items() if u.state is CellState.ERROR}
        if stopping.requested and interrupted and not (failures and self._stopped_for_failure):
            steps = {u.step for u in interrupted}
            at = (
                f" at step {steps.pop()}" if len(steps) == 1 and stopping.target is not None else ""
            )
            how = (
                "at a report() boundary"
                if stopping.phase is StopPhase.COOPERATIVE
                else "inside the cell code"
            )
            self._finish(
                error=CellInterrupted(
                    f"{self.name} {stopping.reason}: every rank stopped{at} ({how}); "
                    "the worker group and its variables are intact",
                    kept=True,
                    step=max(u.step for u in finished.values()),
                )
            )
            return
        if failures:
            if interrupted:
                stopped = ", ".join(
                    str(r) for r in sorted(r for r, u in finished.items() if u in interrupted)
                )
                self._note(
                    f"[rtnb] {self.name}: rank(s) {stopped} stopped after the failure below\n"
                )
            error = CellError.from_failures(failures)
            here = next((u.exception for u in finished.values() if u.exception is not None), None)
            if here is not None:
                # A rank in this process (local mode): the error carries the cell's
                # own frames, so %debug opens where the cell raised.
                error = error.with_traceback(here.__traceback__)
            self._finish(error=error)
            return
        value = PerRank({r: from_portable(finished[r].value) for r in sorted(finished)})
        self._finish(value=value)

    def _finish_abandoned(self) -> None:
        """The group is going away under this cell (stop, restart, scale)."""
        self._finish(
            error=CellInterrupted(
                f"{self.name} {self._stopping.reason}; the ranks' variables go with the group",
                kept=False,
            )
        )

    def _finish_ray_lost(self) -> None:
        self._finish(error=ClusterError(f"{self.name} ended: {self._context.ray_lost}"))

    def _finish(self, value: PerRank | None = None, error: BaseException | None = None) -> None:
        self._finishing_thread = threading.current_thread()
        if not self.replay and self._commit_error is None:
            try:
                self._context.commit(self)
            except CheckpointError as exc:
                # A checkpoint that cannot be committed fails the cell: never a
                # silently lost save.
                if error is None:
                    value, error = None, exc
        if self.recoveries:
            self._note_restart_origin(ended=True)
        for last_words in self._last_words:
            try:
                last_words()
            except Exception:  # noqa: BLE001 - a summary must never change the outcome
                pass
        for sink in self._sinks:
            flush = getattr(sink, "flush", None)
            if flush is not None:
                flush()
        self._value, self._error = value, error
        self.ended_at = time.time()
        for rank in self.ranks:
            if self.states.get(rank) in ("running", "paused"):
                self.states[rank] = "stopped"
        if not self.replay:
            self._context.cell_ended(self)
        with self._control_lock:
            # Changes asked for too late: the cell ended first (their callers get None).
            unmade, self._control_requests = self._control_requests, []
        for request in unmade:
            request.done.set()
        with self._callbacks_lock:
            self._done.set()
            callbacks = list(self._done_callbacks)
        try:
            for callback in callbacks:
                try:
                    callback(self)
                except Exception:  # noqa: BLE001
                    pass
        finally:
            self._settled.set()
