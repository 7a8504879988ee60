"""Stopping a cell on every rank: the phases of :class:`~rtnb.core._messages.StopPhase`.

Stopping (interrupt, timeout, ``handle.stop()``, a storage failure) follows the
design's stop contract:

1. cooperative: every rank pauses at its next ``report()``; once all have paused
   they leave together at the same step, so none is left inside a collective;
2. after ``stop_grace_s``: CellStopped is raised inside each rank's cell thread
   (reaches pure-Python loops);
3. after another ``stop_grace_s``: the group must be rebuilt (ranks blocked in C++,
   e.g. a collective whose peer has left, cannot be interrupted any other way).

A *final* stop (the group itself is going away: stop, restart, scale) skips phase 2
and 3: after the cooperative grace the cell ends and the caller removes the group,
exactly once. :class:`StopProtocol` keeps the phase and decides; on every tick the
cell's :class:`~rtnb.driver.ranks._execution.Execution` asks it to
:meth:`~StopProtocol.advance` and sends the ranks what the :class:`StopAction` says
(this module calls no rank).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from rtnb.core._messages import RankUpdate, StopPhase

__all__ = ["StopAction", "StopProtocol"]

# When some ranks have paused for a stop while others still run, give the others
# this long to reach a report() before choosing a later common stop step.
PAUSE_SKEW_S = 0.5


@dataclass(frozen=True)
class StopAction:
    """What a tick of a stop sends the unfinished ranks."""

    pause: bool = False  # pause at the next report() (the cooperative phase begins)
    target: int | None = None  # leave together at this step (chosen once)
    interrupt: bool = False  # raise CellStopped inside the cell
    rebuild: bool = False  # the grace is over: rebuild the group (or, final, leave it)


class StopProtocol:
    """One cell's stop: why, which phase, and the step every rank stops at."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.reason: str | None = None  # None: no stop asked
        self.phase = StopPhase.NONE
        self.final = False  # the group goes away after the cell
        self.target: int | None = None  # the common stop step, once chosen
        self._phase_started = 0.0
        self._first_pause_at: float | None = None
        self._interrupt_sent = False
        self._lock = threading.Lock()

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def timed_out(self, elapsed_s: float, timeout_s: float | None) -> bool:
        """The cell ran past its ``--timeout`` and no stop is under way."""
        return timeout_s is not None and self.reason is None and elapsed_s > timeout_s

    def request(self, reason: str, final: bool = False) -> None:
        """Ask for a stop (any thread); a second request escalates one phase."""
        with self._lock:
            if final:
                self.final = True
            if self.reason is None:
                self.reason = reason
                self.phase = StopPhase.REQUESTED
            elif self.phase is StopPhase.COOPERATIVE:
                self._enter(StopPhase.RAISE)
            elif self.phase is StopPhase.RAISE:
                self._enter(StopPhase.RESTART)

    def _enter(self, phase: StopPhase) -> None:
        self.phase = phase
        self._phase_started = time.monotonic()

    def advance(
        self,
        unfinished: list[int],
        last: Mapping[int, RankUpdate],
        steps: Mapping[int, int],
    ) -> StopAction:
        """What the phase calls for now, for the ``unfinished`` ranks; the phase moves
        on when its grace is over."""
        phase = self.phase
        if phase is StopPhase.NONE:
            return StopAction()
        waited = time.monotonic() - self._phase_started
        pause, target, interrupt = False, None, False
        if phase is StopPhase.REQUESTED:
            pause = True
            self._enter(StopPhase.COOPERATIVE)
        elif phase is StopPhase.COOPERATIVE:
            target = self._choose_target(unfinished, last, steps)
            if waited > self.grace_s:
                self._enter(StopPhase.RESTART if self.final else StopPhase.RAISE)
        elif phase is StopPhase.RAISE:
            if not self._interrupt_sent:
                self._interrupt_sent = interrupt = True
            if waited > self.grace_s:
                self._enter(StopPhase.RESTART)
        return StopAction(pause, target, interrupt, self.phase is StopPhase.RESTART)

    def _choose_target(
        self,
        unfinished: list[int],
        last: Mapping[int, RankUpdate],
        steps: Mapping[int, int],
    ) -> int | None:
        """Once every rank paused, the latest pause step; if some still run after
        PAUSE_SKEW_S, one step past the furthest. Returned once, to send every rank."""
        paused = {
            r: last[r].paused_at for r in unfinished if r in last and last[r].paused_at is not None
        }
        if paused and self._first_pause_at is None:
            self._first_pause_at = time.monotonic()
        target = None
        if unfinished and len(paused) == len(unfinished):
            target = max(paused.values())
        elif paused and time.monotonic() - self._first_pause_at > PAUSE_SKEW_S:
            target = max(steps[r] for r in unfinished) + 1
        if target is None or self.target is not None:
            return None
        self.target = target
        return target
