"""The session's controller: one state machine over the group and its cells.

:class:`Controller` is the only owner of the session's worker group, its size and its
state, as Ray Train V2's ``TrainController``: it alone makes, replaces and removes
the group (through a :class:`GroupBuilder`, ``ranks/_builder.py``), moves the
:class:`StateMachine` (``lifecycle/_states.py``; every transition is in its table, drawn in
``docs/architecture.md``) and writes the journal's group entries (start, restart,
scale). What follows a failure it asks the :class:`FailurePolicy`; an elastic
group's sizes, the :class:`ScalingPolicy` (``lifecycle/_policies.py``).

Its transitions::

    start(replay)      NEW|STOPPED|FAILED → STARTING → READY
    a cell             READY → RUNNING → READY                 (the cell flow's begin/end)
    recover(failure)   RUNNING → RECOVERING → RUNNING | READY  (rebuilt, replayed, or given up)
    scale(workers)     READY → RESIZING → READY                (the size is the argument)
    grow()             READY → RESIZING → READY                (an elastic group's room came back)
    restart(replay)    READY|RUNNING|FAILED → RESTARTING → READY
    stop()             … → STOPPING → STOPPED

The options (:class:`SessionConfig`) are frozen: a transition that changes the
group's size builds the new group from a resized copy and swaps it in only once the
group runs, so a failed scale leaves the options as they were. The cells run
through the :class:`CellFlow` the controller owns (``cells/_flow.py``), which asks it
for the running group and hands it failures; the journal is replayed onto every new
group that keeps the ranks' state by a :class:`Replayer` (``control/_replay.py``).
How the cell flow, a recovery and the status reach the group (waiting while it is
made or replaced) is its base, :class:`GroupHolding` (``control/_holding.py``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from rtnb.core._config import SessionConfig
from rtnb.driver.cells import CellFlow, CheckpointCoordinator
from rtnb.driver.cluster import StartProgress, StartReport
from rtnb.driver.control._holding import GroupHolding
from rtnb.driver.control._recovery import Recovery
from rtnb.driver.control._replay import Replayer
from rtnb.driver.control._run_files import RunRecorder, attach_run_outputs
from rtnb.driver.lifecycle import (
    ACTIVE,
    FailurePolicy,
    GroupState,
    RankDied,
    ReplayReport,
    ScalingPolicy,
)
from rtnb.driver.ranks import (
    Connector,
    GroupBuilder,
    GroupFactory,
    RankLost,
    command_all,
)
from rtnb.errors import (
    ClusterError,
    RtnbError,
    SessionError,
    WorkerGroupError,
    one_line,
)
from rtnb.metrics._store import MetricsStore
from rtnb.storage._checkpoints import CheckpointStore
from rtnb.storage._journal import EntryKind, Journal
from rtnb.storage._logs import RankLogs
from rtnb.storage._rundir import RunDirectory
from rtnb.worker._commands import SetStep

__all__ = ["Controller"]


class Controller(GroupHolding):
    """Owns the group, its size and its state; see the module docstring. How its
    readers reach the group is its base, :class:`GroupHolding`."""

    def __init__(
        self,
        config: SessionConfig,
        run_name: str,
        run_dir: RunDirectory,
        journal: Journal,
        commits: CheckpointCoordinator,
        checkpoints: CheckpointStore,
        metrics: MetricsStore,
        policy: FailurePolicy,
        *,
        scaling: ScalingPolicy,
        group_factory: GroupFactory,
        connector: Connector,
        at_exit: Callable[[], None],
        tracking_record: Callable[[], dict],
    ) -> None:
        super().__init__(config, run_name, commits.latest_id)
        self.run_dir = run_dir
        self.journal = journal
        self.commits = commits
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.scaling = scaling
        self.logs: RankLogs | None = None  # every rank's output, in {run}/logs/
        self.last_start: StartReport | None = None
        self.last_replay: ReplayReport | None = None  # of start/restart --replay, scale
        # One lock for the group's changes and the cells' starts.
        self.lock = threading.RLock()
        self._record = RunRecorder(run_dir, run_name, commits, tracking_record)
        self._builder = GroupBuilder(
            run_name,
            scaling,
            group_factory=group_factory,
            connector=connector,
            at_exit=at_exit,
            on_ray_lost=self._ray_went_away,
        )
        # The one holder of the failure policy: decides each failure once.
        self.recovery = Recovery(self, policy)
        self.cells = CellFlow(self, self.recovery, journal, commits, checkpoints, metrics)
        self._replayer = Replayer(
            journal,
            lambda: self.world_size,
            self.cells.values.send_values,
            self.cells.run_replayed,
            self.cells.values.hand_datasets,
            self.cells.values.send_controls,
        )

    def cell_started(self, name: str) -> None:
        self.state_machine.to(GroupState.RUNNING, name)

    def cell_ended(self, name: str) -> None:
        if self.state is GroupState.RUNNING:
            self.state_machine.to(GroupState.READY, f"{name} ended")

    # ---- start and stop ------------------------------------------------------------------
    def start(self, steps: StartProgress, prepare: Callable[[], None], replay: bool) -> None:
        """Connect to Ray, start the group and, with ``replay``, rebuild the ranks'
        state from the journal; ``prepare`` runs first (inside the start, so its
        failure fails the start with one line)."""
        with self.lock:
            if self.state in ACTIVE:
                raise SessionError(
                    f"the worker group of run {self.run_name!r} is already started; "
                    "use `%rtnb restart` for a fresh one or `%rtnb stop` first"
                )
            self.state_machine.to(GroupState.STARTING)
            try:
                self.run_dir.ensure_writable()
                self.logs = attach_run_outputs(self.run_dir, self._config, self.metrics, self.logs)
                prepare()
                built = self._builder.connect_and_build(self._config, steps)
            except BaseException as exc:
                # A start that fails stops the embedded Ray it started and lets go of a
                # cluster it joined (RankGroup.start already freed its placement group
                # and actors).
                self._builder.drop_connection()
                self.state_machine.to(GroupState.FAILED, one_line(exc))
                if isinstance(exc, KeyboardInterrupt):
                    raise SessionError(
                        "starting the worker group was interrupted; its placement group and "
                        "actors were freed"
                    ) from None
                if isinstance(exc, RtnbError):
                    raise
                raise SessionError(f"starting the worker group failed: {one_line(exc)}") from None
            self.group, self.size_reason = built.group, built.size_reason
            self.last_start = steps.report
            try:
                self._record.carry_on()
                self.continue_step_count()
                self.journal.append(
                    EntryKind.START, workers=self.world_size, keep=replay, reason=self.size_reason
                )
                if replay:
                    self._replay("start --replay")
            except BaseException as exc:
                if self.state is GroupState.STARTING:
                    self.state_machine.to(GroupState.FAILED, one_line(exc))
                raise
            self.ready_again("started")

    def stop(self) -> None:
        """Stop any running cell (the cooperative grace first), free every actor and
        the placement group, close the run's outputs."""
        clean = self._lost is None and self.cells.stop_active(
            "stopped because the worker group is stopping"
        )
        with self.lock:
            if self.state in (GroupState.NEW, GroupState.STOPPED):
                return
            self.state_machine.to(GroupState.STOPPING)
            group, self.group = self.group, None
            if group is not None and self._lost is None:
                group.shutdown(graceful=clean, timeout_s=5.0 if clean else 1.0)
            self._builder.close()
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

    # ---- rebuilds that keep the state, or not ---------------------------------------------
    def restart(self, replay: bool) -> None:
        """A new group with the same options; the ranks' variables kept by a replay
        of the journal, or dropped."""
        self.cells.stop_active("stopped because the worker group restarts")
        with self.lock:
            self.state_machine.to(GroupState.RESTARTING, "restart requested")
            self.rebuild("restart requested", self._config, fresh=not replay)
            self.recovery.reset()
            if replay:
                self._replay("restart --replay")
            self.ready_again("restarted")

    def resized(self, workers: int | tuple[int, int]) -> SessionConfig:
        """The options at ``workers`` (checked: valid, and it fits the cluster when a
        group runs): N ranks, ``(MIN, MAX)`` for an elastic group, 0 for local mode."""
        config = self._config.resized(workers)
        if self.group is not None:
            self.check_fits(config)  # before the group is taken down
        return config

    def scale(self, config: SessionConfig) -> None:
        """A group at ``config``'s size (from :meth:`resized`) holding the same
        variables: the journal is replayed onto it. Without a group, the options
        the next start uses."""
        if self.state in (GroupState.NEW, GroupState.STOPPED):
            self._config = config
            return
        self.cells.stop_active(
            f"stopped because the worker group scales to {config.workers_text} ranks"
        )
        with self.lock:
            old = self.world_size
            self.state_machine.to(GroupState.RESIZING, f"scale to {config.workers_text}")
            self.rebuild(
                f"scaling from {old} to {config.workers_text} ranks", config, kind=EntryKind.SCALE
            )
            self._config = config  # the group runs at this size now
            self._replay(f"scale {old} → {self.world_size}")
            self.ready_again("scaled")

    def grow(self) -> str | None:
        """An elastic group below MAX grows when the cluster has room again (never
        in a cell: a rebuild with the journal replayed); the line saying so, or None
        when it stays."""
        config, group = self._config, self.group
        if not config.elastic or group is None or self._lost is not None:
            return None
        old = group.world_size
        try:
            room = self._builder.room_for_ranks(config, held=old)
        except Exception:  # noqa: BLE001 - no view of the cluster now: grow another time
            return None
        target = self.scaling.grow_to(config, old, room)
        if target is None:
            return None
        with self.lock:
            reason = f"elastic: the cluster has room for {target} ranks again"
            self.state_machine.to(GroupState.RESIZING, reason)
            self.rebuild(reason, config, kind=EntryKind.SCALE, expect=target)
            report = self._replay(f"grow {old} → {self.world_size}")
            self.ready_again("grew")
        return (
            f"[rtnb] elastic group grew from {old} to {self.world_size} ranks "
            f"(resources came back); {report}\n"
        )

    def ready_again(self, why: str) -> None:
        self.state_machine.to(GroupState.READY, why)
        self.write_run_record()

    def rebuild(
        self,
        reason: str,
        config: SessionConfig,
        *,
        fresh: bool = False,
        kind: EntryKind = EntryKind.RESTART,
        expect: int | None = None,
        lost: int = 0,
    ) -> None:
        """Replace the group by one of ``config``'s size, in the transition's state;
        ``fresh`` records that the ranks' state is gone (the journal's replay starts
        after it); ``expect``: the size an elastic group grows to; ``lost``: the
        ranks a failure took (see ``GroupBuilder.build``). A failure moves to FAILED."""
        if self.check_ray_lost():
            raise ClusterError(self._lost)
        with self.lock:
            group, self.group = self.group, None
            without = group.world_size - lost if group is not None and lost else None
            if group is not None:
                group.shutdown(graceful=False)
            try:
                self._builder.connect(config, StartProgress())  # local mode scaled out to Ray
                built = self._builder.build(config, expect=expect, without=without)
            except RtnbError as exc:
                # A Ray that is shutting down (`rtnb warm stop --force`, a head's
                # `ray stop`) kills the ranks and refuses new ones before its GCS
                # closes: then the news is that Ray is gone, not the placement.
                gone = self.check_ray_lost(settle_s=2.5)
                if gone:
                    raise ClusterError(gone) from None
                self.state_machine.to(GroupState.FAILED, str(exc))
                raise
            self.group, self.size_reason = built.group, built.size_reason
            self.journal.append(
                kind, workers=self.world_size, keep=not fresh, reason=self.size_reason or reason
            )
            self.continue_step_count()

    def _replay(self, why: str) -> ReplayReport:
        """Rebuild the ranks' state on the new group from the journal (fails the
        group with one line if a replayed cell fails)."""
        try:
            report = self.replay_journal()
        except RankDied:
            self.state_machine.to(GroupState.FAILED, "a rank died during the replay")
            raise WorkerGroupError(
                f"a rank died while the journal was replayed ({why}); start again"
            ) from None
        except RtnbError as exc:
            self.state_machine.to(GroupState.FAILED, str(exc))
            raise
        finally:
            self.checkpoints.cleanup_incomplete()
        self.continue_step_count()
        self.last_replay = report
        return report

    def replay_journal(self, before: int | None = None) -> ReplayReport:
        """Replay in this thread, which alone may use the group until it is ready."""
        self._replaying = threading.get_ident()
        try:
            return self._replayer.replay(before)
        finally:
            self._replaying = None

    # ---- after a failure (carried out by its Recovery) ------------------------------------
    def can_recover(self) -> bool:
        return self.recovery.can_recover()

    def adopt(self, config: SessionConfig) -> None:
        """``config`` in force: a group of its size runs now."""
        self._config = config

    # ---- where the ranks are ----------------------------------------------------------------
    def continue_step_count(self) -> None:
        """New ranks (a rebuild, or a run continued by a new session with the same
        --name and storage) carry on where the old ones were: same line, same step
        count, so checkpoint ids are never reused."""
        group = self.group
        if group is not None:
            line, step = self.commits.line, self.commits.step
            try:
                group.gather(command_all(group, range(group.world_size), SetStep(step, line)), 60)
            except RankLost:
                pass  # a rank already died: the next cell's poll reports it

    def write_run_record(self, wait: bool = True) -> None:
        self._record.write(str(self.state), self._config, self.group, wait)
