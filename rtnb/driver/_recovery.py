"""Recovery and replay: every flow that puts the ranks' state on a new group.

:class:`RecoveryFlow` is the one owner of what follows a failure: a cell hands it a
:class:`~rtnb.driver._policy.Failure`, the :class:`FailurePolicy` decides, and the
flow rebuilds the group (through the lifecycle), replays the run's journal onto it
and says what happened in the cell's outcome; the cell only follows it. The same
flow rebuilds with replay for ``scale``, ``restart --replay`` and ``start --replay``
in a new kernel.

:class:`Replayer` replays a journal exactly: the same pushes and cells, in the same
order, on the same ranks (a rank that no longer exists after a scale-down is left
out), with every replayed cell's ``get_checkpoint()`` returning the run's latest
committed checkpoint (so a training cell written in the resume pattern costs about
its set-up time). It runs cells through a callable the cell flow gives it, so this
module never imports the cell module.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from rtnb.core._config import SessionConfig
from rtnb.driver._group import RankLost
from rtnb.driver._lifecycle import GroupLifecycle
from rtnb.driver._policy import (
    DURING_REBUILD,
    Decision,
    Failure,
    FailurePolicy,
    Raise,
    RankDied,
    RecoveryOutcome,
    ReplayReport,
    Shrink,
)
from rtnb.driver._state import GroupState
from rtnb.errors import (
    CellInterrupted,
    RtnbError,
    WorkerGroupError,
    one_line,
)
from rtnb.storage._checkpoints import CheckpointStore
from rtnb.storage._journal import EntryKind, Journal, JournalEntry

__all__ = ["RecoveryFlow", "Replayer"]

# Runs one replayed cell on ``ranks``; returns {rank: error} for ranks whose cell
# raised, and raises RankDied when a rank died.
ReplayCell = Callable[[JournalEntry, list[int]], dict[int, tuple]]


class Replayer:
    """Replays a journal onto the current group."""

    def __init__(
        self,
        journal: Journal,
        world_size: Callable[[], int],
        send_values: Callable[[bytes, list[int]], None],
        run_cell: ReplayCell,
        hand_datasets: Callable[[bytes], list[str]],
        set_controls: Callable[[dict[str, Any]], None],
    ) -> None:
        self.journal = journal
        self._world_size = world_size
        self._send_values = send_values
        self._run_cell = run_cell
        self._hand_datasets = hand_datasets
        self._set_controls = set_controls

    def replay(self, before: int | None = None) -> ReplayReport:
        """Replay every action since the last fresh start, up to entry ``before``.

        A replayed cell that fails raises WorkerGroupError naming it; a rank death
        raises RankDied (another failure)."""
        report = ReplayReport()
        started = time.monotonic()
        for step in self.journal.replay_plan(before):
            entry = step.entry
            if step.skipped:
                report.skipped.append(f"{_cell_name(entry)} ({step.skipped})")
                continue
            world = self._world_size()
            ranks = [r for r in (entry.ranks or range(world)) if r < world]
            if not ranks:
                report.skipped.append(
                    f"{_cell_name(entry)} (its ranks {entry.ranks} are not in a group of {world})"
                )
                continue
            if entry.kind is EntryKind.CONTROL:
                self._set_controls(entry.controls or {})
                continue
            if entry.kind is EntryKind.DATASETS:
                missing = self._hand_datasets(self.journal.read_values(entry))
                if missing:
                    report.skipped.append(
                        f"dataset{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                        "(made from the notebook's memory: pass it again)"
                    )
                continue
            if entry.values is not None:
                self._send_values(self.journal.read_values(entry), ranks)
            if entry.kind is EntryKind.PUSH:
                report.pushes += 1
                continue
            failed = self._run_cell(entry, ranks)
            if failed:
                rank, error = min(failed.items())
                raise WorkerGroupError(
                    f"replaying {_cell_name(entry)} failed on rank {rank}: {error[0]}"
                )
            report.cells += 1
        report.duration_s = time.monotonic() - started
        return report


def _cell_name(entry: JournalEntry) -> str:
    return f"cell {entry.label or entry.cell_id}"


class RecoveryFlow:
    """Decides (through the policy) and carries out what follows a failure, and
    every rebuild that keeps the ranks' state; see the module docstring."""

    def __init__(
        self,
        config: SessionConfig,
        lifecycle: GroupLifecycle,
        policy: FailurePolicy,
        replayer: Replayer,
        checkpoints: CheckpointStore,
    ) -> None:
        self.config = config
        self.lifecycle = lifecycle
        self.policy = policy
        self.replayer = replayer
        self.checkpoints = checkpoints
        self.last_replay: ReplayReport | None = None  # of start/restart --replay, scale
        self.last_recovery: RecoveryOutcome | None = None
        self._resized_from: tuple[int, int | None] = (config.workers, config.min_workers)

    # ---- after a failure ---------------------------------------------------------------
    def recover(self, failure: Failure, before: int | None) -> RecoveryOutcome:
        """What the failed cell does next: run again on a rebuilt group with the
        journal replayed up to it (entry ``before``), or end with an error. A rank
        that dies during the rebuild or replay is another failure, decided again."""
        while True:
            failure = dataclasses.replace(failure, world_size=self.lifecycle.world_size)
            decision = self.policy.decide(failure)
            if isinstance(decision, Raise):
                return self._give_up(failure, decision)
            outcome = self._rebuild_and_replay(failure, decision, before)
            if isinstance(outcome, RecoveryOutcome):
                return outcome
            failure = outcome

    def _rebuild_and_replay(
        self, failure: Failure, decision: Decision, before: int | None
    ) -> RecoveryOutcome | Failure:
        machine = self.lifecycle.state_machine
        try:
            if isinstance(decision, Shrink):
                self.config.workers = decision.workers
            self.lifecycle.rebuild(
                f"{failure.summary} ({decision.attempt})",
                lost=sum(1 for rank in failure.dead if rank >= 0),
            )
            # Files a dead rank left half-written never got a manifest: drop them.
            self.checkpoints.drop_pending()
            self.checkpoints.cleanup_incomplete()
            machine.to(GroupState.RUNNING, f"recovering: {failure.summary}")
            report = self.replayer.replay(before)
            self.lifecycle.continue_step_count()
            self.last_recovery = RecoveryOutcome(
                decision,
                report,
                failure_summary=failure.summary,
                world_size=self.lifecycle.world_size,
                resized=self.lifecycle.size_reason
                if self.lifecycle.world_size < failure.world_size
                else None,
            )
            return self.last_recovery
        except (RankLost, WorkerGroupError, RankDied) as exc:
            if machine.state is GroupState.FAILED:
                machine.to(GroupState.RESTARTING, "retrying after a failed rebuild")
                machine.to(GroupState.READY)
            if machine.state is GroupState.READY:
                machine.to(GroupState.RUNNING, "recovering")
            what = "a rank died during replay" if isinstance(exc, RankDied) else one_line(exc)
            return Failure(failure.cell, {DURING_REBUILD: what})
        except RtnbError as exc:
            if self.lifecycle.ray_lost:
                return RecoveryOutcome(decision, ray_lost=True)
            return RecoveryOutcome(
                decision,
                error=WorkerGroupError(f"{failure.summary}; recovery failed: {exc}"),
            )

    def _give_up(self, failure: Failure, decision: Raise) -> RecoveryOutcome:
        """No retry: fresh ranks (the dead or stuck ones cannot be reused) and the
        cell's error saying that its variables are gone."""
        if failure.dead:
            what = failure.summary + decision.why
        else:
            stuck = failure.stuck
            what = (
                f"{failure.cell} {failure.stop_reason}, but rank{'s' if len(stuck) > 1 else ''} "
                f"{', '.join(map(str, stuck))} did not stop within "
                f"{2 * self.config.stop_grace_s:g} s (blocked in a collective or in native code)"
            )
        try:
            self.lifecycle.rebuild(reason=what, fresh=True)
            tail = "the worker group was rebuilt with fresh ranks; variables defined on the ranks are gone"
        except RtnbError as exc:
            if self.lifecycle.ray_lost:
                return RecoveryOutcome(decision, ray_lost=True)
            tail = f"rebuilding the worker group failed: {exc}"
        message = f"{what}; {tail}"
        error = WorkerGroupError(message) if failure.dead else CellInterrupted(message, kept=False)
        return RecoveryOutcome(decision, error=error)

    # ---- rebuilds that keep the state --------------------------------------------------
    def replay_onto_new_group(self, why: str) -> ReplayReport:
        """Rebuild the ranks' state on a new group from the journal (fails the
        session's group with one line if a replayed cell fails)."""
        machine = self.lifecycle.state_machine
        machine.to(GroupState.RUNNING, f"replaying the journal ({why})")
        try:
            report = self.replayer.replay()
        except RankDied:
            machine.to(GroupState.FAILED, "a rank died during the replay")
            raise WorkerGroupError(
                f"a rank died while the journal was replayed ({why}); start again"
            ) from None
        except RtnbError as exc:
            machine.to(GroupState.FAILED, str(exc))
            raise
        finally:
            self.checkpoints.cleanup_incomplete()
        self.lifecycle.continue_step_count()
        self.last_replay = report
        machine.to(GroupState.READY, f"replayed: {report}")
        return report

    def restart(self, replay: bool) -> None:
        """A new group with the same options; the ranks' variables kept by a replay
        of the journal, or dropped."""
        self.lifecycle.rebuild("restart requested", fresh=not replay)
        self.policy.reset()
        if replay:
            self.replay_onto_new_group("restart --replay")

    def resize(self, workers: int | tuple[int, int]) -> int:
        """Set the group's size in the options (checked: valid, and it fits the
        cluster when a group runs): N ranks, or ``(MIN, MAX)`` for an elastic group;
        returns the group's size now."""
        old = self.lifecycle.world_size
        before = self.config.workers, self.config.min_workers
        if isinstance(workers, tuple):
            self.config.workers = workers
        else:
            self.config.workers, self.config.min_workers = workers, None
        try:
            self.config.validate()
            if self.lifecycle.group is not None:
                self.lifecycle.check_fits(self.config)  # before the group is taken down
        except RtnbError:
            self.config.workers, self.config.min_workers = before
            raise
        self._resized_from = before
        return old

    def grow(self) -> str | None:
        """An elastic group below MAX grows when the cluster has room again (at a
        cell's start, never in a cell: a rebuild with the journal replayed); the
        line saying so, or None when it stays."""
        cfg, group = self.config, self.lifecycle.group
        if not cfg.elastic or group is None or group.world_size >= cfg.workers:
            return None
        if self.lifecycle.ray_lost:
            return None  # the cell says so itself
        old = group.world_size
        try:
            room = self.lifecycle.room_for_ranks(held=old)
        except Exception:  # noqa: BLE001 - no view of the cluster now: grow another time
            return None
        if room <= old:
            return None
        self.lifecycle.rebuild(
            f"elastic: the cluster has room for {min(room, cfg.workers)} ranks again",
            kind=EntryKind.SCALE,
            expect=min(room, cfg.workers),
        )
        new = self.lifecycle.world_size
        report = self.replay_onto_new_group(f"grow {old} → {new}")
        return (
            f"[rtnb] elastic group grew from {old} to {new} ranks (resources came back); {report}\n"
        )

    def scale(self, old: int) -> None:
        """Rebuild at the size :meth:`resize` set and replay the journal onto it."""
        workers = self.config.workers_text
        try:
            self.lifecycle.rebuild(f"scaling from {old} to {workers} ranks", kind=EntryKind.SCALE)
        except RtnbError:
            self.config.workers, self.config.min_workers = self._resized_from
            raise
        self.replay_onto_new_group(f"scale {old} → {self.lifecycle.world_size}")
