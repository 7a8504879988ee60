"""Started worker groups lent from one test to the next, as a sweep lends its groups
to its trials: a test that needs only a fresh run on healthy ranks passes
``group_factory=lend`` to its :class:`rtnb.Session` and gets the group the last such
test gave back, its ranks renewed for the new run (fresh namespaces, the same
processes and process group), instead of paying a group's start (~6 core-seconds of
Ray workers and ``import torch`` on this 2-core machine).

A group comes back to the pool only whole: one given back unclean (a rank died, the
cell could not stop) or whose renewal fails is shut down, so no broken process group
reaches the next test. At most one group waits idle, and it is shut down before any
test that does not borrow runs, so every other test sees the cluster's CPUs as a
fresh suite would."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from rtnb.core._config import SessionConfig
from rtnb.driver.ranks import WorkerGroup

# What the ranks were started with: a group is lent only to a run whose config agrees
# on all of these (the rest, e.g. checkpoint retention, is the driver's alone).
_RANK_FIELDS = (
    "workers",
    "min_workers",
    "gpu",
    "cpus_per_worker",
    "strategy",
    "address",
    "backend",
    "env",
    "files",
    "excludes",
    "includes",
    "allow_local_storage",
)


def _ranks_shape(config: SessionConfig) -> tuple[Any, ...]:
    shape = dataclasses.asdict(config)
    return tuple(
        tuple(sorted(shape[name].items())) if name == "env" else shape[name]
        for name in _RANK_FIELDS
    )


class GroupLoans:
    """The suite's lender of healthy groups (see the module's docstring); implements
    the group's lender protocol (``adopt``, ``give_back``)."""

    def __init__(self) -> None:
        self.started = 0  # groups this pool's borrowers started
        self.lent_again = 0  # starts saved
        self._idle: WorkerGroup | None = None
        self._lock = threading.Lock()

    def lend(self, config: SessionConfig, run_name: str, storage_path: str) -> WorkerGroup:
        """A session's ``group_factory``: the idle group renewed for this run when its
        ranks have this config's shape, else a new group the session starts."""
        with self._lock:
            group, self._idle = self._idle, None
        if group is not None:
            if _ranks_shape(group.config) == _ranks_shape(config):
                try:
                    group.gather(group.renew(run_name, storage_path), 60)
                except Exception:  # noqa: BLE001 - a rank died while idle: start anew
                    group.shutdown(graceful=False, timeout_s=2.0)
                else:
                    group.config, group.lender = config, self
                    self.lent_again += 1
                    return group
            else:  # its CPUs go to the new group
                group.shutdown(graceful=False, timeout_s=2.0)
        return WorkerGroup(config, run_name, storage_path, lender=self)

    def adopt(self, group: WorkerGroup) -> bool:
        with self._lock:
            self.started += 1
        return True

    def give_back(self, group: WorkerGroup, clean: bool) -> None:
        # The group's lender is already cleared: shutdown() here frees it for good.
        if not clean:
            group.shutdown(graceful=False, timeout_s=2.0)
            return
        with self._lock:
            older, self._idle = self._idle, group
        if older is not None:
            older.shutdown(graceful=False, timeout_s=2.0)

    def close_idle(self) -> None:
        """Shut the idle group down (its CPUs are free when this returns)."""
        with self._lock:
            group, self._idle = self._idle, None
        if group is not None:
            group.shutdown(graceful=False, timeout_s=5.0)
