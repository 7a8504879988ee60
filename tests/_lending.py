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
from rtnb.driver.tuning._pool import GroupPool

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
    """The suite's lender of healthy groups (see the module's docstring): the
    product's own sweep pool (``GroupPool``, which renews a group it gets back and
    shuts down one given back unclean or whose renewal fails) for one shape of ranks
    at a time."""

    def __init__(self) -> None:
        self.started = 0  # groups the borrowers started
        self.lent_again = 0  # starts saved
        self._pool: GroupPool | None = None
        self._shape: tuple[Any, ...] = ()
        self._lock = threading.Lock()

    def lend(self, config: SessionConfig, run_name: str, storage_path: str) -> WorkerGroup:
        """A session's ``group_factory``: the idle group renewed for this run when its
        ranks have this config's shape, else a new group the session starts."""
        shape = _ranks_shape(config)
        with self._lock:
            if self._pool is not None and self._shape != shape:
                self._close_locked()  # its CPUs go to the new group
            if self._pool is None:
                self._pool, self._shape = GroupPool(config, capacity=1), shape
            pool = self._pool
        group = pool.factory(config, run_name, storage_path)
        group.config = config  # the pool's config is the first borrower's
        return group

    def close_idle(self) -> None:
        """Shut the idle group down (its CPUs are free when this returns); only
        between tests, when no group is lent."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._pool is None:
            return
        self.started += self._pool.started
        self.lent_again += self._pool.lent - self._pool.started
        self._pool.close()
        self._pool = None
