"""The worker group's lifecycle as an explicit state machine.

Widgets and the status display subscribe to transitions instead of polling the
session; an illegal transition is a bug in rtnb and raises at once.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["GroupState", "StateChange", "StateMachine"]


class GroupState(str, enum.Enum):
    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


_ALLOWED: dict[GroupState, set[GroupState]] = {
    GroupState.NEW: {GroupState.STARTING},
    GroupState.STARTING: {GroupState.READY, GroupState.FAILED},
    GroupState.READY: {
        GroupState.RUNNING,
        GroupState.RESTARTING,
        GroupState.STOPPING,
        GroupState.FAILED,  # the Ray under the group is gone
    },
    GroupState.RUNNING: {
        GroupState.READY,
        GroupState.RESTARTING,
        GroupState.STOPPING,
        GroupState.FAILED,
    },
    GroupState.RESTARTING: {GroupState.READY, GroupState.FAILED, GroupState.STOPPING},
    GroupState.STOPPING: {GroupState.STOPPED},
    GroupState.STOPPED: {GroupState.STARTING},
    GroupState.FAILED: {GroupState.STARTING, GroupState.RESTARTING, GroupState.STOPPING},
}


@dataclass(frozen=True)
class StateChange:
    old: GroupState
    new: GroupState
    reason: str = ""
    time: float = field(default_factory=time.time)


class StateMachine:
    def __init__(self) -> None:
        self._state = GroupState.NEW
        self._lock = threading.RLock()
        self._subscribers: list[Callable[[StateChange], None]] = []
        # The recent transitions (a long session makes thousands).
        self.history: deque[StateChange] = deque(maxlen=200)

    @property
    def state(self) -> GroupState:
        return self._state

    def subscribe(self, callback: Callable[[StateChange], None]) -> Callable[[], None]:
        """Call ``callback`` on every transition; returns a function that unsubscribes."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def to(self, new: GroupState, reason: str = "") -> StateChange:
        with self._lock:
            old = self._state
            if new not in _ALLOWED[old]:
                raise RuntimeError(f"rtnb internal error: illegal state change {old} -> {new}")
            self._state = new
            change = StateChange(old, new, reason)
            self.history.append(change)
        for callback in list(self._subscribers):
            try:
                callback(change)
            except Exception:  # noqa: BLE001 - a broken view must not break the session
                pass
        return change
