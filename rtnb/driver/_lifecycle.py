"""The worker group's lifecycle: start, rebuild, stop, and the Ray under it going away.

:class:`GroupLifecycle` is the one owner of the session's :class:`RankGroup`, its
cluster connection and its :class:`StateMachine`: nothing else replaces or removes
the group. The cell flow asks it for the running group (:meth:`require_group`), the
recovery flow asks it to rebuild; both read :attr:`ray_lost`. It also keeps the
run record (``run.json``) current, since the group's ranks and state are in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable

from rtnb.core._config import SessionConfig
from rtnb.core._redact import redact_uri
from rtnb.driver import _warm
from rtnb.driver._cluster import ClusterConnection, will_embed
from rtnb.driver._commits import CheckpointCoordinator
from rtnb.driver._embedded import rank_cpus
from rtnb.driver._group import RankGroup, RankLost, WorkerGroup, check_capacity
from rtnb.driver._local import LocalGroup
from rtnb.driver._startup import StartProgress, StartReport
from rtnb.driver._state import GroupState, StateChange, StateMachine
from rtnb.errors import ClusterError, ConfigError, RtnbError, SessionError, one_line
from rtnb.metrics._store import MetricsStore
from rtnb.metrics._tensorboard import TensorBoardExporter
from rtnb.storage._journal import EntryKind, Journal
from rtnb.storage._layout import (
    SYSTEM_METRICS,
    RunRecord,
    read_run_record,
    tensorboard_dir,
    write_run_record,
)
from rtnb.storage._logs import RankLogs
from rtnb.storage._metricslog import MetricsLog
from rtnb.storage._rundir import RunDirectory

__all__ = ["GroupLifecycle", "new_group"]

# An elastic group below MAX: how long the view of free resources may settle (the
# last group's coming free) before the group starts with what fits; longer when it
# grows back to a size already seen free.
_ELASTIC_SETTLE_S = 1.5
_ELASTIC_GROW_S = 10.0
# How long a size above MIN may take to be placed before one rank less is tried.
_ELASTIC_TRY_S = 3.0

GroupFactory = Callable[[SessionConfig, str, str], RankGroup]
Connector = Callable[..., ClusterConnection]


def new_group(config: SessionConfig, run_name: str, storage_path: str) -> RankGroup:
    """The group ``config`` asks for: ranks on Ray, or local mode's one in this kernel."""
    if config.local:
        return LocalGroup(config, run_name, storage_path)
    return WorkerGroup(config, run_name, storage_path)


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
        # Why the group has its size, when elastic ("elastic 2-4: 3 ranks (...)").
        self.size_reason: str | None = None
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
            self._connect(steps)
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
        self.journal.append(
            EntryKind.START, workers=self.world_size, keep=replay, reason=self.size_reason
        )

    def _connect(self, steps: StartProgress) -> None:
        """Join (or start) the Ray the group's ranks need; local mode needs none."""
        if self.connection is not None or self.config.local:
            return
        self.check_fits(self.config)
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

    def check_fits(self, config: SessionConfig) -> None:
        """One line when a group of ``config``'s size cannot be placed: against the
        cluster once connected, else against this machine for an embedded Ray
        (known before Ray starts, ~10 s); local mode always fits."""
        if config.local:
            return
        if config.elastic:  # fits when MIN does
            config = dataclasses.replace(config, workers=config.min_workers, min_workers=None)
        if self.connection is not None:
            check_capacity(config)
        elif will_embed(config.address) and not config.gpu:
            check_capacity(config, {"CPU": os.cpu_count() or 1}, "this machine")

    def _attach_outputs(self) -> None:
        if self.metrics.log is None:
            self.metrics.log = MetricsLog(self.run_dir)
            self.metrics.system_log = MetricsLog(self.run_dir, SYSTEM_METRICS)
        if self.logs is None:
            self.logs = RankLogs(self.run_dir)
        if self.config.tensorboard and self.metrics.exporter is None:
            if not self.run_dir.is_local:
                raise ConfigError(
                    "--tensorboard writes event files next to the run: it needs a local --storage"
                )
            self.metrics.exporter = TensorBoardExporter(tensorboard_dir(self.run_dir.path))

    def _new_group(
        self,
        progress: StartProgress | None = None,
        expect: int | None = None,
        without: int | None = None,
    ) -> RankGroup:
        """A started group of the configured size; an elastic one (``--workers
        MIN-MAX``) as large as the cluster places now, up to MAX (``expect``: the
        size resources were seen for, waited for a little longer while the last
        group's resources come free; ``without``: the size the last group has
        without the ranks a failure took, tried next when the cluster's view, still
        counting a lost node, offered more than it places)."""
        if not self.config.elastic:
            group = self._group_factory(self.config, self.run_name, self.config.storage_path)
            group.start(progress)
            self.size_reason = None
            return group
        low, high = self.config.min_workers or 1, self.config.workers
        size, room = self._elastic_size(expect)
        while True:
            last = size <= low
            sized = dataclasses.replace(
                self.config,
                workers=size,
                min_workers=None,
                # A view of free resources can be stale (a lost node still counted):
                # a size above MIN that does not place soon gives way to one less.
                placement_timeout_s=(
                    self.config.placement_timeout_s
                    if last
                    else min(self.config.placement_timeout_s, _ELASTIC_TRY_S)
                ),
            )
            group = self._group_factory(sized, self.run_name, self.config.storage_path)
            try:
                group.start(progress)
            except ClusterError:
                if last:
                    raise
                size = max(low, min(size - 1, without or size))
                without = None
                room = min(room, size)
                continue
            break
        self.size_reason = f"elastic {low}-{high}: {size} rank{'s' if size != 1 else ''}" + (
            "" if size == high else f" (the cluster has room for {room})"
        )
        return group

    def _elastic_size(self, expect: int | None) -> tuple[int, int]:
        """(the size to try, the ranks the cluster has room for): MAX when it fits,
        else what fits once the view settled, at least MIN (else one line after
        ``placement_timeout_s``)."""
        cfg = self.config
        low, high = cfg.min_workers or 1, cfg.workers
        started = time.monotonic()
        settle = _ELASTIC_SETTLE_S if expect is None else _ELASTIC_GROW_S
        while True:
            room = self.room_for_ranks()
            waited = time.monotonic() - started
            if room >= min(high, expect or high) or (room >= low and waited >= settle):
                return min(room, high), room
            if waited >= cfg.placement_timeout_s:
                raise ClusterError(
                    f"an elastic group of {cfg.workers_text} ranks needs at least {low}, but the "
                    f"cluster has room for {room} ({cfg.cpus_per_worker:g} CPU"
                    + (" and a GPU" if cfg.gpu else "")
                    + f" each) after {cfg.placement_timeout_s:g} s: free resources, or "
                    "start with a smaller MIN"
                )
            time.sleep(0.2)

    def room_for_ranks(self, held: int = 0) -> int:
        """How many ranks the cluster's free resources hold, plus ``held`` that a
        group being replaced frees."""
        import ray

        cfg = self.config
        free = ray.available_resources()
        room = (
            [int(rank_cpus(free, ray.cluster_resources()) / cfg.cpus_per_worker + 1e-9)]
            if cfg.cpus_per_worker
            else []
        )
        if cfg.gpu:
            room.append(int(free.get("GPU", 0) + 1e-9))
        return (min(room) if room else cfg.workers) + held

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
    def world_size(self) -> int:
        """The running group's ranks (an elastic group's current size), else the
        configured size."""
        group = self.group
        return group.world_size if group is not None else self.config.world_size

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
        expect: int | None = None,
        lost: int = 0,
    ) -> None:
        """Replace the group; ``fresh`` records that the ranks' state is gone (the
        journal's replay starts after it); ``expect``: the size an elastic group
        grows back to; ``lost``: the ranks a failure took (see ``_new_group``)."""
        if self.check_ray_lost():
            raise ClusterError(self._lost)
        with self._lock:
            self.state_machine.to(GroupState.RESTARTING, reason)
            group, self.group = self.group, None
            without = group.world_size - lost if group is not None and lost else None
            if group is not None:
                group.shutdown(graceful=False)
            try:
                self._connect(StartProgress())  # local mode scaled out to Ray
                self.group = self._new_group(expect=expect, without=without)
            except RtnbError as exc:
                # A Ray that is shutting down (`rtnb warm stop --force`, a head's
                # `ray stop`) kills the ranks and refuses new ones before its GCS
                # closes: then the news is that Ray is gone, not the placement.
                lost = self.check_ray_lost(settle_s=2.5)
                if lost:
                    raise ClusterError(lost) from None
                self.state_machine.to(GroupState.FAILED, str(exc))
                raise
            self.journal.append(
                kind, workers=self.world_size, keep=not fresh, reason=self.size_reason or reason
            )
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
