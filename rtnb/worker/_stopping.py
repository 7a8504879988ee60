"""A rank's side of a stop and of a live change, a part of its runtime.

Both take effect at a ``report()`` boundary. A stop pauses the rank there until the
driver names the step every rank leaves at, so no rank leaves while a peer still
waits for it inside a collective (docs/architecture.md, "Stopping a cell"); a live
change holds it there until the driver says from which step the change holds, so
every rank takes it at the same step. Under the runtime's condition throughout.
"""

from __future__ import annotations

import threading

__all__ = ["CellStopped", "RankStop"]


class CellStopped(KeyboardInterrupt):
    """Raised inside a rank's cell when the user interrupts it.

    It subclasses KeyboardInterrupt so ``except Exception`` in user code does not
    swallow it and ``except KeyboardInterrupt`` cleanup code still runs.
    """


class RankStop:
    """What a stop or a hold asked of this rank's running cell, and the wait at the
    boundary where it takes effect. Every method but the properties is called with
    the condition held."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self.wanted = False  # a stop was asked for
        self.target: int | None = None  # the step every rank leaves at (-1: at once)
        self.paused_at: int | None = None  # the step this rank waits at for the target
        self._pause_reported = False
        self._holding = False  # held for a live change until released
        self._released = 0  # the last live-change number released (see hold_locked)

    @property
    def pending(self) -> bool:
        """Work waits at the next report: a stop or a hold."""
        return self.wanted or self._holding

    @property
    def pause_unreported(self) -> bool:
        """The rank paused for the stop and no poll has said so yet."""
        return self.paused_at is not None and not self._pause_reported

    def reset_locked(self) -> None:
        """Nothing asked: a cell starts or ended."""
        self.wanted = False
        self.target = None
        self.paused_at = None
        self._holding = False

    def pause_taken_locked(self) -> None:
        """A poll carries the pause to the driver."""
        if self.paused_at is not None:
            self._pause_reported = True

    def want_locked(self) -> None:
        """Stop at the next boundary; a live change's hold still ends first (a failed
        checkpoint write asks this way)."""
        self.wanted = True

    def request_locked(self) -> None:
        """The driver's stop: it also ends a hold for a live change."""
        self.wanted = True
        self._holding = False

    def interrupt_locked(self) -> None:
        """The stop's raising phase: a rank paused at a boundary leaves at once."""
        self.request_locked()
        self.target = -1

    def set_target_locked(self, step: int) -> None:
        if self.wanted:
            self.target = step

    def hold_locked(self, change: int) -> bool:
        """Hold at the next report for live change ``change``; False when a stop is
        under way or that change was released already (its calls can reach the actor
        out of order)."""
        if self.wanted or (change and change <= self._released):
            return False
        self._holding = True
        return True

    def release_locked(self, change: int) -> None:
        self._released = max(self._released, change)
        self._holding = False

    def at_boundary_locked(self, step: int) -> bool:
        """At a report of ``step`` with work waiting (the cell thread): wait out a
        hold; then, for a stop, pause until the driver names the common step and
        raise :class:`CellStopped` once there. False when no stop is in force."""
        while self._holding:
            # Not a stop's pause: paused_at (the common step is chosen from it) stays
            # unset; a stop that comes ends the hold.
            self._cond.wait(0.05)
        if not self.wanted:
            return False
        if self.target is None:
            self.paused_at = step
            self._pause_reported = False
            self._cond.notify_all()
            while self.wanted and self.target is None:
                self._cond.wait(0.05)
            self.paused_at = None
        if self.wanted and self.target is not None and step >= self.target:
            raise CellStopped(f"stopped at step {step}")
        return True
