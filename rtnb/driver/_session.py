"""The driver-side API: one persistent worker group and the cells run on it.

The magics are a thin layer over :class:`Session`; everything here also works
from a plain Python script. The session is a facade: cells are driven by
:class:`CellHandle` (``_cell.py``), the group by :class:`WorkerGroup`
(``_group.py``), recovery and replay by ``_recovery.py``, checkpoint commits by
``_commits.py``; every action that changes the ranks' state is written to the
run's journal first (``rtnb.storage._journal``)::

    with rtnb.Session(workers=2) as session:
        session.run("import torch.distributed as dist; x = dist.get_rank()")
        print(session.pull("x"))          # [0, 1]
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import keyword
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from rtnb.core._config import SessionConfig, check_name, parse_ranks
from rtnb.core._messages import CellRequest
from rtnb.core._redact import redact_uri
from rtnb.core._score import score_rule
from rtnb.core._text import mean_over_ranks
from rtnb.core._values import PerRank, from_portable
from rtnb.driver import _warm
from rtnb.driver._cell import CellHandle, _Restart
from rtnb.driver._cluster import ClusterConnection, connect, will_embed
from rtnb.driver._commits import CheckpointCoordinator
from rtnb.driver._group import WorkerGroup, check_capacity
from rtnb.driver._output import OutputSink, print_sink
from rtnb.driver._recovery import FailurePolicy, RecoveryOutcome, Replayer, ReplayReport
from rtnb.driver._startup import StartProgress, StartReport
from rtnb.driver._state import GroupState, StateChange, StateMachine
from rtnb.driver._status import GroupStatus, RankStatus
from rtnb.errors import (
    CellError,
    CellInterrupted,
    CheckpointError,
    ClusterError,
    ConfigError,
    RtnbError,
    SessionError,
    WorkerGroupError,
    one_line,
)
from rtnb.metrics._store import MetricsStore
from rtnb.metrics._tensorboard import TensorBoardExporter
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import CheckpointStore
from rtnb.storage._journal import CellOutcome, EntryKind, Journal
from rtnb.storage._layout import (
    RUN_RECORD,
    RunRecord,
    read_run_record,
    tensorboard_dir,
    write_run_record,
)
from rtnb.storage._logs import RankLogs
from rtnb.storage._metricslog import MetricsLog
from rtnb.storage._result import Result
from rtnb.storage._rundir import BATCH_RUNS_ENV, RunDirectory

__all__ = ["Session"]

_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()


class Session:
    """A Ray worker group whose ranks keep their Python state across cells.

    Takes the options of ``%rtnb start`` as keyword arguments (see
    :class:`SessionConfig`), or a ready ``config``. ``replay=True`` rebuilds the
    ranks' state from the journal of the run named ``name`` (a new kernel carrying
    on a run). ``group_factory`` lets tests substitute the worker group.
    """

    def __init__(
        self,
        config: SessionConfig | None = None,
        *,
        replay: bool = False,
        group_factory: Callable[[SessionConfig, str, str], WorkerGroup] | None = None,
        connector: Callable[..., ClusterConnection] | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise ConfigError("pass either a SessionConfig or keyword options, not both")
        try:
            self.config = config or SessionConfig(**options)
        except TypeError as exc:
            raise ConfigError(f"unknown Session option: {exc}") from None
        if replay and not self.config.name:
            raise ConfigError("--replay rebuilds a run from its journal: name it with --name RUN")
        self.run_name = self.config.name or time.strftime("run-%Y%m%d-%H%M%S")
        self.run_dir = RunDirectory(self.config.storage_path, self.run_name)
        self.checkpoints = CheckpointStore(
            self.run_dir, self.config.keep, self.config.score, self.config.mode
        )
        self.commits = CheckpointCoordinator(self.checkpoints)
        self.journal = Journal(self.run_dir)
        self.replayer = Replayer(self, self.journal)
        self.policy = FailurePolicy(self.config.max_failures)
        self.replay_on_start = replay
        self.last_replay: ReplayReport | None = None  # of start/restart --replay, scale
        self.last_recovery: RecoveryOutcome | None = None
        self.last_start: StartReport | None = None  # seconds per phase of the last start
        self.state_machine = StateMachine()
        self._ready = threading.Event()
        self.state_machine.subscribe(self._track_ready)
        self.metrics = MetricsStore()
        self.logs: RankLogs | None = None  # every rank's output, in {run}/logs/
        self.connection: ClusterConnection | None = None
        self._group: WorkerGroup | None = None
        self._group_factory = group_factory or WorkerGroup
        self._connector = connector or connect
        self._cell_ids = itertools.count(1)
        self._active: CellHandle | None = None
        self._last_background: CellHandle | None = None
        self._last_error: BaseException | None = None
        self._last_training_code: str | None = None
        self._last_training_label: str | None = None  # that cell's name in the notebook
        self._started_at: float | None = None  # run.json's "started"
        self._lost: str | None = None  # set once the Ray under this session is gone
        self._lock = threading.RLock()
        _LIVE.add(self)

    # ---- lifecycle ---------------------------------------------------------------------
    @property
    def state(self) -> GroupState:
        return self.state_machine.state

    def on_state_change(self, callback: Callable[[StateChange], None]) -> Callable[[], None]:
        return self.state_machine.subscribe(callback)

    @property
    def failures(self) -> int:
        """Group rebuilds spent on --max-failures so far."""
        return self.policy.failures

    def _track_ready(self, change: StateChange) -> None:
        if change.new in (GroupState.READY, GroupState.RUNNING):
            self._ready.set()
        else:
            self._ready.clear()

    def start(self, progress: Callable[[str], None] | None = None) -> Session:
        """Connect to Ray and start the worker group (``%rtnb start``).

        ``progress`` is called with a short line as each phase begins (starting or
        joining Ray, placing the ranks, starting them, the process group);
        :attr:`last_start` then holds the seconds each took."""
        steps = StartProgress(progress)
        with self._lock:
            if self.state in (GroupState.READY, GroupState.RUNNING, GroupState.STARTING):
                raise SessionError(
                    f"the worker group of run {self.run_name!r} is already started; "
                    "use `%rtnb restart` for a fresh one or `%rtnb stop` first"
                )
            self.state_machine.to(GroupState.STARTING)
            try:
                self.run_dir.ensure_writable()
                self._attach_metrics_outputs()
                self.checkpoints.cleanup_incomplete()
                self._continue_cell_numbers()
                if will_embed(self.config.address) and not self.config.gpu:
                    # Known before Ray starts (~10 s): an embedded Ray has this machine.
                    check_capacity(self.config, {"CPU": os.cpu_count() or 1}, "this machine")
                if self.connection is None:
                    with steps.phase("Ray", self._connect_doing()):
                        self.connection = self._connector(
                            self.config.address,
                            timeout_s=self.config.connect_timeout_s,
                            listen=self.config.listen,
                            need_cpus=self.config.workers * self.config.cpus_per_worker,
                            ranks=self.config.workers,
                            progress=lambda text: steps.say(f"rtnb: {text}…"),
                        )
                    _stop_sessions_at_exit()
                    if self.connection.watch is not None:
                        self.connection.watch.subscribe(self._ray_lost)
                self._group = self._new_group(steps)
            except BaseException as exc:
                # A start that fails stops the embedded Ray it started (WorkerGroup.start
                # already freed its placement group and actors).
                self._drop_owned_connection()
                self.state_machine.to(GroupState.FAILED, one_line(exc))
                if isinstance(exc, KeyboardInterrupt):
                    raise SessionError(
                        "starting the worker group was interrupted; its placement group and "
                        "actors were freed"
                    ) from None
                if isinstance(exc, RtnbError):
                    raise
                raise SessionError(f"starting the worker group failed: {one_line(exc)}") from None
            self.state_machine.to(GroupState.READY)
            self.last_start = steps.report
            self._carry_on_run_record()
            self._continue_step_count()
            self._write_run_json()
            replay = self.replay_on_start
            self.journal.append(EntryKind.START, workers=self.config.workers, keep=replay)
            if replay:
                self._replay_onto_new_group("start --replay")
            _announce_to_batch_runner(self.config.storage_path, self.run_name)
        return self

    # ---- the Ray under the session going away -------------------------------------------
    @property
    def ray_lost(self) -> str | None:
        """One line on the Ray this session used being gone, once it is: no Ray call
        is made after that (each would wait on a GCS that never answers)."""
        return self._lost

    def check_ray_lost(self, settle_s: float = 0.0) -> str | None:
        """As :attr:`ray_lost`, asking the cluster now (before a rebuild, or on a Ray
        error that a GCS going away causes); ``settle_s``: how long a shut GCS port
        must stay shut to count."""
        if self._lost is None and self.connection is not None:
            # A lost Ray reaches _ray_lost through the watch.
            self.connection.check_lost(settle_s)
        return self._lost

    def _ray_lost(self, why: str) -> None:
        latest = None
        with contextlib.suppress(Exception):
            latest = self.latest_checkpoint_id()
        kept = (
            f"the run's latest checkpoint is {latest}"
            if latest
            else "no checkpoint of this run was committed"
        )
        self._lost = (
            f"{why}: the ranks and their variables went with it; {kept}. "
            f"`%rtnb start --name {self.run_name} --replay` starts a fresh Ray and "
            "rebuilds the ranks from the run's journal"
        )
        self._group = None
        with contextlib.suppress(RuntimeError):  # already stopping or stopped
            self.state_machine.to(GroupState.FAILED, self._lost)

    def _drop_owned_connection(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None and connection.owned:
            try:
                connection.shutdown()
            except Exception:  # noqa: BLE001 - already failing; the first error is the news
                pass
        elif connection is not None:
            self.connection = connection

    def _continue_cell_numbers(self) -> None:
        # A run carried on by a new kernel keeps numbering its cells, so the journal
        # and every message name each cell once.
        entries = self.journal.entries()
        last = max((e.cell_id or 0 for e in entries), default=0)
        self._cell_ids = itertools.count(last + 1)
        if self._last_training_code is None:
            ends = {e.of for e in entries if e.kind is EntryKind.CELL_END and e.reported}
            trained = [e for e in entries if e.seq in ends]
            if trained:
                self._last_training_code = trained[-1].code
                self._last_training_label = trained[-1].label

    def _replay_onto_new_group(self, why: str) -> ReplayReport:
        """Rebuild the ranks' state on a new group from the journal (fails the
        session's group with one line if a replayed cell fails)."""
        self.state_machine.to(GroupState.RUNNING, f"replaying the journal ({why})")
        try:
            report = self.replayer.replay()
        except _Restart:
            self.state_machine.to(GroupState.FAILED, "a rank died during the replay")
            raise WorkerGroupError(
                f"a rank died while the journal was replayed ({why}); start again"
            ) from None
        except RtnbError as exc:
            self.state_machine.to(GroupState.FAILED, str(exc))
            raise
        finally:
            self.checkpoints.cleanup_incomplete()
        self._continue_step_count()
        self.last_replay = report
        self.state_machine.to(GroupState.READY, f"replayed: {report}")
        return report

    def last_step(self) -> int:
        """The last step of the line of training the ranks are on (-1: none yet)."""
        return self.commits.step

    def _continue_step_count(self) -> None:
        # New ranks (a rebuild, or a run continued by a new session with the same
        # --name and storage) carry on where the old ones were: same line, same step
        # count, so checkpoint ids are never reused.
        import ray

        if self._group is not None:
            line, step = self.commits.line, self.commits.step
            try:
                ray.get(self._group.set_step(step, line), timeout=60)
            except ray.exceptions.RayError:
                pass  # a rank already died: the next cell's poll reports it

    def _attach_metrics_outputs(self) -> None:
        if self.metrics.log is None:
            self.metrics.log = MetricsLog(self.run_dir)
        if self.logs is None:
            self.logs = RankLogs(self.run_dir)
        if self.config.tensorboard and self.metrics.exporter is None:
            if not self.run_dir.is_local:
                raise ConfigError(
                    "--tensorboard writes event files next to the run: it needs a local --storage"
                )
            self.metrics.exporter = TensorBoardExporter(tensorboard_dir(self.run_dir.path))

    # ---- checkpoints ---------------------------------------------------------------------
    def _commit_checkpoints(self, handle: CellHandle) -> None:
        steps = dict(handle.steps)
        if not handle.replay:
            self.commits.track(dict(handle.lines), steps)
        self.commits.commit_ready(steps, set(handle.ranks))

    def _checkpoint_for(self, handle: CellHandle) -> Checkpoint | None:
        """What ``get_checkpoint()`` returns in this cell: replayed cells get the
        latest committed checkpoint, others the one in force."""
        return self.commits.for_cell(handle.replay)

    def checkpoint_store(self, run: str | None = None) -> CheckpointStore:
        """This run's checkpoints, or those of another run in the same storage."""
        if run is None or run == self.run_name:
            return self.checkpoints
        other = RunDirectory(self.config.storage_path, check_name(run, "--run"))
        if not other.exists(RUN_RECORD):
            raise CheckpointError(
                f"no run {run!r} in {redact_uri(self.config.storage_path)} (see `%rtnb runs`)"
            )
        return CheckpointStore(other)

    def load(self, checkpoint_id: str = "latest", run: str | None = None) -> Checkpoint:
        """Make ``rtnb.get_checkpoint()`` return this checkpoint on every rank, without
        running anything (the browser's Load button)."""
        checkpoint = self.checkpoint_store(run).get(checkpoint_id)
        checkpoint.verify()
        self.journal.append(EntryKind.CHECKPOINT, checkpoint=checkpoint.id, run=run)
        self.commits.choose(checkpoint)
        return checkpoint

    def latest_checkpoint_id(self) -> str | None:
        """The checkpoint a recovery would restart from: the latest of the line of
        training the ranks are on (see ``_commits``)."""
        return self.commits.latest_id()

    def list_checkpoints(self, include_incomplete: bool = False, run: str | None = None):
        return self.checkpoint_store(run).list(include_incomplete)

    def resume(
        self, checkpoint_id: str = "latest", *, run: str | None = None, background: bool = False
    ):
        """Load a checkpoint and run the last training cell again from it (the
        browser's Resume button), starting the group first if it is not running.

        Returns the cell's value (or its handle with ``background``), or None when no
        training cell ran yet: then the next one starts from the checkpoint.
        """
        if self.state in (GroupState.NEW, GroupState.STOPPED, GroupState.FAILED):
            self.start()
        self.load(checkpoint_id, run=run)
        code, label = self._last_training_code, self._last_training_label
        if code is None:
            return None
        if background:
            return self.run_background(code, label=label)
        return self.run(code, label=label)

    def result(self) -> Result:
        """The run so far as an :class:`rtnb.Result` (metrics, dataframe, path)."""
        self.metrics.flush()
        per_rank = {
            r: dict(rep.metrics, step=rep.step) for r, rep in sorted(self.metrics.last.items())
        }
        return Result(
            path=self.run_dir.uri,
            _location=self.run_dir._uri,
            metrics=mean_over_ranks(per_rank),
            metrics_per_rank=per_rank,
            checkpoint=self.commits.latest(),
            best_checkpoints=[
                (self.checkpoints.get(c.id), c.metrics) for c in self.checkpoints.list()
            ],
            error=self._last_error,
            run_name=self.run_name,
            score_rule=score_rule(self.config.score, self.config.mode, self.metrics.metric_names()),
        )

    def _carry_on_run_record(self) -> None:
        """A run carried on by a new session keeps the time it first started and
        where its training was (line and step)."""
        if self._started_at is not None:
            return
        try:
            earlier = read_run_record(self.run_dir)
        except (OSError, ValueError, TypeError):
            earlier = None
        self._started_at = (earlier.started if earlier is not None else 0.0) or time.time()
        self.commits.restore(earlier)

    def _write_run_json(self) -> None:
        group = self._group
        ranks = [vars(r) for r in group.ranks] if group is not None else []
        self._carry_on_run_record()
        write_run_record(
            self.run_dir,
            RunRecord(
                run_name=self.run_name,
                started=self._started_at or time.time(),
                status=str(self.state),
                config=self.config.to_dict(),
                ranks=ranks,
                updated=time.time(),
                **self.commits.record(),
            ),
        )

    def _new_group(self, progress: StartProgress | None = None) -> WorkerGroup:
        group = self._group_factory(self.config, self.run_name, self.config.storage_path)
        group.start(progress)
        return group

    def _connect_doing(self) -> str:
        if will_embed(self.config.address) and _warm.wanted(self.config.listen):
            return "looking for the warm Ray"
        if will_embed(self.config.address):
            return f"starting an embedded Ray (listening on {self.config.listen or '127.0.0.1'})"
        address = self.config.address or os.environ.get("RAY_ADDRESS")
        if address is None:
            return "joining the Ray this process already uses"
        return f"joining Ray at {redact_uri(address)}"

    def _stop_active(self, reason: str) -> bool:
        """End the running cell, if any, because the group is going away: the ranks
        get the cooperative grace to stop at a report(), then the cell ends without
        a rebuild (the caller removes or replaces the group, exactly once).
        True when the ranks left the cell by themselves."""
        active = self.active_cell
        if active is None:
            return True
        active.stop(reason, final=True)
        active._done.wait(self.config.stop_grace_s + 0.5)
        # Only ended ranks are in _finished; dead or stuck ones never get there.
        return active.done() and len(active._finished) == len(active.ranks)

    def stop(self) -> None:
        """Stop any running cell and free every actor and the placement group;
        returns within ``stop_grace_s`` + 1 s."""
        clean = self._lost is None and self._stop_active(
            "stopped because the worker group is stopping"
        )
        with self._lock:
            if self.state in (GroupState.NEW, GroupState.STOPPED):
                return
            self.state_machine.to(GroupState.STOPPING)
            group, self._group = self._group, None
            if group is not None and self._lost is None:
                group.shutdown(graceful=clean, timeout_s=1.0 if not clean else 5.0)
            if self.connection is not None:
                self.connection.shutdown()
                self.connection = None
            self.metrics.flush()
            if self.metrics.exporter is not None:
                self.metrics.exporter.close()
                self.metrics.exporter = None
            with contextlib.suppress(RtnbError):
                self.journal.flush(timeout=10.0)
            self.journal.close()
            self.state_machine.to(GroupState.STOPPED)
            try:
                self._write_run_json()
            except Exception:  # noqa: BLE001 - stopping must not fail on a storage hiccup
                pass

    def restart(self, replay: bool = False) -> Session:
        """A new group with the same options. Rank variables are dropped, unless
        ``replay``: then the journal is replayed onto the new group and the next
        cell continues from the latest checkpoint."""
        if self.state in (GroupState.NEW, GroupState.STOPPED):
            return self.start()
        self._stop_active("stopped because the worker group restarts")
        with self._lock:
            self._rebuild("restart requested", fresh=not replay)
            self.policy.reset()
            if replay:
                self._replay_onto_new_group("restart --replay")
        return self

    def scale(self, workers: int) -> Session:
        """A new group of ``workers`` ranks holding the same variables: the journal
        is replayed onto it (``prepare_data_loader`` re-shards for the new world
        size) and the next training cell continues from the latest checkpoint."""
        old = self.config.workers
        self.config.workers = workers
        try:
            self.config.validate()
        except ConfigError:
            self.config.workers = old
            raise
        if self.state in (GroupState.NEW, GroupState.STOPPED):
            return self.start()
        try:
            check_capacity(self.config)  # before the current group is taken down
        except RtnbError:
            self.config.workers = old
            raise
        self._stop_active(f"stopped because the worker group scales to {workers} ranks")
        with self._lock:
            try:
                self._rebuild(f"scaling from {old} to {workers} ranks", kind=EntryKind.SCALE)
            except RtnbError:
                self.config.workers = old
                raise
            self._replay_onto_new_group(f"scale {old} → {workers}")
        return self

    def _rebuild(
        self, reason: str, fresh: bool = False, kind: EntryKind = EntryKind.RESTART
    ) -> None:
        """Replace the group; ``fresh`` records that the ranks' state is gone (the
        journal's replay starts after it)."""
        if self.check_ray_lost():
            raise ClusterError(self._lost)
        with self._lock:
            self.state_machine.to(GroupState.RESTARTING, reason)
            group, self._group = self._group, None
            if group is not None:
                group.shutdown(graceful=False)
            try:
                self._group = self._new_group()
            except RtnbError as exc:
                # A Ray that is shutting down (`rtnb warm stop --force`, a head's
                # `ray stop`) kills the ranks and refuses new ones before its GCS
                # closes: then the news is that Ray is gone, not the placement.
                lost = self.check_ray_lost(settle_s=2.5)
                if lost:
                    raise ClusterError(lost) from None
                self.state_machine.to(GroupState.FAILED, str(exc))
                raise
            self.journal.append(kind, workers=self.config.workers, keep=not fresh)
            self.state_machine.to(GroupState.READY, reason)
            self._continue_step_count()
            self._write_run_json()

    def _recover(self, reason: str, before: int | None = None) -> RecoveryOutcome:
        """Rebuild after a rank died mid-cell and replay the journal up to the
        failed cell (entry ``before``); ranks that die meanwhile are reported in
        the outcome (another failure, retried while the policy allows)."""
        import ray

        attempt = self.policy.record_failure()
        try:
            self._rebuild(f"{reason} ({attempt})")
            # Files a dead rank left half-written never got a manifest: drop them.
            self.checkpoints.drop_pending()
            self.checkpoints.cleanup_incomplete()
            self.state_machine.to(GroupState.RUNNING, f"recovering: {reason}")
            report = self.replayer.replay(before)
            self._continue_step_count()
            self.last_recovery = RecoveryOutcome(attempt, report)
            return self.last_recovery
        except (ray.exceptions.RayError, WorkerGroupError, _Restart) as exc:
            if self.state is GroupState.FAILED:
                self.state_machine.to(GroupState.RESTARTING, "retrying after a failed rebuild")
                self.state_machine.to(GroupState.READY)
            if self.state is GroupState.READY:
                self.state_machine.to(GroupState.RUNNING, "recovering")
            what = one_line(exc) if not isinstance(exc, _Restart) else "a rank died during replay"
            return RecoveryOutcome(attempt, ReplayReport(), died={-1: what})

    def _require_group(self, wait_s: float = 0.0) -> WorkerGroup:
        """The running group. While it is being rebuilt (recovery, restart, scale),
        wait up to ``wait_s`` for it, then say so; never "no worker group"."""
        if self._lost is not None:
            raise ClusterError(self._lost)
        if self.state in (GroupState.RESTARTING, GroupState.STARTING) or (
            self._group is None and self.state is GroupState.RUNNING
        ):
            self._ready.wait(wait_s)
        group = self._group
        if group is not None and self.state in (GroupState.READY, GroupState.RUNNING):
            return group
        if self.state in (GroupState.RESTARTING, GroupState.STARTING, GroupState.RUNNING):
            raise SessionError(
                f"the worker group is {self._state_text()}; try again once it is ready "
                "(`%rtnb status`)"
            )
        raise SessionError(
            "no worker group is running: start one with `%rtnb start` (or Session.start())"
        )

    def _state_text(self) -> str:
        active = self._active
        recovering = active is not None and active.recovering
        if (self.state is GroupState.RESTARTING or recovering) and self.policy.failures:
            return f"restarting ({self.policy.describe()})"
        return str(self.state)

    def __enter__(self) -> Session:
        if self.state in (GroupState.NEW, GroupState.STOPPED):
            self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # ---- cells -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.config.workers

    def _begin(
        self,
        code: str | Callable,
        ranks: Iterable[int] | str | None,
        timeout: float | None,
        background: bool,
        config: Any = None,
        total_steps: int | None = None,
        once: bool = False,
        label: str | None = None,
    ) -> CellHandle:
        with self._lock:
            group = self._require_group()
            if self._active is not None and not self._active.done():
                raise SessionError(
                    f"{self._active.name} is still running"
                    + (" in the background" if self._active.background else "")
                    + ": wait for it (`%rtnb wait`) or stop it (`handle.stop()`) first"
                )
            rank_list = _ranks(ranks, group.world_size)
            values = None
            if callable(code):
                values, code = _function_call(code, config)
            elif not isinstance(code, str):
                raise ConfigError(
                    f"Session.run takes code (str) or a function, got {type(code).__name__}"
                )
            cell_id = next(self._cell_ids)
            check_syntax(code, CellRequest(cell_id, code, label=label).filename)
            if timeout is not None and timeout <= 0:
                raise ConfigError(f"--timeout must be > 0 seconds, got {timeout:g}")
            if total_steps is not None and total_steps < 1:
                raise ConfigError(f"--steps must be ≥ 1, got {total_steps}")
            # Written before anything reaches the ranks: the journal is a write-ahead log.
            entry = self.journal.append(
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
                self._send_values(values, rank_list)
            handle = CellHandle(
                self,
                cell_id,
                code,
                rank_list,
                timeout,
                background,
                journal_seq=entry.seq,
                label=label,
            )
            self.metrics.begin(rank_list, total_steps)
            self._active = handle
            self.state_machine.to(GroupState.RUNNING, handle.name)
            return handle

    def run(
        self,
        code: str | Callable,
        *,
        ranks: Iterable[int] | str | None = None,
        timeout: float | None = None,
        config: Any = None,
        output: OutputSink | None = None,
        total_steps: int | None = None,
        once: bool = False,
        label: str | None = None,
    ) -> PerRank:
        """Run ``code`` (or ``fn()``/``fn(config)``) on the ranks and wait for it.

        Output streams to ``output(rank, stream, text)`` while it runs (default:
        printed with a ``[rank N]`` tag). Returns the last expression's value per
        rank. Ctrl-C stops the cell on every rank (see :class:`CellHandle`). A
        function is recorded in the journal by value, so a replay after a failure
        (or in a new kernel) runs it again. ``once``: never replay this cell.
        ``label``: the notebook's name for the cell (Jupyter's ``[4]``), which its
        messages and tracebacks then use instead of rtnb's cell number.
        """
        handle = self._begin(
            code,
            ranks,
            timeout,
            background=False,
            config=config,
            total_steps=total_steps,
            once=once,
            label=label,
        )
        handle.add_sink(output or print_sink())
        return handle.run_here()

    def begin_cell(
        self,
        code: str | Callable,
        *,
        ranks: Iterable[int] | str | None = None,
        timeout: float | None = None,
        total_steps: int | None = None,
        output: OutputSink | None = None,
        once: bool = False,
        label: str | None = None,
    ) -> CellHandle:
        """A foreground cell's handle before it runs, so views can subscribe to it
        first; run it with :meth:`CellHandle.run_here`. Output is printed unless
        ``output`` says otherwise."""
        handle = self._begin(
            code,
            ranks,
            timeout,
            background=False,
            total_steps=total_steps,
            once=once,
            label=label,
        )
        handle.add_sink(output or print_sink())
        return handle

    def run_background(
        self,
        code: str | Callable,
        *,
        ranks: Iterable[int] | str | None = None,
        timeout: float | None = None,
        config: Any = None,
        output: OutputSink | None = None,
        total_steps: int | None = None,
        once: bool = False,
        label: str | None = None,
    ) -> CellHandle:
        """Start ``code`` on the ranks and return its :class:`CellHandle` at once."""
        handle = self._begin(
            code,
            ranks,
            timeout,
            background=True,
            config=config,
            total_steps=total_steps,
            once=once,
            label=label,
        )
        if output is not None:
            handle.add_sink(output)
        self._last_background = handle
        handle.run_in_background()
        return handle

    def wait(self, timeout: float | None = None) -> PerRank:
        """The value of the last background cell, once it ends (``%rtnb wait``)."""
        handle = self._last_background
        if handle is None:
            raise SessionError(
                "no background cell was started in this session: use `%%rtrain --background`"
            )
        return handle.wait(timeout)

    @property
    def active_cell(self) -> CellHandle | None:
        return self._active if self._active is not None and not self._active.done() else None

    def _cell_ended(self, handle: CellHandle) -> None:
        with self._lock:
            self.metrics.flush()
            if self.logs is not None:
                self.logs.flush()
            try:
                self.checkpoints.flush_index()
            except Exception:  # noqa: BLE001 - a summary file; the manifests are the truth
                pass
            self._last_error = handle.error
            if handle.reported:
                self._last_training_code = handle.code
                self._last_training_label = handle.label
                # `%rtnb runs` shows steps and duration: keep them current.
                with contextlib.suppress(Exception):
                    self._write_run_json()
            error = handle.error
            outcome = (
                CellOutcome.OK
                if error is None
                else CellOutcome.INTERRUPTED
                if isinstance(error, CellInterrupted)
                else CellOutcome.ERROR
            )
            try:
                self.journal.append(
                    EntryKind.CELL_END,
                    of=handle.journal_seq,
                    cell_id=handle.cell_id,
                    outcome=outcome,
                    duration_s=round(handle.elapsed_s, 6),
                    reported=handle.reported,
                )
            except Exception:  # noqa: BLE001 - storage gone: the cell's own outcome stands
                pass
            if self.state is GroupState.RUNNING and self._active is handle:
                self.state_machine.to(GroupState.READY, f"{handle.name} ended")

    # ---- variables ---------------------------------------------------------------------
    def pull(self, name: str, ranks: Iterable[int] | str | None = None) -> list[Any]:
        """The value of ``name`` on each rank, in rank order (``%rtnb pull``)."""

        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"{name!r} is not a Python variable name")
        rank_list = _ranks(ranks, self._require_group(wait_s=_WAIT_FOR_GROUP_S).world_size)
        answers = self._call_ranks(
            lambda group: group.pull(rank_list, name),
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
        """Set each ``name: value`` in the namespace of every rank (``%rtnb push``).

        The values are serialized once: the same bytes go to the ranks and, beside
        the journal entry, to storage, so a replay pushes them again."""
        for name in values:
            if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
                raise ConfigError(f"{name!r} is not a Python variable name")
        group = self._require_group(wait_s=_WAIT_FOR_GROUP_S)
        rank_list = _ranks(ranks, group.world_size)
        data = _serialize(dict(values))
        self.journal.append(
            EntryKind.PUSH,
            values=data,
            names=sorted(values),
            ranks=None if ranks is None else rank_list,
        )
        self._send_values(data, rank_list)

    def _send_values(self, data: bytes, ranks: list[int]) -> None:
        import ray

        ref = ray.put(data)
        self._call_ranks(
            lambda group: group.push(ranks, ref),
            "sending values to the ranks",
            timeout_s=300,
        )

    def _call_ranks(self, calls: Callable[[WorkerGroup], list], what: str, timeout_s: float):
        """``ray.get`` of ``calls(group)``; each failure becomes one rtnb error line.

        A rank that died under a running cell that recovery will rebuild is not an
        error of this call: it waits for the rebuilt group and asks it instead."""
        import ray

        group = self._require_group(wait_s=_WAIT_FOR_GROUP_S)
        for attempt in range(2):
            try:
                return ray.get(calls(group), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise SessionError(
                    f"{what} took over {timeout_s:g} s (a rank busy in native code?); try again"
                ) from None
            except ray.exceptions.RayError as exc:
                rebuilt = attempt == 0 and self._wait_for_recovery(group)
                if rebuilt is None:
                    raise WorkerGroupError(
                        f"{what} failed: a rank died ({one_line(exc)})"
                    ) from None
                group = rebuilt
        raise AssertionError("unreachable")

    def _wait_for_recovery(self, lost: WorkerGroup) -> WorkerGroup | None:
        """The group that recovery builds to replace ``lost``; None when no
        recovery is coming (no running cell, or --max-failures spent)."""
        active = self._active
        if active is None or active.done() or not (active.recovering or self.policy.can_recover()):
            return None
        deadline = time.monotonic() + _WAIT_FOR_GROUP_S
        while time.monotonic() < deadline:
            group = self._group
            if group is not None and group is not lost and self._ready.is_set():
                return group
            if active.done() and not active.recovering and self._group is lost:
                return None
            time.sleep(0.05)
        return None

    # ---- status ------------------------------------------------------------------------
    def status(self) -> GroupStatus:
        group = self._group
        active = self.active_cell
        ranks = []
        if group is not None:
            for info in group.ranks:
                last = self.metrics.last.get(info.rank)
                state, step = "idle", last.step if last is not None else 0
                if active is not None and info.rank in active.ranks:
                    state = active.states.get(info.rank, "running")
                    # the rank's own step once it answered (after a resume it is
                    # below the last report of the earlier line)
                    step = (
                        max(active.steps.get(info.rank, -1), 0)
                        if info.rank in active.lines
                        else step
                    )
                ranks.append(
                    RankStatus(
                        info.rank,
                        f"{info.hostname} ({info.node_ip})",
                        info.pid,
                        info.device,
                        step,
                        state,
                    )
                )
        cell = ""
        if self._lost is not None:
            cell = self._lost
        elif active is not None:
            cell = f"{active.name}{' (background)' if active.background else ''} running for {active.elapsed_s:.1f} s"
        return GroupStatus(
            state=self._state_text(),
            run_name=self.run_name,
            address=self.connection.address if self.connection else "-",
            backend=self.config.backend or "",
            world_size=self.config.workers,
            ranks=ranks,
            cell=cell,
        )

    def __repr__(self) -> str:
        return (
            f"<rtnb.Session run={self.run_name!r} state={self.state} workers={self.config.workers}>"
        )


# pull/push during a recovery wait this long for the rebuilt group before saying so.
_WAIT_FOR_GROUP_S = 60.0
_FUNCTION_NAMES = ("__rtnb_fn__", "__rtnb_config__")


def _serialize(values: dict[str, Any]) -> bytes:
    from ray import cloudpickle

    try:
        return cloudpickle.dumps(values)
    except Exception as exc:  # noqa: BLE001 - anything unpicklable
        raise ConfigError(
            f"cannot send {', '.join(sorted(values))} to the ranks: not picklable "
            f"({one_line(exc)}); create it in a %%rtrain cell instead"
        ) from None


def _function_call(fn: Callable, config: Any) -> tuple[bytes, str]:
    """A function (and its config) by value, and the code that calls it on a rank.
    cloudpickle stores functions defined in the notebook by value, so the journal
    can replay them in a process that never saw their definition."""
    values = _serialize({_FUNCTION_NAMES[0]: fn, _FUNCTION_NAMES[1]: config})
    return values, "__rtnb_fn__(__rtnb_config__)" if config is not None else "__rtnb_fn__()"


def _ranks(ranks: Iterable[int] | str | None, world_size: int) -> list[int]:
    if ranks is None or isinstance(ranks, str):
        return parse_ranks(ranks, world_size)
    return parse_ranks(",".join(str(int(r)) for r in ranks), world_size)


def check_syntax(code: str, filename: str = "<rtrain-cell-0>") -> None:
    """Raise CellError for a SyntaxError before anything is sent to the ranks."""
    import traceback

    try:
        compile(code, filename, "exec")
    except SyntaxError as exc:
        text = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
        raise CellError(
            f"the cell has a SyntaxError and was not sent to the ranks:\n{text}",
            exc_type="SyntaxError",
        ) from None


def _announce_to_batch_runner(storage: str, run_name: str) -> None:
    """Under ``rtnb run``, tell the runner which run directory this notebook uses, so
    it can keep the output notebook there."""
    path = os.environ.get(BATCH_RUNS_ENV)
    if not path:
        return
    # Masked: this file is on disk; the runner knows the real URI it passed us.
    with contextlib.suppress(OSError), open(path, "a") as out:
        out.write(json.dumps({"storage": redact_uri(storage), "run": run_name}) + "\n")


def _stop_sessions_at_exit() -> None:
    """Register the exit hook once Ray is imported: atexit runs hooks last-in first-out,
    and Ray's own shutdown hook, run while ranks are still alive, stalls the exit for
    ~20 s (and a kernel manager that loses patience SIGTERMs the kernel mid-way)."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        atexit.register(_stop_all_sessions)
        _EXIT_HOOKED = True


_EXIT_HOOKED = False


def _stop_all_sessions() -> None:
    # A kernel that exits (or is shut down) must not leave ranks holding CPUs/GPUs.
    for session in list(_LIVE):
        try:
            session.stop()
        except BaseException:  # noqa: BLE001
            pass
