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
import keyword
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from rtnb.core._changes import SavedChanges
from rtnb.core._config import SessionConfig, parse_ranks
from rtnb.core._context import CONFIG_NAME
from rtnb.core._messages import SAVE_TRIGGER, CellRequest
from rtnb.core._output import OutputSink, print_sink
from rtnb.core._profile import ProfileReport, profile_trigger
from rtnb.core._stacks import GroupStacks
from rtnb.core._values import PerRank, from_portable
from rtnb.driver.cells._commits import CheckpointCoordinator
from rtnb.driver.cells._handle import CellHandle
from rtnb.driver.lifecycle import Failure, GroupState, RecoveryOutcome
from rtnb.driver.ranks import (
    DatasetHandOver,
    DatasetRecord,
    DataWatch,
    RankGroup,
    RankLost,
    check_datasets,
    command_all,
    release_everywhere,
    split_failed,
)
from rtnb.driver.tools import StackReader, Validations, attach, merge_profile, post_mortem
from rtnb.errors import (
    CellError,
    CellInterrupted,
    ConfigError,
    SessionError,
    WorkerGroupError,
    one_line,
)
from rtnb.metrics._store import MetricsStore
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import CheckpointStore
from rtnb.storage._journal import CellOutcome, EntryKind, Journal, JournalEntry
from rtnb.storage._logs import RankLogs
from rtnb.storage._rundir import RunDirectory
from rtnb.worker._commands import Pull, Push

__all__ = ["CellFlow", "GroupOwner", "check_syntax"]

# pull/push during a recovery wait this long for the rebuilt group before saying so.
_WAIT_FOR_GROUP_S = 60.0
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

    def recover(self, failure: Failure, before: int | None) -> RecoveryOutcome: ...

    def recovery_attempt(self) -> str | None: ...

    def can_recover(self) -> bool: ...

    def cell_started(self, name: str) -> None: ...

    def cell_ended(self, name: str) -> None: ...

    def write_run_record(self) -> None: ...


class CellFlow:
    """Runs the session's cells; see the module docstring."""

    def __init__(
        self,
        owner: GroupOwner,
        journal: Journal,
        commits: CheckpointCoordinator,
        checkpoints: CheckpointStore,
        metrics: MetricsStore,
    ) -> None:
        self.run_name = owner.run_name
        self.metrics = metrics
        self.checkpoints = checkpoints
        self._owner = owner
        self._journal = journal
        self._commits = commits
        self._lock = owner.lock
        self._cell_ids = itertools.count(1)
        self._active: CellHandle | None = None
        self._last_background: CellHandle | None = None
        self.last_error: BaseException | None = None
        # The last cell that reported, and its name in the notebook: what Resume runs.
        self.last_training: tuple[str, str | None] | None = None
        self._datasets = DatasetHandOver()
        self._stacks = StackReader()
        self.validations = Validations(checkpoints, lambda: self.config.env)
        # Under `rtnb run`: the live changes the saved notebook's cells received.
        self._saved_changes = SavedChanges.from_env()
        # %rtnb profile: steps armed for the next cell, and the last profile taken.
        self._armed_profile: int | None = None
        self.last_profile: ProfileReport | None = None

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
            self._commits.track(dict(handle.lines), steps)
        self._commits.commit_ready(steps, set(handle.ranks))
        self.validations.start_due()

    def latest_checkpoint_id(self) -> str | None:
        return self._commits.latest_id()

    @property
    def hang_after_s(self) -> float:
        return self.config.hang_after_s

    def attach_debugger(
        self,
        group: RankGroup,
        rank: int,
        show: Callable[[str], None],
        note: Callable[[str], None],
    ) -> bool:
        return attach(group, rank, input, show, note)

    def debug(
        self,
        rank: int | None,
        ask: Callable[[str], str],
        show: Callable[[str], None],
    ) -> None:
        """``%rtnb debug [RANK]``: attach to a rank the running (background) cell left
        at a breakpoint, else open a post-mortem of the last failed cell on ``rank``
        (the first rank it failed on when None)."""
        group = self.require_group()
        active = self.active
        if active is not None and active.debugging:
            chosen = rank if rank is not None else active.debugging[0]
            if chosen not in active.debugging:
                raise SessionError(
                    f"rank {chosen} is not at a breakpoint; ranks at one: "
                    + ", ".join(map(str, active.debugging))
                )
            attach(group, chosen, ask, show, show)
            return
        if active is not None:
            raise SessionError(
                f"{active.name} is running and no rank is at a breakpoint: put breakpoint() "
                "(or rtnb.breakpoint(rank=N)) in the cell, or debug after it fails"
            )
        post_mortem(group, rank, ask, show)

    def profile(self, steps: int) -> int | None:
        """Profile ``steps`` steps on every rank: of the running cell from a common
        step (that step), else of the next cell from its first report (None)."""
        if not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"--steps must be a whole number ≥ 1, got {steps!r}")
        active = self.active
        if active is not None and not active.done():
            step = active.controls.ask({}, (profile_trigger(steps),))
            if step is not None:
                return step + 1
        self._armed_profile = steps
        return None

    def profile_taken(self, handle: CellHandle, profiles: dict[int, Any]) -> None:
        try:
            report = merge_profile(self._owner.run_dir, profiles)
        except Exception as exc:  # noqa: BLE001 - the cell goes on; the line says why
            handle.note(f"[rtnb] the profile could not be merged: {one_line(exc)}\n")
            return
        self.last_profile = report
        handle.note(f"[rtnb] {report.summary()}\n")

    def record_load(self, checkpoint_id: str, run: str | None) -> None:
        """A checkpoint chosen for the next cell (Load, Resume), journaled first."""
        self._journal.append(EntryKind.CHECKPOINT, checkpoint=checkpoint_id, run=run)

    def record_controls(
        self, handle: CellHandle, values: dict[str, Any], step: int, triggers: tuple[str, ...]
    ) -> None:
        self._journal.append_control(handle.journal_seq, values, step, triggers)

    def fire(self, name: str) -> int:
        """Fire trigger ``name`` (``SAVE_TRIGGER``: save now) on every rank of the
        running cell at one step; that step."""
        if not (isinstance(name, str) and (name.isidentifier() or name == SAVE_TRIGGER)):
            raise ConfigError(f"a trigger's name is a Python identifier, got {name!r}")
        active = self.active
        what = "save-now" if name == SAVE_TRIGGER else f"trigger {name!r}"
        if active is None or active.done():
            raise SessionError(
                f"{what} acts inside a running cell and none is running: run the training "
                "cell with --background, then fire it from another cell"
            )
        step = active.controls.claim_saved({}, (name,))
        if step is None:
            step = active.controls.ask({}, (name,))
        if step is None:
            raise SessionError(f"{what}: the cell ended (or is stopping) before it could fire")
        return step

    def set_controls(self, values: dict[str, Any]) -> int | None:
        """Change live controls (``rtnb.control``): in the running cell at one step
        on every rank (that step), else from the next cell on (None)."""
        checked = _check_controls(values)
        active = self.active
        if active is not None and not active.done():
            step = active.controls.claim_saved(checked, ())
            if step is None:
                step = active.controls.ask(checked)
            if step is not None:
                return step
            if not active.done():
                raise SessionError(
                    f"{active.name} is stopping: the change was not made; set it again "
                    "for the next cell once it has ended"
                )
        with self._lock:
            self._journal.append(EntryKind.CONTROL, controls=checked)
            self.send_controls(checked)
        return None

    def send_controls(self, values: dict[str, Any]) -> None:
        """``values`` in force on every rank from now on (between cells; a replay)."""
        self._call_ranks(
            lambda group: release_everywhere(group, values),
            "setting controls",
            timeout_s=30,
        )

    def stacks(
        self, ranks: Iterable[int] | str | None = None, stalled_s: float | None = None
    ) -> GroupStacks:
        """Where every rank (or ``ranks``: a list, or ``--ranks``' "1" or "0-2") is
        right now (the hang doctor)."""
        group = self.require_group()
        chosen = _ranks(ranks, group.world_size)
        return self._stacks.read(
            group, chosen, stalled_s=stalled_s, in_kernel=self.config.workers == 0
        )

    def recover(self, failure: Failure, before: int | None) -> RecoveryOutcome:
        """The controller's decision on a failed cell, carried out."""
        return self._owner.recover(failure, before)

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
                # `%rtnb runs` shows steps and duration: keep them current.
                with contextlib.suppress(Exception):
                    self._owner.write_run_record()
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
        attempt = self._owner.recovery_attempt()
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
            rank_list = _ranks(ranks, group.world_size)
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
                self.send_values(values, rank_list)
            saved = self._saved_changes.take(code) if self._saved_changes else None
            if saved is not None:
                for step, values_at, fired in saved.by_step():
                    self._journal.append_control(entry.seq, values_at, step, fired)
            armed, self._armed_profile = self._armed_profile, None
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
                triggers=((-1, profile_trigger(armed)),) if armed else (),
            )
            if output is not None:
                handle.add_sink(output)
            elif not background:
                handle.add_sink(print_sink())
            if grown is not None:
                handle.note(grown)
            self.metrics.begin(rank_list, total_steps)
            if self._datasets.names:
                watch = DataWatch.for_cell(self._datasets, group.data_progress, handle)
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

    # ---- variables ---------------------------------------------------------------------
    def world_size(self) -> int:
        return self.require_group().world_size

    def pull(self, name: str, ranks: Iterable[int] | str | None = None) -> list[Any]:
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"{name!r} is not a Python variable name")
        rank_list = _ranks(ranks, self.require_group(wait_s=_WAIT_FOR_GROUP_S).world_size)
        answers = self._call_ranks(
            lambda group: command_all(group, rank_list, Pull(name)),
            f"pulling {name!r}",
            timeout_s=120,
        )
        missing = [r for r, (found, *_rest) in zip(rank_list, answers) if not found]
        if missing:
            raise SessionError(
                f"{name!r} is not defined on rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))}: define it in a %%rtrain cell first"
            )
        return [from_portable((data, text)) for _found, data, text in answers]

    def push(self, values: dict[str, Any], ranks: Iterable[int] | str | None = None) -> None:
        for name in values:
            if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
                raise ConfigError(f"{name!r} is not a Python variable name")
        group = self.require_group(wait_s=_WAIT_FOR_GROUP_S)
        rank_list = _ranks(ranks, group.world_size)
        data = _serialize(dict(values))
        self._journal.append(
            EntryKind.PUSH,
            values=data,
            names=sorted(values),
            ranks=None if ranks is None else rank_list,
        )
        self.send_values(data, rank_list)

    # ---- datasets --------------------------------------------------------------------
    @property
    def dataset_names(self) -> list[str]:
        return self._datasets.names

    def set_datasets(self, datasets: dict[str, Any], data_config: Any = None) -> None:
        """Hand Ray Datasets to the ranks (added to those handed before), split for
        this group as Ray Train splits them; journaled, so every later group gets
        them again."""
        # A group first: datasets refused for want of one must not stay in the set
        # the next hand-over (or a replay) would give the ranks.
        group = self.require_group(wait_s=_WAIT_FOR_GROUP_S)
        # Before anything is kept: a pipeline that could never run is refused whole.
        group.check_data_room(check_datasets(datasets))
        record = self._datasets.record(datasets, data_config)
        data = pickle.dumps(record)
        self._journal.append(EntryKind.DATASETS, values=data, names=record.names)
        self._hand(record, *self._datasets.resolve(record))

    def hand_datasets(self, data: bytes) -> list[str]:
        """Hand a journaled set of datasets to the current group (a replay); the
        names of those that cannot be rebuilt here."""
        record = pickle.loads(data)
        datasets, missing = self._datasets.resolve(record)
        self._hand(record, datasets, missing)
        return missing

    def _hand(self, record: DatasetRecord, datasets: dict[str, Any], missing: list[str]) -> None:
        if not datasets:
            return
        config = self._datasets.data_config(record, sorted(datasets))

        def calls(group: RankGroup) -> list:
            try:
                return group.hand_datasets(datasets, config)
            except Exception as exc:  # noqa: BLE001 - Ray Data's own error, in one line
                raise split_failed(exc) from None

        self._call_ranks(calls, "handing the datasets to the ranks", timeout_s=300)

    def send_values(self, data: bytes, ranks: list[int]) -> None:
        self._call_ranks(
            lambda group: command_all(group, ranks, Push(), group.share(data)),
            "sending values to the ranks",
            timeout_s=300,
        )

    def _call_ranks(self, calls: Callable[[RankGroup], list], what: str, timeout_s: float):
        """The results of ``calls(group)``; each failure becomes one rtnb error line.

        A rank that died under a running cell that recovery will rebuild is not an
        error of this call: it waits for the rebuilt group and asks it instead."""
        group = self.require_group(wait_s=_WAIT_FOR_GROUP_S)
        for attempt in range(2):
            try:
                return group.gather(calls(group), timeout_s)
            except TimeoutError:
                raise SessionError(
                    f"{what} took over {timeout_s:g} s (a rank busy in native code?); try again"
                ) from None
            except RankLost as exc:
                rebuilt = attempt == 0 and self._wait_for_recovery(group)
                if rebuilt is None:
                    raise WorkerGroupError(f"{what} failed: a rank died ({exc})") from None
                group = rebuilt
        raise AssertionError("unreachable")

    def _wait_for_recovery(self, lost: RankGroup) -> RankGroup | None:
        """The group that recovery builds to replace ``lost``; None when no
        recovery is coming (no running cell, or --max-failures spent)."""
        active = self._active
        if active is None or active.done() or not (active.recovering or self._owner.can_recover()):
            return None
        return self._owner.replacement(
            lost, lambda: not active.done() or active.recovering, _WAIT_FOR_GROUP_S
        )


def _serialize(values: dict[str, Any]) -> bytes:
    from ray import cloudpickle

    try:
        return cloudpickle.dumps(values)
    except Exception as exc:  # noqa: BLE001 - anything unpicklable
        raise ConfigError(
            f"cannot send {', '.join(sorted(values))} to the ranks: not picklable "
            f"({one_line(exc)}); create it in a %%rtrain cell instead"
        ) from None


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
    values = _serialize({_FUNCTION_NAMES[0]: fn, _FUNCTION_NAMES[1]: config})
    return values, "__rtnb_fn__(__rtnb_config__)" if config is not None else "__rtnb_fn__()"


def _check_controls(values: dict[str, Any]) -> dict[str, Any]:
    """Names are identifiers and values JSON scalars (the journal keeps them)."""
    if not isinstance(values, dict) or not values:
        raise ConfigError("give controls as NAME=VALUE, e.g. `%rtnb set lr=3e-4`")
    for name, value in values.items():
        if not (isinstance(name, str) and name.isidentifier()):
            raise ConfigError(f"a control's name is a Python identifier, got {name!r}")
        if not isinstance(value, (int, float, str, bool)) and value is not None:
            raise ConfigError(
                f"control {name!r} takes a number, a string, a bool or None, got "
                f"{type(value).__name__} (push other values with `%rtnb push`)"
            )
    return dict(values)


def _ranks(ranks: Iterable[int] | str | None, world_size: int) -> list[int]:
    if ranks is None or isinstance(ranks, str):
        return parse_ranks(ranks, world_size)
    return parse_ranks(",".join(str(int(r)) for r in ranks), world_size)


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
