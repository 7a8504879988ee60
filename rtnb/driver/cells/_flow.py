"""The cell flow: what runs on the ranks, and what a cell may ask of the session.

:class:`CellFlow` owns the session's cells: it checks a cell, writes it to the
journal before anything reaches the ranks (a write-ahead log), starts its
:class:`CellHandle`, and closes it when it ends (the journal's ``cell_end``, the
run's outputs flushed, the state machine back to ready). It also sends values to
the ranks and fetches them (``push``/``pull``), which a recovery may interrupt.

It is the :class:`~rtnb.driver.cells._handle.CellContext` every handle gets: the few calls a
cell makes — the running group, the checkpoint for its ``get_checkpoint()``, commits,
the controller's decision after a failure, the end — and never the session. The
controller that owns this flow (``control/_controller.py``) is seen through the narrow
:class:`GroupOwner`: the group, its state, a cell's start and end, a failure.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from rtnb.core._changes import SavedChanges
from rtnb.core._config import SessionConfig
from rtnb.core._context import CONFIG_NAME
from rtnb.core._messages import CellRequest
from rtnb.core._output import OutputSink, print_sink
from rtnb.core._stacks import GroupStacks
from rtnb.core._values import PerRank
from rtnb.driver.cells._commits import CheckpointCoordinator
from rtnb.driver.cells._handle import CellHandle
from rtnb.driver.cells._rank_values import RankValues, serialize
from rtnb.driver.cells._rank_values import rank_list as rank_list_of
from rtnb.driver.cells._steering import Steering
from rtnb.driver.lifecycle import Failure, GroupState, RecoveryOutcome
from rtnb.driver.ranks import DataWatch, RankGroup
from rtnb.driver.tools import StackReader, Validations, attach
from rtnb.errors import (
    CellError,
    CellInterrupted,
    ConfigError,
    SessionError,
)
from rtnb.metrics._store import MetricsStore
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import CheckpointStore
from rtnb.storage._journal import CellOutcome, EntryKind, Journal, JournalEntry
from rtnb.storage._logs import RankLogs
from rtnb.storage._rundir import RunDirectory

__all__ = ["CellFlow", "GroupOwner", "check_syntax"]

_FUNCTION_NAMES = ("__rtnb_fn__", CONFIG_NAME)


class GroupOwner(Protocol):
    """What the cell flow asks of the controller that owns the group."""

    run_name: str
    lock: threading.RLock

    @property
    def config(self) -> SessionConfig: ...

    @property
    def run_dir(self) -> RunDirectory: ...

    @property
    def logs(self) -> RankLogs | None: ...

    @property
    def state(self) -> GroupState: ...

    @property
    def group(self) -> RankGroup | None: ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def ray_lost(self) -> str | None: ...

    def check_ray_lost(self, settle_s: float = 0.0) -> str | None: ...

    def require_group(
        self, wait_s: float = 0.0, state_text: Callable[[], str] | None = None
    ) -> RankGroup: ...

    def replacement(
        self, lost: RankGroup, coming: Callable[[], bool], timeout_s: float
    ) -> RankGroup | None: ...

    def grow(self) -> str | None: ...

    def can_recover(self) -> bool: ...

    def cell_started(self, name: str) -> None: ...

    def cell_ended(self, name: str) -> None: ...

    def write_run_record(self, wait: bool = True) -> None: ...


class Recovering(Protocol):
    """What the cell flow asks of the session's recovery: a failed cell's next step,
    and the attempt under way as the user reads it."""

    def recover(self, failure: Failure, before: int | None) -> RecoveryOutcome: ...

    def attempt(self) -> str | None: ...


class CellFlow:
    """Runs the session's cells; see the module docstring."""

    def __init__(
        self,
        owner: GroupOwner,
        recovery: Recovering,
        journal: Journal,
        commits: CheckpointCoordinator,
        checkpoints: CheckpointStore,
        metrics: MetricsStore,
    ) -> None:
        self.run_name = owner.run_name
        self.metrics = metrics
        self.checkpoints = checkpoints
        self._owner = owner
        self._recovery = recovery
        self._journal = journal
        self._commits = commits
        self._lock = owner.lock
        self._cell_ids = itertools.count(1)
        self._active: CellHandle | None = None
        self._last_background: CellHandle | None = None
        self.last_error: BaseException | None = None
        # The last cell that reported, and its name in the notebook: what Resume runs.
        self.last_training: tuple[str, str | None] | None = None
        self._stacks = StackReader()
        self.validations = Validations(checkpoints, lambda: self.config.env)
        # Under `rtnb run`: the live changes the saved notebook's cells received.
        self._saved_changes = SavedChanges.from_env()
        # Its parts: values in and out of the ranks, and the notebook's live calls.
        self.values = RankValues(self.require_group, lambda: self.active, owner, self._write)
        self.steering = Steering(
            self.require_group,
            lambda: self.active,
            self.values,
            self._write,
            self._lock,
            lambda: owner.run_dir,
        )

    @property
    def config(self) -> SessionConfig:
        return self._owner.config

    # ---- the CellContext a handle gets ---------------------------------------------------
    @property
    def stop_grace_s(self) -> float:
        return self.config.stop_grace_s

    @property
    def logs(self) -> RankLogs | None:
        return self._owner.logs

    @property
    def state(self) -> GroupState:
        return self._owner.state

    @property
    def ray_lost(self) -> str | None:
        return self._owner.ray_lost

    def check_ray_lost(self, settle_s: float = 0.0) -> str | None:
        return self._owner.check_ray_lost(settle_s)

    def require_group(self, wait_s: float = 0.0) -> RankGroup:
        return self._owner.require_group(wait_s, self.state_text)

    def checkpoint_for(self, replay: bool) -> Checkpoint | None:
        """What ``get_checkpoint()`` returns in a cell: replayed cells get the
        latest committed checkpoint, others the one in force."""
        return self._commits.for_cell(replay)

    def commit(self, handle: CellHandle) -> None:
        steps = dict(handle.steps)
        if not handle.replay:
            self._commits.track(dict(handle.attempt.lines), steps)
        self._commits.commit_ready(steps, set(handle.ranks))
        self.validations.start_due()

    def latest_checkpoint_id(self) -> str | None:
        return self._commits.latest_id()

    @property
    def hang_after_s(self) -> float:
        return self.config.hang_after_s

    def attach_debugger(
        self, rank: int, show: Callable[[str], None], note: Callable[[str], None]
    ) -> bool:
        return attach(self.require_group(), rank, input, show, note)

    def profile_taken(self, handle: CellHandle, profiles: dict[int, Any]) -> None:
        self.steering.profile_taken(handle, profiles)

    def record_load(self, checkpoint_id: str, run: str | None) -> None:
        """A checkpoint chosen for the next cell (Load, Resume), journaled first."""
        self._journal.append(EntryKind.CHECKPOINT, checkpoint=checkpoint_id, run=run)

    def record_controls(
        self, handle: CellHandle, values: dict[str, Any], step: int, triggers: tuple[str, ...]
    ) -> None:
        self._journal.append_control(handle.journal_seq, values, step, triggers)

    def _write(self, kind: EntryKind, **fields: Any) -> None:
        """Every entry this flow's parts journal (the values', the live calls')."""
        self._journal.append(kind, **fields)

    def stacks(
        self, ranks: Iterable[int] | str | None = None, stalled_s: float | None = None
    ) -> GroupStacks:
        """Where every rank (or ``ranks``: a list, or ``--ranks``' "1" or "0-2") is
        right now (the hang doctor)."""
        group = self.require_group()
        chosen = rank_list_of(ranks, group.world_size)
        return self._stacks.read(
            group, chosen, stalled_s=stalled_s, in_kernel=self.config.workers == 0
        )

    def recover(self, failure: Failure, before: int | None) -> RecoveryOutcome:
        """The controller's decision on a failed cell, carried out."""
        return self._recovery.recover(failure, before)

    def cell_ended(self, handle: CellHandle) -> None:
        with self._lock:
            self.metrics.flush()
            if self.logs is not None:
                self.logs.flush()
            try:
                self.checkpoints.flush_index()
            except Exception:  # noqa: BLE001 - a summary file; the manifests are the truth
                pass
            self.last_error = handle.error
            if handle.reported:
                self.last_training = (handle.code, handle.label)
                # `%rtnb runs` shows steps and duration: keep them current, without
                # the cell's end waiting on storage for it.
                with contextlib.suppress(Exception):
                    self._owner.write_run_record(wait=False)
            error = handle.error
            outcome = (
                CellOutcome.OK
                if error is None
                else CellOutcome.INTERRUPTED
                if isinstance(error, CellInterrupted)
                else CellOutcome.ERROR
            )
            try:
                self._journal.append(
                    EntryKind.CELL_END,
                    of=handle.journal_seq,
                    cell_id=handle.cell_id,
                    outcome=outcome,
                    duration_s=round(handle.elapsed_s, 6),
                    reported=handle.reported,
                )
            except Exception:  # noqa: BLE001 - storage gone: the cell's own outcome stands
                pass
            if self._active is handle:
                self._owner.cell_ended(handle.name)

    # ---- state ---------------------------------------------------------------------------
    def state_text(self) -> str:
        """The group's state as the user reads it (a recovery names its attempt)."""
        state = self._owner.state
        active = self._active
        recovering = active is not None and active.recovering
        attempt = self._recovery.attempt()
        if (state is GroupState.RECOVERING or recovering) and attempt is not None:
            return f"recovering ({attempt})"
        return str(state)

    @property
    def active(self) -> CellHandle | None:
        return self._active if self._active is not None and not self._active.done() else None

    def continue_numbers(self) -> None:
        """A run carried on by a new kernel keeps numbering its cells, so the journal
        and every message name each cell once."""
        self._cell_ids = itertools.count(self._journal.last_cell_id() + 1)
        self.last_training = self.last_training or self._journal.last_training()

    # ---- cells -------------------------------------------------------------------------
    def begin(
        self,
        code: str | Callable,
        ranks: Iterable[int] | str | None,
        timeout: float | None,
        background: bool,
        config: Any = None,
        total_steps: int | None = None,
        once: bool = False,
        label: str | None = None,
        output: OutputSink | None = None,
    ) -> CellHandle:
        """Check a cell, journal it, and return its handle (not yet dispatched).
        Output goes to ``output``; a foreground cell prints it by default."""
        with self._lock:
            grown = None
            if self._active is None or self._active.done():
                # An elastic group below MAX takes back what the cluster has room
                # for at a cell's start, never in a cell.
                grown = self._owner.grow()
            group = self.require_group()
            if self._active is not None and not self._active.done():
                raise SessionError(
                    f"{self._active.name} is still running"
                    + (" in the background" if self._active.background else "")
                    + ": wait for it (`%rtnb wait`) or stop it (`handle.stop()`) first"
                )
            rank_list = rank_list_of(ranks, group.world_size)
            cell_id = next(self._cell_ids)
            code, values = _checked_cell(code, config, cell_id, label, timeout, total_steps)
            # Written before anything reaches the ranks: the journal is a write-ahead log.
            entry = self._journal.append(
                EntryKind.CELL,
                values=values,
                cell_id=cell_id,
                label=label,
                code=code,
                ranks=None if ranks is None else rank_list,
                once=once,
                names=list(_FUNCTION_NAMES) if values is not None else [],
            )
            if values is not None:
                self.values.send_values(values, rank_list)
            saved = self._saved_changes.take(code) if self._saved_changes else None
            if saved is not None:
                for step, values_at, fired in saved.by_step():
                    self._journal.append_control(entry.seq, values_at, step, fired)
            handle = CellHandle(
                self,
                cell_id,
                code,
                rank_list,
                timeout,
                background,
                journal_seq=entry.seq,
                label=label,
                saved=saved,
                triggers=self.steering.take_armed(),
            )
            if output is not None:
                handle.add_sink(output)
            elif not background:
                handle.add_sink(print_sink())
            if grown is not None:
                handle.note(grown)
            self.metrics.begin(rank_list, total_steps)
            if self.values.datasets.names:
                watch = DataWatch.for_cell(self.values.datasets, group.data_progress, handle)
                handle.before_end(watch.end)
                watch.start()
            self._active = handle
            self._owner.cell_started(handle.name)
            if background:
                self._last_background = handle
            return handle

    def run_replayed(self, entry: JournalEntry, ranks: list[int]) -> dict[int, tuple]:
        """Run a journal's cell again (a replay); {rank: error} of ranks it failed on."""
        handle = CellHandle(
            self,
            entry.cell_id or 0,
            entry.code or "",
            ranks,
            replay=True,
            label=entry.label,
            controls=self._journal.controls_of(entry.seq),
            triggers=self._journal.triggers_of(entry.seq),
        )
        return handle.drive_replay()

    def wait(self, timeout: float | None = None) -> PerRank:
        """The value of the last background cell, once it ends (``%rtnb wait``)."""
        handle = self._last_background
        if handle is None:
            raise SessionError(
                "no background cell was started in this session: use `%%rtrain --background`"
            )
        return handle.wait(timeout)

    def stop_active(self, reason: str) -> bool:
        """End the running cell, if any, because the group is going away: the ranks
        get the cooperative grace to stop at a report(), then the cell ends without
        a rebuild (the caller removes or replaces the group, exactly once).
        True when the ranks left the cell by themselves."""
        active = self.active
        if active is None:
            return True
        active.stop(reason, final=True)
        return active.wait_left(self.config.stop_grace_s + 0.5)


def _checked_cell(
    code: str | Callable,
    config: Any,
    cell_id: int,
    label: str | None,
    timeout: float | None,
    total_steps: int | None,
) -> tuple[str, bytes | None]:
    """The cell's code, and a function's pickled call (None for code); one line for
    what is wrong with it."""
    values = None
    if callable(code):
        values, code = _function_call(code, config)
    elif not isinstance(code, str):
        raise ConfigError(f"Session.run takes code (str) or a function, got {type(code).__name__}")
    check_syntax(code, CellRequest(cell_id, code, label=label).filename)
    if timeout is not None and timeout <= 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {timeout:g}")
    if total_steps is not None and total_steps < 1:
        raise ConfigError(f"--steps must be ≥ 1, got {total_steps}")
    return code, values


def _function_call(fn: Callable, config: Any) -> tuple[bytes, str]:
    """A function (and its config) by value, and the code that calls it on a rank.
    cloudpickle stores functions defined in the notebook by value, so the journal
    can replay them in a process that never saw their definition."""
    values = serialize({_FUNCTION_NAMES[0]: fn, _FUNCTION_NAMES[1]: config})
    return values, "__rtnb_fn__(__rtnb_config__)" if config is not None else "__rtnb_fn__()"


def check_syntax(code: str, filename: str = "<rtrain-cell-0>") -> None:
    """Raise CellError for a SyntaxError before anything is sent to the ranks."""
    import traceback

    if code in _COMPILED:
        return
    try:
        compile(code, filename, "exec")
    except SyntaxError as exc:
        text = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
        raise CellError(
            f"the cell has a SyntaxError and was not sent to the ranks:\n{text}",
            exc_type="SyntaxError",
        ) from None
    with _COMPILED_LOCK:
        _COMPILED[code] = None
        if len(_COMPILED) > _COMPILED_KEPT:
            _COMPILED.popitem(last=False)


# Code that compiled, oldest first: a cell run again (a loop of cells, a notebook's
# re-run) is not compiled again here (a compile was a tenth of a trivial cell's
# Python time in the kernel). Whether code compiles does not depend on its name.
_COMPILED: OrderedDict[str, None] = OrderedDict()
_COMPILED_KEPT = 64
_COMPILED_LOCK = threading.Lock()
