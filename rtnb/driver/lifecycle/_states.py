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

__all__ = ["ACTIVE", "BUSY", "GroupState", "StateChange", "StateMachine"]


class GroupState(str, enum.Enum):
    NEW = "new"
    STARTING = "starting"
    READY = "ready"  # idle: a group, no cell running
    RUNNING = "running"
    RECOVERING = "recovering"  # a failed cell's group rebuilt, the journal replayed
    RESIZING = "resizing"  # scale, or an elastic group growing back
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


# The controller's transitions (``control/_controller.py``): these are all it may make.
_ALLOWED: dict[GroupState, set[GroupState]] = {
    GroupState.NEW: {GroupState.STARTING},
    GroupState.STARTING: {GroupState.READY, GroupState.FAILED},
    GroupState.READY: {
        GroupState.RUNNING,
        GroupState.RESTARTING,
        GroupState.RESIZING,
        GroupState.STOPPING,
        GroupState.FAILED,  # the Ray under the group is gone
    },
    GroupState.RUNNING: {
        GroupState.READY,
        GroupState.RECOVERING,
        GroupState.RESTARTING,
        GroupState.RESIZING,  # scale with a cell that would not stop
        GroupState.STOPPING,
        GroupState.FAILED,
    },
    # RUNNING again: the failed cell runs on the rebuilt group; READY: the policy
    # gave up and the group was rebuilt with fresh ranks.
    GroupState.RECOVERING: {
        GroupState.RUNNING,
        GroupState.READY,
        GroupState.FAILED,
        GroupState.STOPPING,
    },
    GroupState.RESIZING: {GroupState.READY, GroupState.FAILED, GroupState.STOPPING},
    GroupState.RESTARTING: {GroupState.READY, GroupState.FAILED, GroupState.STOPPING},
    GroupState.STOPPING: {GroupState.STOPPED},
    GroupState.STOPPED: {GroupState.STARTING},
    GroupState.FAILED: {
        GroupState.STARTING,
        GroupState.RESTARTING,
        GroupState.RECOVERING,  # a recovery's rebuild failed: the policy may retry
        GroupState.RESIZING,
        GroupState.STOPPING,
    },
}

# A group exists or is being made: a second start is refused.
ACTIVE = frozenset(
    {
        GroupState.STARTING,
        GroupState.READY,
        GroupState.RUNNING,
        GroupState.RECOVERING,
        GroupState.RESIZING,
        GroupState.RESTARTING,
    }
)
# The group is being made or replaced: its callers wait for it.
BUSY = frozenset(
    {GroupState.STARTING, GroupState.RECOVERING, GroupState.RESIZING, GroupState.RESTARTING}
)


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
