"""The worker groups of a sweep, lent to one trial at a time."""

from __future__ import annotations

import threading
from typing import Any

from rtnb.core._config import SessionConfig
from rtnb.driver._group import RankGroup, WorkerGroup
from rtnb.driver._startup import StartProgress
from rtnb.errors import (
    ClusterError,
)

__all__ = ["GroupPool", "LentGroup"]


# ---- the groups trials run on ------------------------------------------------------------
class GroupPool:
    """The worker groups of a sweep, lent to one trial at a time.

    A finished trial's group goes back here and is lent to the next trial with its
    ranks renewed for that trial's run (a fresh namespace, the same processes and
    process group). At most ``capacity`` groups exist at once; a group a trial gave
    back unclean (a rank died, the cell could not stop) is shut down, not lent."""

    def __init__(self, config: SessionConfig, capacity: int) -> None:
        self.config = config
        self.capacity = capacity
        self.started = 0  # groups started (each paid a group's start)
        self.lent = 0  # trials that got a group
        self._idle: list[WorkerGroup] = []
        self._live: list[WorkerGroup] = []
        self._lock = threading.Lock()
        self._closed = False

    def factory(self, config: SessionConfig, run_name: str, storage_path: str) -> RankGroup:
        """A trial :class:`Session`'s ``group_factory``."""
        return LentGroup(self, run_name, storage_path)

    def take(self, run_name: str, storage_path: str, progress: StartProgress | None) -> WorkerGroup:
        while True:
            with self._lock:
                if self._closed:
                    raise ClusterError("the sweep is over: its groups are shut down")
                group = self._idle.pop() if self._idle else None
            if group is None:
                break
            try:
                group.gather(group.renew(run_name, storage_path), 60)
            except Exception:  # noqa: BLE001 - a rank died while idle: start another
                self._discard(group)
                continue
            with self._lock:
                self.lent += 1
            return group
        group = WorkerGroup(self.config, run_name, storage_path)
        group.start(progress)
        with self._lock:
            self._live.append(group)
            self.started += 1
            self.lent += 1
            closed = self._closed
        if closed:  # the sweep ended while this group started
            self._discard(group)
            raise ClusterError("the sweep is over: its groups are shut down")
        return group

    def give_back(self, group: WorkerGroup, clean: bool) -> None:
        with self._lock:
            keep = clean and not self._closed and group in self._live
            if keep:
                self._idle.append(group)
        if not keep:
            self._discard(group)

    def _discard(self, group: WorkerGroup) -> None:
        with self._lock:
            if group in self._live:
                self._live.remove(group)
            if group in self._idle:
                self._idle.remove(group)
        group.shutdown(graceful=False, timeout_s=2.0)

    def close(self) -> None:
        """Shut every group down (their CPUs are free when this returns)."""
        with self._lock:
            self._closed = True
            groups, self._live, self._idle = list(self._live), [], []
        for group in groups:
            group.shutdown(graceful=False, timeout_s=2.0)


class LentGroup:
    """A :class:`RankGroup` lent by a :class:`GroupPool` to one trial's session: its
    start takes a group from the pool, its shutdown gives it back (a graceful one
    only: after a failure the group is shut down)."""

    def __init__(self, pool: GroupPool, run_name: str, storage_path: str) -> None:
        self._pool = pool
        self._run_name = run_name
        self._storage_path = storage_path
        self._group: WorkerGroup | None = None
        self._sound = True

    def start(self, progress: StartProgress | None = None) -> None:
        self._group = self._pool.take(self._run_name, self._storage_path, progress)

    def discard_on_return(self) -> None:
        """Its trial failed: whatever the session's stop says, the group is shut down
        (a broken process group, a CUDA error, must not reach the next trial)."""
        self._sound = False

    def shutdown(self, graceful: bool = True, timeout_s: float = 5.0) -> None:
        group, self._group = self._group, None
        if group is not None:
            self._pool.give_back(group, clean=graceful and self._sound)

    def __getattr__(self, name: str) -> Any:
        # The rank protocol, the ranks and the size are the lent group's.
        group = self.__dict__.get("_group")
        if group is None:
            raise AttributeError(name)
        return getattr(group, name)
