"""What a failed cell does next, carried out: the controller's recovery.

:class:`Recovery` is the only holder of the session's :class:`FailurePolicy`: a dead
rank, a stop that did not end or a cell's own error is decided there once (a
notebook cell keeps its error, a sweep's trial runs again, a ``Shrink`` names the
size to rebuild at). It carries the decision out through the narrow
:class:`Rebuilder` the controller gives it — a rebuild, the journal's replay, the
state machine — so the controller stays the one owner of the group.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from rtnb.core._config import SessionConfig
from rtnb.driver.lifecycle import (
    DURING_REBUILD,
    Decision,
    Failure,
    FailurePolicy,
    GroupState,
    Raise,
    RankDied,
    RecoveryOutcome,
    ReplayReport,
    Shrink,
    StateMachine,
)
from rtnb.driver.ranks import RankLost
from rtnb.errors import CellInterrupted, RtnbError, WorkerGroupError, one_line
from rtnb.storage._checkpoints import CheckpointStore

__all__ = ["Rebuilder", "Recovery"]


class Rebuilder(Protocol):
    """What a recovery needs of the controller."""

    state_machine: StateMachine
    checkpoints: CheckpointStore
    size_reason: str | None

    @property
    def config(self) -> SessionConfig: ...

    @property
    def world_size(self) -> int: ...

    @property
    def ray_lost(self) -> str | None: ...

    def rebuild(
        self, reason: str, config: SessionConfig, *, fresh: bool = False, lost: int = 0
    ) -> None: ...

    def adopt(self, config: SessionConfig) -> None: ...

    def ready_again(self, why: str) -> None: ...

    def replay_journal(self, before: int | None = None) -> ReplayReport: ...

    def continue_step_count(self) -> None: ...


class Recovery:
    """The failure policy's decisions, carried out; see the module docstring."""

    def __init__(self, owner: Rebuilder, policy: FailurePolicy) -> None:
        self._owner = owner
        self._policy = policy
        self.last: RecoveryOutcome | None = None

    @property
    def failures(self) -> int:
        """Recoveries spent on the failure policy's budget so far."""
        return self._policy.failures

    def attempt(self) -> str | None:
        """The recovery under way as the user reads it ("recovery 1 of 3"), once one
        was decided."""
        return self._policy.describe() if self._policy.failures else None

    def can_recover(self) -> bool:
        """Whether the policy's budget allows another recovery."""
        return self._policy.can_recover()

    def reset(self) -> None:
        self._policy.reset()

    def recover(self, failure: Failure, before: int | None) -> RecoveryOutcome:
        """What a failed cell does next: run again on a rebuilt group with the journal
        replayed up to it (entry ``before``), or end with an error. A rank that dies
        during the rebuild or replay is another failure, decided again."""
        owner = self._owner
        while True:
            failure = dataclasses.replace(failure, world_size=owner.world_size)
            decision = self._policy.decide(failure)
            if isinstance(decision, Raise) and not failure.dead and failure.error is not None:
                return RecoveryOutcome(decision, keep_error=True)  # the group is sound
            if owner.state_machine.state is not GroupState.RECOVERING:
                why = failure.summary if failure.dead else failure.cell
                owner.state_machine.to(GroupState.RECOVERING, why)
            if isinstance(decision, Raise):
                return self._give_up(failure, decision)
            outcome = self._rebuild_and_replay(failure, decision, before)
            if isinstance(outcome, RecoveryOutcome):
                return outcome
            failure = outcome

    def _rebuild_and_replay(
        self, failure: Failure, decision: Decision, before: int | None
    ) -> RecoveryOutcome | Failure:
        owner = self._owner
        # A policy that shrinks: the size is the rebuild's argument; the options
        # change only once the smaller group runs.
        config = (
            owner.config.resized(decision.workers) if isinstance(decision, Shrink) else owner.config
        )
        try:
            owner.rebuild(
                f"{failure.summary} ({decision.attempt})",
                config,
                lost=sum(1 for rank in failure.dead if rank >= 0),
            )
            owner.adopt(config)
            # Files a dead rank left half-written never got a manifest: drop them.
            owner.checkpoints.drop_pending()
            owner.checkpoints.cleanup_incomplete()
            report = owner.replay_journal(before)
            owner.continue_step_count()
            self.last = RecoveryOutcome(
                decision,
                report,
                failure_summary=failure.summary,
                world_size=owner.world_size,
                resized=owner.size_reason if owner.world_size < failure.world_size else None,
            )
            owner.state_machine.to(GroupState.RUNNING, f"recovered: {failure.summary}")
            return self.last
        except (RankLost, WorkerGroupError, RankDied) as exc:
            if owner.state_machine.state is GroupState.FAILED:
                owner.state_machine.to(GroupState.RECOVERING, "retrying after a failed rebuild")
            what = "a rank died during replay" if isinstance(exc, RankDied) else one_line(exc)
            return Failure(failure.cell, {DURING_REBUILD: what})
        except RtnbError as exc:
            if owner.ray_lost:
                return RecoveryOutcome(decision, ray_lost=True)
            return RecoveryOutcome(
                decision,
                error=WorkerGroupError(f"{failure.summary}; recovery failed: {exc}"),
            )

    def _give_up(self, failure: Failure, decision: Raise) -> RecoveryOutcome:
        """No retry: fresh ranks (the dead or stuck ones cannot be reused) and the
        cell's error saying that its variables are gone."""
        owner = self._owner
        if failure.dead:
            what = failure.summary + decision.why
        else:
            stuck = failure.stuck
            what = (
                f"{failure.cell} {failure.stop_reason}, but rank{'s' if len(stuck) > 1 else ''} "
                f"{', '.join(map(str, stuck))} did not stop within "
                f"{2 * owner.config.stop_grace_s:g} s (blocked in a collective or in native code)"
            )
        try:
            owner.rebuild(what, owner.config, fresh=True)
            owner.ready_again("rebuilt with fresh ranks")
            tail = "the worker group was rebuilt with fresh ranks; variables defined on the ranks are gone"
        except RtnbError as exc:
            if owner.ray_lost:
                return RecoveryOutcome(decision, ray_lost=True)
            tail = f"rebuilding the worker group failed: {exc}"
        message = f"{what}; {tail}"
        error = WorkerGroupError(message) if failure.dead else CellInterrupted(message, kept=False)
        return RecoveryOutcome(decision, error=error)
