"""The group a session holds, as its readers reach it: :class:`GroupHolding`.

The cell flow, a recovery, the status and the session ask for the running group
(waiting while it is made or replaced), its size and state, and whether the Ray
under it is gone; only the :class:`~rtnb.driver.control._controller.Controller`,
which extends this, makes, replaces and removes the group. Keeping the two apart
keeps the controller to its transitions.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from rtnb.core._config import SessionConfig
from rtnb.driver.cluster import ClusterConnection
from rtnb.driver.lifecycle import BUSY, GroupState, StateChange, StateMachine
from rtnb.driver.ranks import GroupBuilder, RankGroup, ray_lost_line
from rtnb.errors import ClusterError, SessionError

__all__ = ["GroupHolding"]


class GroupHolding:
    """The group, its options and state, and the way to it; see the module docstring."""

    _builder: GroupBuilder  # the controller's: it connects, builds and watches Ray

    def __init__(
        self, config: SessionConfig, run_name: str, latest_checkpoint: Callable[[], str | None]
    ) -> None:
        self._config = config
        self.run_name = run_name
        self._latest_checkpoint = latest_checkpoint
        self.state_machine = StateMachine()
        self.group: RankGroup | None = None
        # Why the group has its size, when elastic ("elastic 2-4: 3 ranks (...)").
        self.size_reason: str | None = None
        self._ready = threading.Event()
        self.state_machine.subscribe(self._track_ready)
        self._lost: str | None = None  # set once the Ray under the group is gone
        self._replaying: int | None = None  # the thread replaying onto a new group

    @property
    def config(self) -> SessionConfig:
        """The options in force (a scale swaps in a resized copy)."""
        return self._config

    @property
    def state(self) -> GroupState:
        return self.state_machine.state

    @property
    def connection(self) -> ClusterConnection | None:
        return self._builder.connection

    @property
    def world_size(self) -> int:
        """The running group's ranks (an elastic group's current size), else the
        configured size."""
        group = self.group
        return group.world_size if group is not None else self._config.world_size

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    def _track_ready(self, change: StateChange) -> None:
        if change.new in (GroupState.READY, GroupState.RUNNING):
            self._ready.set()
        else:
            self._ready.clear()

    def require_group(
        self, wait_s: float = 0.0, state_text: Callable[[], str] | None = None
    ) -> RankGroup:
        """The running group. While it is being made or replaced (start, recovery,
        scale, restart), wait up to ``wait_s`` for it, then say so (in
        ``state_text()``'s words, only then asked); never "no worker group"."""
        if self._lost is not None:
            raise ClusterError(self._lost)
        group = self.group
        if group is not None and self._replaying == threading.get_ident():
            return group  # the replay that makes the new group ready runs on it
        if self.state in BUSY:
            self._ready.wait(wait_s)
        group, state = self.group, self.state
        if group is not None and state in (GroupState.READY, GroupState.RUNNING):
            return group
        if state in BUSY:
            raise SessionError(
                f"the worker group is {state_text() if state_text else state}; "
                "try again once it is ready (`%rtnb status`)"
            )
        raise SessionError(
            "no worker group is running: start one with `%rtnb start` (or Session.start())"
        )

    def check_fits(self, config: SessionConfig) -> None:
        """Raises a SessionError when ``config``'s group cannot fit the cluster."""
        self._builder.check_fits(config)

    def replacement(
        self, lost: RankGroup, coming: Callable[[], bool], timeout_s: float
    ) -> RankGroup | None:
        """The group a recovery builds to replace ``lost``, once ready; None when
        ``coming()`` says none is coming any more, or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            group = self.group
            if group is not None and group is not lost and self.is_ready:
                return group
            if not coming() and self.group is lost:
                return None
            time.sleep(0.05)
        return None

    # ---- the Ray under the group going away -------------------------------------------------
    @property
    def ray_lost(self) -> str | None:
        """One line on the Ray this session used being gone, once it is: no Ray call
        is made after that (each would wait on a GCS that never answers)."""
        return self._lost

    def check_ray_lost(self, settle_s: float = 0.0) -> str | None:
        """As :attr:`ray_lost`, asking the cluster now (before a rebuild, or on a Ray
        error that a GCS going away causes)."""
        if self._lost is None:
            self._builder.check_lost(settle_s)
        return self._lost

    def _ray_went_away(self, why: str) -> None:
        latest = None
        with contextlib.suppress(Exception):
            latest = self._latest_checkpoint()
        connection = self._builder.connection
        own_driver = connection is not None and not connection.driver_outlives_ray
        self._lost = ray_lost_line(why, self.run_name, latest, own_driver)
        self.group = None
        with contextlib.suppress(RuntimeError):  # already stopping or stopped
            self.state_machine.to(GroupState.FAILED, self._lost)
