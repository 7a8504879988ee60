"""The worker groups of a sweep, lent to one trial at a time."""

from __future__ import annotations

import threading

from rtnb.core._config import SessionConfig
from rtnb.driver.ranks import WorkerGroup
from rtnb.errors import ClusterError

__all__ = ["GroupPool"]


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

    def factory(self, config: SessionConfig, run_name: str, storage_path: str) -> WorkerGroup:
        """A trial :class:`Session`'s ``group_factory``: an idle group, its ranks renewed
        for the trial's run, else a new one the session starts. Either is lent: the
        session's stop gives it back here."""
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
            group.lender = self
            return group
        return WorkerGroup(self.config, run_name, storage_path, lender=self)

    def adopt(self, group: WorkerGroup) -> bool:
        """A new group has started for its trial: it is the pool's from now on."""
        with self._lock:
            if self._closed:  # the sweep ended while it started
                return False
            self._live.append(group)
            self.started += 1
            self.lent += 1
            return True

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
