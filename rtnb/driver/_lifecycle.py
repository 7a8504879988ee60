"""The worker group's lifecycle: start, rebuild, stop, and the Ray under it going away.

:class:`GroupLifecycle` is the one owner of the session's :class:`RankGroup`, its
cluster connection and its :class:`StateMachine`: nothing else replaces or removes
the group. The cell flow asks it for the running group (:meth:`require_group`), the
recovery flow asks it to rebuild; both read :attr:`ray_lost`. It also keeps the
run record (``run.json``) current, since the group's ranks and state are in it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

from rtnb.core._config import SessionConfig
from rtnb.core._redact import redact_uri
from rtnb.driver import _warm
from rtnb.driver._cluster import ClusterConnection, will_embed
from rtnb.driver._commits import CheckpointCoordinator
from rtnb.driver._group import RankGroup, RankLost, check_capacity
from rtnb.driver._startup import StartProgress, StartReport
from rtnb.driver._state import GroupState, StateChange, StateMachine
from rtnb.errors import ClusterError, ConfigError, RtnbError, SessionError, one_line
from rtnb.metrics._store import MetricsStore
from rtnb.metrics._tensorboard import TensorBoardExporter
from rtnb.storage._journal import EntryKind, Journal
from rtnb.storage._layout import RunRecord, read_run_record, tensorboard_dir, write_run_record
from rtnb.storage._logs import RankLogs
from rtnb.storage._metricslog import MetricsLog
from rtnb.storage._rundir import RunDirectory

__all__ = ["GroupLifecycle"]

GroupFactory = Callable[[SessionConfig, str, str], RankGroup]
Connector = Callable[..., ClusterConnection]


class GroupLifecycle:
    """Starts, rebuilds and stops the group of one run; see the module docstring."""

    def __init__(
        self,
        config: SessionConfig,
        run_name: str,
        run_dir: RunDirectory,
        journal: Journal,
        commits: CheckpointCoordinator,
        metrics: MetricsStore,
        *,
        group_factory: GroupFactory,
        connector: Connector,
        lock: threading.RLock,
        at_exit: Callable[[], None],
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.run_name = run_name
        self.journal = journal
        self.commits = commits
        self.metrics = metrics
        self.state_machine = StateMachine()
        self.logs: RankLogs | None = None  # every rank's output, in {run}/logs/
        self.connection: ClusterConnection | None = None
        self.last_start: StartReport | None = None
        self.group: RankGroup | None = None
        self._ready = threading.Event()
        self.state_machine.subscribe(self._track_ready)
        self._group_factory = group_factory
        self._connector = connector
        self._lock = lock
        self._at_exit = at_exit
        self._started_at: float | None = None  # run.json's "started"
        self._lost: str | None = None  # set once the Ray under the group is gone
        # What run.json says of the run's MLflow run (set by the tracking flow).
        self.tracking_record: Callable[[], dict] = dict

    @property
    def state(self) -> GroupState:
        return self.state_machine.state

    def _track_ready(self, change: StateChange) -> None:
        if change.new in (GroupState.READY, GroupState.RUNNING):
            self._ready.set()
        else:
            self._ready.clear()

    # ---- start -------------------------------------------------------------------------
    def start(self, steps: StartProgress, prepare: Callable[[], None], replay: bool) -> None:
        """Connect to Ray and start the group; ``prepare`` runs first (inside the
        start, so its failure fails the start with one line)."""
        if self.state in (GroupState.READY, GroupState.RUNNING, GroupState.STARTING):
            raise SessionError(
                f"the worker group of run {self.run_name!r} is already started; "
                "use `%rtnb restart` for a fresh one or `%rtnb stop` first"
            )
        self.state_machine.to(GroupState.STARTING)
        try:
            self.run_dir.ensure_writable()
            self._attach_outputs()
            prepare()
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
                self._at_exit()
                if self.connection.watch is not None:
                    self.connection.watch.subscribe(self._ray_went_away)
            self.group = self._new_group(steps)
        except BaseException as exc:
            # A start that fails stops the embedded Ray it started (RankGroup.start
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
        self.continue_step_count()
        self.write_run_record()
        self.journal.append(EntryKind.START, workers=self.config.workers, keep=replay)

    def _attach_outputs(self) -> None:
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

    def _new_group(self, progress: StartProgress | None = None) -> RankGroup:
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

    def _drop_owned_connection(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None and connection.owned:
            try:
                connection.shutdown()
            except Exception:  # noqa: BLE001 - already failing; the first error is the news
                pass
        elif connection is not None:
            self.connection = connection

    # ---- the running group -------------------------------------------------------------
    def require_group(
        self, wait_s: float = 0.0, state_text: Callable[[], str] | None = None
    ) -> RankGroup:
        """The running group. While it is being rebuilt (recovery, restart, scale),
        wait up to ``wait_s`` for it, then say so (in ``state_text()``'s words, only
        then asked); never "no worker group"."""
        if self._lost is not None:
            raise ClusterError(self._lost)
        if self.state in (GroupState.RESTARTING, GroupState.STARTING) or (
            self.group is None and self.state is GroupState.RUNNING
        ):
            self._ready.wait(wait_s)
        group = self.group
        if group is not None and self.state in (GroupState.READY, GroupState.RUNNING):
            return group
        if self.state in (GroupState.RESTARTING, GroupState.STARTING, GroupState.RUNNING):
            raise SessionError(
                f"the worker group is {state_text() if state_text else self.state}; "
                "try again once it is ready "
                "(`%rtnb status`)"
            )
        raise SessionError(
            "no worker group is running: start one with `%rtnb start` (or Session.start())"
        )

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    def continue_step_count(self) -> None:
        """New ranks (a rebuild, or a run continued by a new session with the same
        --name and storage) carry on where the old ones were: same line, same step
        count, so checkpoint ids are never reused."""
        group = self.group
        if group is not None:
            line, step = self.commits.line, self.commits.step
            try:
                group.gather(group.set_step(step, line), 60)
            except RankLost:
                pass  # a rank already died: the next cell's poll reports it

    # ---- rebuild and stop ---------------------------------------------------------------
    def rebuild(
        self,
        reason: str,
        fresh: bool = False,
        kind: EntryKind = EntryKind.RESTART,
    ) -> None:
        """Replace the group; ``fresh`` records that the ranks' state is gone (the
        journal's replay starts after it)."""
        if self.check_ray_lost():
            raise ClusterError(self._lost)
        with self._lock:
            self.state_machine.to(GroupState.RESTARTING, reason)
            group, self.group = self.group, None
            if group is not None:
                group.shutdown(graceful=False)
            try:
                self.group = self._new_group()
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
            self.continue_step_count()
            self.write_run_record()

    def stop(self, graceful: bool) -> None:
        """Free every actor and the placement group, close the run's outputs."""
        with self._lock:
            if self.state in (GroupState.NEW, GroupState.STOPPED):
                return
            self.state_machine.to(GroupState.STOPPING)
            group, self.group = self.group, None
            if group is not None and self._lost is None:
                group.shutdown(graceful=graceful, timeout_s=1.0 if not graceful else 5.0)
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
                self.write_run_record()
            except Exception:  # noqa: BLE001 - stopping must not fail on a storage hiccup
                pass

    # ---- the Ray under the group going away ---------------------------------------------
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
            # A lost Ray reaches _ray_went_away through the watch.
            self.connection.check_lost(settle_s)
        return self._lost

    def _ray_went_away(self, why: str) -> None:
        latest = None
        with contextlib.suppress(Exception):
            latest = self.commits.latest_id()
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
        if self.connection is not None and not self.connection.driver_outlives_ray:
            # rtnb keeps a driver it made alive; one the user's code made has Ray's rule.
            self._lost += (
                ". This kernel's Ray driver came from its own ray.init() before "
                "`%rtnb start`, and Ray ends the kernel about 60 s after its GCS went "
                "away: save what you need now"
            )
        self.group = None
        with contextlib.suppress(RuntimeError):  # already stopping or stopped
            self.state_machine.to(GroupState.FAILED, self._lost)

    # ---- the run record -----------------------------------------------------------------
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

    def write_run_record(self) -> None:
        group = self.group
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
                mlflow=self.tracking_record(),
                **self.commits.record(),
            ),
        )
