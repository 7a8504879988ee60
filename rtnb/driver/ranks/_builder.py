"""Where a group's ranks come from: the Ray they need, and groups placed on it.

:class:`GroupBuilder` owns the session's cluster connection and makes started groups
of the size a config asks for (an elastic one as large as its :class:`ScalingPolicy`
says the cluster places). It holds no group and no state: the controller
(``control/_controller.py``) decides when a group is made, replaced or removed, and hears
from the builder's watch when the Ray under it goes away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable

from rtnb.core._config import SessionConfig
from rtnb.core._redact import redact_uri
from rtnb.driver.cluster import (
    ClusterConnection,
    StartProgress,
    check_cluster_versions,
    rank_cpus,
    warm_ray_wanted,
    will_embed,
)
from rtnb.driver.lifecycle import ScalingPolicy
from rtnb.driver.ranks._group import RankGroup, WorkerGroup, check_capacity
from rtnb.driver.ranks._local import LocalGroup
from rtnb.errors import ClusterError, WorkerGroupError

__all__ = ["GroupBuilder", "new_group", "ray_lost_line"]

GroupFactory = Callable[[SessionConfig, str, str], RankGroup]
Connector = Callable[..., ClusterConnection]


def new_group(config: SessionConfig, run_name: str, storage_path: str) -> RankGroup:
    """The group ``config`` asks for: ranks on Ray, or local mode's one in this kernel."""
    if config.local:
        return LocalGroup(config, run_name, storage_path)
    return WorkerGroup(config, run_name, storage_path)


def ray_lost_line(why: str, run_name: str, latest: str | None, users_driver: bool) -> str:
    """The one line a session says once the Ray under its group is gone: what went
    with it, the run's latest checkpoint and how to carry on; ``users_driver``: the
    kernel's Ray driver came from the user's own ``ray.init()``."""
    kept = (
        f"the run's latest checkpoint is {latest}"
        if latest
        else "no checkpoint of this run was committed"
    )
    line = (
        f"{why}: the ranks and their variables went with it; {kept}. "
        f"`%rtnb start --name {run_name} --replay` starts a fresh Ray and "
        "rebuilds the ranks from the run's journal"
    )
    if users_driver:
        # The watch shut that driver down too (long before Ray's own 60 s rule would
        # have ended the kernel with it): the user's Ray objects are gone with it.
        line += (
            ". The Ray connection this kernel's own ray.init() made before "
            "`%rtnb start` is closed too (the kernel lives on): the new start "
            "connects it again"
        )
    return line


@dataclasses.dataclass(frozen=True)
class BuiltGroup:
    group: RankGroup
    # Why an elastic group has its size ("elastic 2-4: 3 ranks (...)"); None: fixed.
    size_reason: str | None = None


class GroupBuilder:
    """Connects and places groups for one run; see the module docstring."""

    def __init__(
        self,
        run_name: str,
        scaling: ScalingPolicy,
        *,
        group_factory: GroupFactory,
        connector: Connector,
        at_exit: Callable[[], None],
        on_ray_lost: Callable[[str], None],
    ) -> None:
        self.run_name = run_name
        self.scaling = scaling
        self.connection: ClusterConnection | None = None
        self._group_factory = group_factory
        self._connector = connector
        self._at_exit = at_exit
        self._on_ray_lost = on_ray_lost

    # ---- the Ray the ranks need -----------------------------------------------------------
    def connect(self, config: SessionConfig, steps: StartProgress) -> None:
        """Join (or start) the Ray the group's ranks need; local mode needs none."""
        if self.connection is not None or config.local:
            return
        self.check_fits(config)
        with steps.phase("Ray", self._connect_doing(config)):
            self.connection = self._connector(
                config.address,
                timeout_s=config.connect_timeout_s,
                listen=config.listen,
                need_cpus=config.workers * config.cpus_per_worker,
                ranks=config.workers,
                progress=lambda text: steps.say(f"rtnb: {text}…"),
            )
        steps.report.joined = self.connection.joined_as
        self._at_exit()
        if self.connection.watch is not None:
            self.connection.watch.subscribe(self._on_ray_lost)
        if not self.connection.owned:
            # A cluster someone else started: its nodes may run other versions (each
            # node asked once per process, a task of no CPU: about a second).
            check_cluster_versions()

    def check_fits(self, config: SessionConfig) -> None:
        """One line when a group of ``config``'s size cannot be placed: against the
        cluster once connected, else against this machine for an embedded Ray
        (known before Ray starts, ~10 s); local mode always fits."""
        if config.local:
            return
        if config.elastic:  # fits when MIN does
            config = dataclasses.replace(config, workers=config.min_workers, min_workers=None)
        if self.connection is not None:
            check_capacity(config)
        elif will_embed(config.address) and not config.gpu:
            check_capacity(config, {"CPU": os.cpu_count() or 1}, "this machine")

    def check_lost(self, settle_s: float = 0.0) -> None:
        """Ask the cluster now whether its Ray is gone (a lost one reaches the
        ``on_ray_lost`` callback through the watch); ``settle_s``: how long a shut
        GCS port must stay shut to count."""
        if self.connection is not None:
            self.connection.check_lost(settle_s)

    def connect_and_build(self, config: SessionConfig, steps: StartProgress) -> BuiltGroup:
        """Join the Ray and build the group; when its ranks died because that Ray was
        going away (a start straight after a Ray was lost, before its GCS closed),
        once more on the Ray that is up now."""
        self.connect(config, steps)
        try:
            return self.build(config, steps)
        except WorkerGroupError:
            if not self.forget_if_lost():
                raise
        self.connect(config, steps)
        return self.build(config, steps)

    def forget_if_lost(self, settle_s: float = 2.5) -> bool:
        """After a group failed to start: whether the Ray joined for it is gone (lost
        a moment before this start: its GCS still answered when it was joined). Then
        the builder lets go of it without telling the session, which ran no group on
        it, so that the next ``connect`` joins or starts the Ray that is up now."""
        connection = self.connection
        if connection is None or connection.watch is None:
            return False
        connection.watch.unsubscribe(self._on_ray_lost)
        if connection.check_lost(settle_s) is None:
            connection.watch.subscribe(self._on_ray_lost)
            return False
        self.connection = None
        with contextlib.suppress(Exception):  # the driver is being let go of already
            connection.shutdown()
        return True

    def drop_connection(self) -> None:
        """After a failed start: stop the embedded Ray this builder started, and let
        go of a cluster it joined (the process stays joined to it, unused, so that a
        start naming another ``--address`` may leave it)."""
        connection, self.connection = self.connection, None
        if connection is not None:
            try:
                connection.shutdown()
            except Exception:  # noqa: BLE001 - already failing; the first error is the news
                pass

    def close(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.shutdown()

    def _connect_doing(self, config: SessionConfig) -> str:
        if will_embed(config.address) and warm_ray_wanted(config.listen):
            return "looking for the warm Ray"
        if will_embed(config.address):
            return f"starting an embedded Ray (listening on {config.listen or '127.0.0.1'})"
        address = config.address or os.environ.get("RAY_ADDRESS")
        if address is None:
            return "joining the Ray this process already uses"
        return f"joining Ray at {redact_uri(address)}"

    # ---- groups ------------------------------------------------------------------------
    def build(
        self,
        config: SessionConfig,
        progress: StartProgress | None = None,
        expect: int | None = None,
        without: int | None = None,
    ) -> BuiltGroup:
        """A started group of ``config``'s size; an elastic one (``--workers
        MIN-MAX``) as large as the cluster places now, up to MAX (``expect``: the
        size a growth saw room for, waited for a little longer while the last
        group's resources come free; ``without``: the size the last group has
        without the ranks a failure took, tried next when the cluster's view, still
        counting a lost node, offered more than it places)."""
        if not config.elastic:
            group = self._group_factory(config, self.run_name, config.storage_path)
            group.start(progress)
            return BuiltGroup(group)
        size, room = self._elastic_size(config, expect)
        while True:
            sized = dataclasses.replace(
                config,
                workers=size,
                min_workers=None,
                placement_timeout_s=self.scaling.placement_timeout_s(config, size),
            )
            group = self._group_factory(sized, self.run_name, config.storage_path)
            try:
                group.start(progress)
            except ClusterError:
                smaller = self.scaling.next_smaller(config, size, without)
                if smaller is None:
                    raise
                size, without, room = smaller, None, min(room, smaller)
                continue
            break
        reason = f"elastic {config.workers_text}: {size} rank{'s' if size != 1 else ''}"
        if size != config.workers:
            reason += f" (the cluster has room for {room})"
        return BuiltGroup(group, reason)

    def _elastic_size(self, config: SessionConfig, expect: int | None) -> tuple[int, int]:
        """(the size to try, the ranks the cluster has room for), as the scaling
        policy decides once the view settled; one line after ``placement_timeout_s``
        when not even MIN fits."""
        started = time.monotonic()
        while True:
            room = self.room_for_ranks(config)
            waited = time.monotonic() - started
            size = self.scaling.size_now(config, room, waited, expect)
            if size is not None:
                return size, room
            if waited >= config.placement_timeout_s:
                raise ClusterError(
                    f"an elastic group of {config.workers_text} ranks needs at least "
                    f"{config.min_workers or 1}, but the cluster has room for {room} "
                    f"({config.cpus_per_worker:g} CPU"
                    + (" and a GPU" if config.gpu else "")
                    + f" each) after {config.placement_timeout_s:g} s: free resources, or "
                    "start with a smaller MIN"
                )
            time.sleep(0.2)

    def room_for_ranks(self, config: SessionConfig, held: int = 0) -> int:
        """How many ranks the cluster's free resources hold, plus ``held`` that a
        group being replaced frees."""
        import ray

        free = ray.available_resources()
        room = (
            [int(rank_cpus(free, ray.cluster_resources()) / config.cpus_per_worker + 1e-9)]
            if config.cpus_per_worker
            else []
        )
        if config.gpu:
            room.append(int(free.get("GPU", 0) + 1e-9))
        return (min(room) if room else config.workers) + held
