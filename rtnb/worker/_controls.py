"""A rank's live controls and triggers, a part of its runtime.

``rtnb.control(name, default)`` reads the value in force for the step being
computed; the driver's changes come with a step they hold from (the same on every
rank), as a schedule per control. Triggers (``rtnb.on_trigger``, ``rtnb.on_save``
and the profiler's own) are due at a step and fire in the cell thread in that
step's report, before it is recorded. A cell run again (a replay, a recovery) gets
its changes and triggers back at their steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from rtnb.core._changes import SAVE_TRIGGER
from rtnb.core._messages import RankUpdate
from rtnb.core._profile import PROFILE_START, PROFILE_STOP

__all__ = ["RankControls"]

_UNSEEN = object()


class RankControls:
    """The controls' schedules, what the cell declared and applied (for the next
    poll), and the triggers due. Handed the runtime's condition; asks only for the
    rank's step, and tells its owner through three callables: a line of output, a
    profile trigger, a saved checkpoint's conversion."""

    def __init__(
        self,
        cond: threading.Condition,
        step: Callable[[], int],
        say: Callable[[str], None],
        profile: Callable[[str, int], None],
        as_checkpoint: Callable[[Any], Any],
    ) -> None:
        self._cond = cond
        self._step = step
        self._say = say
        self._profile = profile
        self._as_checkpoint = as_checkpoint
        # Each control's schedule is (from_step, value), ascending; replaced whole on
        # a change, so value() reads it unlocked.
        self._schedules: dict[str, list[tuple[int, Any]]] = {}
        self._declared: dict[str, Any] = {}
        self._declared_new: dict[str, Any] = {}
        self._applied: list[tuple[str, Any, int]] = []
        self._seen: dict[str, Any] = {}
        self._handlers: dict[str, Callable[[], Any]] = {}
        self.due: list[tuple[int, str]] = []
        self._given: list[tuple[int, str]] = []  # the cell's request's triggers

    # ---- the cell thread ---------------------------------------------------------------
    def value(self, name: str, default: Any) -> Any:
        """``rtnb.control(name, default)``: the value in force for the step being
        computed (the last reported + 1); the first call declares the control."""
        if name not in self._declared:
            with self._cond:
                self._declared[name] = default
                self._declared_new[name] = default
        step = self._step() + 1
        value = default
        for from_step, scheduled in reversed(self._schedules.get(name, ())):
            if from_step <= step:
                value = scheduled
                break
        seen = self._seen.get(name, _UNSEEN)
        if seen is not _UNSEEN and (seen is not value and seen != value):
            with self._cond:
                self._applied.append((name, value, step))
        self._seen[name] = value
        return value

    def on_trigger(self, name: str, fn: Callable[[], Any]) -> None:
        self._handlers[name] = fn

    def fire_due(self, step: int, checkpoint: Any, replaying: bool) -> Any:
        """Run the triggers due at ``step``, before its report is recorded; a save's
        checkpoint becomes this report's (unless it has one)."""
        with self._cond:
            due = [name for at, name in self.due if at <= step]
            self.due = [(at, name) for at, name in self.due if at > step]
        for name in due:
            if name.startswith(PROFILE_START) or name == PROFILE_STOP:
                if not replaying:
                    self._profile(name, step)
                continue
            handler = self._handlers.get(name)
            if handler is None:
                saving = name == SAVE_TRIGGER
                what = "rtnb.on_save(fn)" if saving else f"rtnb.on_trigger({name!r}, fn)"
                self._say(
                    f"nothing handles {'save-now' if saving else 'trigger ' + repr(name)} "
                    f"at step {step}: register it with {what}"
                )
                continue
            result = handler()
            if name == SAVE_TRIGGER and result is not None and checkpoint is None:
                checkpoint = self._as_checkpoint(result)
        return checkpoint

    # ---- under the runtime's condition ---------------------------------------------------
    def cell_starts_locked(
        self, given: Iterable[tuple[str, Any, int]], triggers: tuple[tuple[int, str], ...]
    ) -> None:
        """A new cell starts from each control's latest value, declares its controls
        again (the live view's inputs), and gets a cell run again's changes and
        triggers back at their steps."""
        self._declared = {}
        self._schedules = {n: [(-1, s[-1][1])] for n, s in self._schedules.items() if s}
        for name, value, from_step in given:
            self._schedule_locked([(name, value)], from_step)
        self._given = list(triggers)
        self.due = list(triggers)
        self.drop_passed_locked()
        self._seen = {}

    def cell_ends_locked(self) -> None:
        self.due = []

    def release_locked(
        self, changes: dict[str, Any], from_step: int, triggers: Iterable[str]
    ) -> None:
        """``changes`` hold from ``from_step`` on (-1: at once); ``triggers`` fire in
        the report of ``from_step``."""
        self._schedule_locked(changes.items(), from_step)
        self.due.extend((from_step, name) for name in triggers)

    def due_at_locked(self, step: int, name: str) -> None:
        self.due.append((step, name))

    def drop_passed_locked(self) -> None:
        """The triggers still ahead of the rank's step (-1: at the first report): those
        behind where a cell run again goes on from fired the first time. At the cell's
        start, and when get_checkpoint() moves the step back (bringing back those
        after it)."""
        step = self._step()
        pending = dict.fromkeys(self._given + self.due)
        self.due = [(at, name) for at, name in pending if at < 0 or at > step]

    def undelivered_locked(self) -> bool:
        return bool(self._declared_new or self._applied)

    def drain_locked(self, update: RankUpdate) -> None:
        """What the cell declared and applied since the last poll, into ``update``."""
        if self._declared_new:
            update.controls_declared, self._declared_new = self._declared_new, {}
        if self._applied:
            update.controls_applied, self._applied = self._applied, []

    @property
    def declared(self) -> dict[str, Any]:
        return dict(self._declared)

    def _schedule_locked(self, changes: Iterable[tuple[str, Any]], from_step: int) -> None:
        for name, value in changes:
            schedule = [e for e in self._schedules.get(name, ()) if e[0] < from_step]
            self._schedules[name] = [*schedule, (from_step, value)]
