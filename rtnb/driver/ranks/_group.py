"""The worker group: the ranks of a session and every call the driver makes to them.

:class:`RankGroup` is the interface the driver's flows use: start and shut down, the
rank protocol (each call returns a *pending call*), and waiting on pending calls
(:meth:`~RankGroup.gather`, :meth:`~RankGroup.take_ready`), whose failures are a
:class:`RankLost` or a ``TimeoutError``. Nothing outside this module knows what a
pending call is, so a group whose ranks live elsewhere (in the kernel's process, or
several groups at once) is another implementation of it, not a branch in the flows.

:class:`WorkerGroup` is the Ray one: a placement group plus one :class:`RankActor`
per rank, with torch.distributed set up; a pending call is a Ray reference. It owns
its Ray resources: :meth:`WorkerGroup.shutdown` always frees the actors and the
placement group, even when ranks are hung in a collective.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol

from rtnb.core._channel import FANOUT_FROM_RANKS, channel_wanted
from rtnb.core._config import SessionConfig
from rtnb.core._folder import FolderChanges, FolderRoot
from rtnb.core._messages import CellRequest, RankPlace, RankUpdate, from_wire, to_wire
from rtnb.core._redact import redact_uri
from rtnb.driver.cluster import (
    StartProgress,
    active_warm_ray,
    rank_bundle,
    rank_cpus,
    warm_rank_env,
    watch_ranks,
)
from rtnb.driver.ranks._channel import CONNECT_S, ChannelCall, OpenChannel, channel_key
from rtnb.driver.ranks._datasets import wait_for_data_room
from rtnb.driver.ranks._execution import Execution, RankCalls, RankLost
from rtnb.driver.ranks._folder_sync import FolderSync
from rtnb.driver.ranks._reach import Machine, MachineWatch
from rtnb.driver.ranks._waiting import take_ready
from rtnb.errors import ClusterError, ConfigError, WorkerGroupError, one_line
from rtnb.worker._actor import ACTOR_CONCURRENCY, RELAY_FROM_RANKS, RankActor, poll_timing
from rtnb.worker._commands import Ping, RankCommand, SetDatasets

__all__ = [
    "RankGroup",
    "RankInfo",
    "RankLost",
    "WorkerGroup",
    "check_capacity",
    "check_storage_locality",
]


@dataclass
class RankInfo:
    rank: int
    pid: int
    hostname: str
    node_ip: str
    node_id: str
    device: str
    local_rank: int = 0
    node_rank: int = 0


class RankGroup(RankCalls, Protocol):
    """What the driver's flows need of a group of ranks (see the module docstring):
    the calls a cell's :class:`Execution` sequences, and the rest."""

    ranks: list[RankInfo]

    def start(self, progress: StartProgress | None = None) -> None: ...

    def calls_path(self, rank: int) -> str:
        """How the kernel's cell calls reach ``rank`` (``%rtnb status``'s column)."""
        ...

    def shutdown(self, graceful: bool = True, timeout_s: float = 5.0) -> None: ...

    def execute(self, request: CellRequest, ranks: list[int]) -> Execution: ...

    def share(self, data: bytes) -> Any: ...

    def hand_datasets(self, datasets: dict[str, Any], data_config: Any) -> list[Any]: ...

    def check_data_room(self, datasets: dict[str, Any]) -> None: ...

    def data_progress(self) -> tuple[list[dict], dict[str, float]]: ...


class GroupLender(Protocol):
    """Who lends groups to sessions (a sweep's pool, to one trial at a time): a group
    it lent is handed back at its shutdown instead of being shut down."""

    def adopt(self, group: WorkerGroup) -> bool:
        """A new group it lent has started; False: the lender closed meanwhile."""
        ...

    def give_back(self, group: WorkerGroup, clean: bool) -> None: ...


class WorkerGroup:
    def __init__(
        self,
        config: SessionConfig,
        run_name: str,
        storage_path: str,
        lender: GroupLender | None = None,
    ) -> None:
        self.config = config
        self.run_name = run_name
        self.storage_path = storage_path
        # Lent by a pool: the session's shutdown gives it back (a sound one is lent
        # again, its ranks renewed); ``retire`` once its trial failed, so a broken
        # process group or CUDA state never reaches the next trial.
        self.lender = lender
        self.retire = False
        self.actors: list[Any] = []
        self.ranks: list[RankInfo] = []
        self._reach: MachineWatch | None = None
        self._placement_group = None
        # Every cell's dispatch token, 1, 2, ...: a rank starts a cell at most once
        # under it (a relayed cell also asked directly, a channel call made again
        # through Ray), and the relay's listeners read them in this order.
        self._tokens = itertools.count(1)
        self._relaying = False  # cells go through rank 0's relay (no channel)
        self._fanning = False  # cells fan out through rank 0 on the channel
        self._channel: OpenChannel | None = None
        self._wired: tuple[CellRequest, bytes] | None = None
        self.folder: FolderSync | None = None

    @property
    def world_size(self) -> int:
        return len(self.actors)

    # ---- start -------------------------------------------------------------------------
    def start(self, progress: StartProgress | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.lender is not None and self.actors:
            return  # lent again: the pool renewed its ranks for this run
        cfg = self.config
        progress = progress or StartProgress()
        check_capacity(cfg)
        bundle = rank_bundle(cfg.cpus_per_worker, 1 if cfg.gpu else 0, ray.cluster_resources())
        try:
            with progress.phase("placement", f"placing {cfg.workers} ranks ({cfg.strategy})"):
                self._placement_group = placement_group(
                    [dict(bundle) for _ in range(cfg.workers)], strategy=cfg.strategy
                )
                ready = self._placement_group.ready()
                ray.wait([ready], timeout=cfg.placement_timeout_s)
                ray.get(ready, timeout=0.01)
        except BaseException as exc:  # timeout, infeasible, or Ctrl-C
            self.shutdown(graceful=False)
            if not isinstance(exc, Exception):
                raise
            raise ClusterError(
                f"Ray could not place {cfg.workers} workers with {bundle} each "
                f"({cfg.strategy}) within {cfg.placement_timeout_s:.0f} s: the resources are "
                "held by something else (another group or notebook?). Free them or use "
                "fewer --workers / --cpus-per-worker"
            ) from None
        env = {"OMP_NUM_THREADS": str(max(1, int(cfg.cpus_per_worker))), **cfg.env}
        contexts = [
            {
                "world_rank": rank,
                "world_size": cfg.workers,
                "run_name": self.run_name,
                "storage_path": self.storage_path,
                "backend": cfg.backend,
            }
            for rank in range(cfg.workers)
        ]

        def slow(base_s: float) -> float:
            # Only there so that nothing waits forever: N ranks starting Python and
            # torch on a few cores take seconds each, so the bound grows with N.
            return base_s + 4.0 * cfg.workers

        warm = active_warm_ray() if not cfg.gpu else None
        try:
            doing = (
                f"taking {cfg.workers} warm ranks (torch already imported)"
                if warm is not None
                else f"starting {cfg.workers} rank processes (Python, torch)"
            )
            with progress.phase("ranks", doing):
                if warm is not None:
                    self.actors = warm.claim(cfg.workers)
                    kernel_env, cwd = warm_rank_env(env), os.getcwd()
                    ray.get(
                        [
                            a.adopt.remote(context, kernel_env, sys.path, cwd)
                            for a, context in zip(self.actors, contexts)
                        ],
                        timeout=slow(120),
                    )
                for context in contexts if warm is None else ():
                    actor = (
                        _rank_actor_class()
                        .options(
                            num_cpus=cfg.cpus_per_worker,
                            num_gpus=1 if cfg.gpu else 0,
                            max_concurrency=ACTOR_CONCURRENCY,
                            max_restarts=0,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                self._placement_group,
                                placement_group_bundle_index=context["world_rank"],
                            ),
                        )
                        .remote(context, env)
                    )
                    self.actors.append(actor)
                described = ray.get([a.describe.remote() for a in self.actors], timeout=slow(120))
                self._assign_local_ranks(described)
                self._watch_machines()
                watch_ranks(r.pid for r in self.ranks)
                check_storage_locality(self.node_count, self.storage_path, cfg.allow_local_storage)
                devices = ray.get(
                    [
                        a.set_placement.remote(
                            info.local_rank,
                            self._local_world_size(info),
                            info.node_rank,
                            self.node_count,
                        )
                        for a, info in zip(self.actors, self.ranks)
                    ],
                    timeout=slow(60),
                )
                for info, device in zip(self.ranks, devices):
                    info.device = device
                self._open_folder(progress, slow(60))
            with progress.phase("process group", f"joining the {cfg.backend} process group"):
                master_port = ray.get(
                    self.actors[0].open_rendezvous.remote(self.ranks[0].node_ip), timeout=slow(30)
                )
                ray.get(
                    [
                        a.init_distributed.remote(self.ranks[0].node_ip, master_port, 1800.0)
                        for a in self.actors
                    ],
                    timeout=slow(120),
                )
                self._open_channel(slow(30))
                if cfg.workers >= RELAY_FROM_RANKS and self._channel is None:
                    ray.get(
                        [
                            a.open_relay.remote(self.ranks[0].node_ip, master_port)
                            for a in self.actors
                        ],
                        timeout=slow(60),
                    )
                    self._relaying = True
        except ConfigError:
            self.shutdown()
            raise
        except Exception as exc:  # noqa: BLE001
            self.shutdown()
            raise WorkerGroupError(f"the worker group failed to start: {one_line(exc)}") from None
        except BaseException:
            # Ctrl-C while the ranks start: nothing may keep holding CPUs or GPUs.
            self.shutdown(graceful=False)
            raise
        if self.lender is not None and not self.lender.adopt(self):
            self.shutdown(graceful=False, timeout_s=2.0)  # the pool closed meanwhile
            raise ClusterError("the sweep is over: its groups are shut down")

    def _open_channel(self, timeout_s: float) -> None:
        """Open the channel to every rank this process reaches (``_channel.py``); none
        through a Ray Client, or with ``RTNB_OPEN_CHANNEL=0``."""
        import ray

        if not channel_wanted() or ray.util.client.ray.is_connected():
            return
        key = channel_key()
        ports = ray.get(
            [a.open_channel.remote(info.node_ip, key) for a, info in zip(self.actors, self.ranks)],
            timeout=timeout_s,
        )
        addresses = {info.rank: (info.node_ip, port) for info, port in zip(self.ranks, ports)}
        channel = OpenChannel.connect(addresses, key)
        if not channel.ranks:
            channel.close()
            return
        self._channel = channel
        if len(channel.ranks) == len(self.actors) >= FANOUT_FROM_RANKS:
            # Cells fan out through rank 0 when it reaches every other rank (on the
            # nodes' own network, which the kernel's machine may not share).
            others = {rank: at for rank, at in addresses.items() if rank != 0}
            reached = ray.get(
                self.actors[0].reach_peers.remote(others, CONNECT_S), timeout=timeout_s
            )
            self._fanning = len(reached) == len(others)

    @property
    def channel_ranks(self) -> list[int]:
        """The ranks whose cells and polls go over the open channel."""
        return self._channel.ranks if self._channel is not None else []

    def calls_path(self, rank: int) -> str:
        return "channel" if self._channel is not None and self._channel.has(rank) else "Ray"

    def _open_folder(self, progress: StartProgress, timeout_s: float) -> None:
        """The notebook's folder on each rank: seen in place, or copied where its node
        cannot see it (``--files``; see driver/_folder_sync.py)."""
        import ray

        cfg = self.config

        def ask(roots: list[FolderRoot], copy_all: bool) -> list[tuple[str, ...]]:
            calls = [a.open_folder.remote(roots, copy_all) for a in self.actors]
            return ray.get(calls, timeout=timeout_s)

        def send(changes: dict[int, FolderChanges]) -> None:
            with progress.phase("files", "copying the notebook's folder to the ranks"):
                calls = [self.actors[r].apply_files.remote(c) for r, c in changes.items()]
                ray.get(calls, timeout=timeout_s)

        excludes = cfg.excludes + _storage_in_folder(self.storage_path)
        self.folder = FolderSync.open(cfg.files, excludes, cfg.includes, ask, send)
        if self.folder is not None:
            progress.report.notes += [self.folder.shipped_summary(), *self.folder.notes]

    def _assign_local_ranks(self, described: list[RankPlace]) -> None:
        node_order: list[str] = []
        per_node: dict[str, int] = {}
        for rank, place in enumerate(described):
            node = place.node_id
            if node not in node_order:
                node_order.append(node)
            local = per_node.get(node, 0)
            per_node[node] = local + 1
            self.ranks.append(
                RankInfo(
                    rank=rank,
                    pid=place.pid,
                    hostname=place.hostname,
                    node_ip=place.node_ip,
                    node_id=node,
                    device="cpu",
                    local_rank=local,
                    node_rank=node_order.index(node),
                )
            )

    def _local_world_size(self, info: RankInfo) -> int:
        return sum(1 for r in self.ranks if r.node_id == info.node_id)

    @property
    def node_count(self) -> int:
        return len({r.node_id for r in self.ranks})

    # ---- the rank protocol -------------------------------------------------------------
    def execute(self, request: CellRequest, ranks: list[int]) -> Execution:
        """Start a cell on ``ranks``; its :class:`Execution` sequences the calls. The
        request carries the notebook's files changed since those ranks' copies."""
        if self.folder is not None:
            request = self.folder.stamp(request, ranks)
        return Execution(self, request, ranks)

    @property
    def relays(self) -> bool:
        """Cells go through rank 0 (groups of FANOUT_FROM_RANKS ranks and more on the
        channel, of RELAY_FROM_RANKS without it)."""
        return self._fanning or self._relaying

    def next_token(self) -> int | None:
        """The next cell's dispatch token."""
        return next(self._tokens)

    def cut_off(self) -> dict[int, str]:
        """Ranks whose machine stopped answering (``_reach``), each with its line."""
        return self._reach.cut_off() if self._reach is not None else {}

    def _watch_machines(self) -> None:
        """Knock on the nodes under the ranks other than this process's own; not
        through a Ray Client, whose kernel may not reach the nodes at all."""
        import ray

        try:
            if ray.util.client.ray.is_connected():
                return
            here = ray.get_runtime_context().get_node_id()
            ports = {n["NodeID"]: n["NodeManagerPort"] for n in ray.nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001 - no watch: Ray's own checks still hold
            return
        machines: dict[str, list[RankInfo]] = {}
        for info in self.ranks:
            if info.node_id != here and info.node_id in ports:
                machines.setdefault(info.node_id, []).append(info)
        if machines:
            self._reach = MachineWatch(
                Machine(
                    name=infos[0].hostname,
                    address=infos[0].node_ip,
                    port=int(ports[node]),
                    ranks=tuple(i.rank for i in infos),
                )
                for node, infos in machines.items()
            )

    def where(self, rank: int) -> str | None:
        """The machine of ``rank``, as a lost rank's line names it."""
        for info in self.ranks:
            if info.rank == rank:
                return f"{info.hostname} ({info.node_ip})"
        return None

    def relay(self, request: CellRequest, ranks: list[int], wait_s: float) -> Any:
        """Rank 0 starts ``request`` on ``ranks`` and gathers their quick answers."""
        if self._fanning and self._channel is not None:
            return self._channel.fan_out(self._wire(request), ranks, wait_s)
        return self.actors[0].relay.remote(self._wire(request), ranks, wait_s)

    def _wire(self, request: CellRequest) -> bytes:
        """``request`` pickled once however many ranks it goes to."""
        if self._wired is None or self._wired[0] is not request:
            self._wired = (request, to_wire(request))
        return self._wired[1]

    @staticmethod
    def relay_answers(result: Any) -> dict[int, RankUpdate | None]:
        """The relay's result as each rank's last update (None: that rank is still
        running, ask it directly); a relay that failed (rank 0 died) answers for no
        rank, so asking each rank directly finds out who else is gone."""
        if isinstance(result, BaseException):
            return {}
        # Every rank's update arrives as the bytes it pickled (rank 0 passes the
        # listeners' on without unpickling them).
        return {rank: from_wire(answer) for rank, answer in result.items()}

    def run(self, rank: int, request: CellRequest) -> Any:
        """Start ``request`` on ``rank`` (once per token) and long-poll it once."""
        if self._channel is not None and self._channel.has(rank):
            return self._channel.run(rank, self._wire(request))
        return self.actors[rank].run.remote(self._wire(request))

    def poll(self, rank: int) -> Any:
        if self._channel is not None and self._channel.has(rank):
            return self._channel.poll(rank, *poll_timing(len(self.actors)))
        return self.actors[rank].poll.remote(*poll_timing(len(self.actors)))

    def _through_ray(self, call: ChannelCall) -> Any:
        """A broken channel call made again through Ray: the same run (its token
        starts nothing twice) or a poll."""
        actor = self.actors[call.rank]
        if call.request is not None:
            return actor.run.remote(call.request)
        return actor.poll.remote(*poll_timing(len(self.actors)))

    def command(self, rank: int, command: RankCommand, payload: Any = None) -> Any:
        return self.actors[rank].command.remote(command, payload)

    def renew(self, run_name: str, storage_path: str) -> list[Any]:
        """The ranks become those of run ``run_name`` with fresh namespaces (the same
        processes and process group): a sweep lends this group to its next trial."""
        self.run_name, self.storage_path = run_name, storage_path
        return [a.renew.remote(run_name, storage_path) for a in self.actors]

    def hand_datasets(self, datasets: dict[str, Any], data_config: Any) -> list[Any]:
        """Split ``datasets`` for these ranks with Ray Train's ``DataConfig`` (its
        streaming split, with the ranks' nodes as locality hints) and give each rank
        its shards, replacing those it had."""
        shards = data_config.configure(
            datasets,
            world_size=self.world_size,
            worker_handles=self.actors,
            worker_node_ids=[info.node_id for info in self.ranks],
        )
        return [self.command(r, SetDatasets(shards[r])) for r in range(self.world_size)]

    def check_data_room(self, datasets: dict[str, Any]) -> None:
        """Wait (up to ``DATA_ROOM_WAIT_S``) for the CPUs ``datasets``' tasks need
        beside these ranks; one line when they stay taken."""
        import ray

        wait_for_data_room(
            datasets,
            ranks_hold=self.world_size * self.config.cpus_per_worker,
            resources=lambda: (ray.cluster_resources(), ray.available_resources()),
        )

    def data_progress(self) -> tuple[list[dict], dict[str, float]]:
        """The executions of this kernel's Ray Data pipelines (Ray Data's stats
        actor's records, each with its ``_tag``), and the cluster's free resources."""
        import ray
        from ray.data._internal import stats

        # Ray 2.40 names it with an underscore; its records are the same.
        stats_actor = (
            getattr(stats, "get_or_create_stats_actor", None) or stats._get_or_create_stats_actor
        )
        job = ray.get_runtime_context().get_job_id()
        actor = stats_actor()  # held: a handle dropped mid-call is "lost" on Ray 2.40
        found = ray.get(actor.get_datasets.remote(job), timeout=5)
        records = [{**record, "_tag": tag} for tag, record in found.items()]
        return records, ray.available_resources()

    def share(self, data: bytes) -> Any:
        """``data`` stored once, to be passed to many ranks' calls (a ``Push``'s
        payload)."""
        import ray

        return ray.put(data)

    # ---- waiting on calls --------------------------------------------------------------
    def gather(self, calls: list[Any], timeout_s: float) -> list[Any]:
        """The results of ``calls``, in order; TimeoutError after ``timeout_s``,
        RankLost when a rank is gone."""
        import ray

        try:
            return ray.get(calls, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"no answer within {timeout_s:g} s") from None
        except ray.exceptions.RayError as exc:
            raise RankLost(one_line(exc)) from None

    def take_ready(self, calls: list[Any], timeout_s: float) -> tuple[list[Any], list[Any]]:
        """Whatever ``calls`` are done within ``timeout_s``, with their results (a
        failed call's result is its exception; a rank's update as a
        :class:`RankUpdate`), as soon as one is (``ranks/_waiting.py``)."""
        return take_ready(calls, timeout_s, self._channel, self._through_ray)

    # ---- stop --------------------------------------------------------------------------
    def shutdown(self, graceful: bool = True, timeout_s: float = 5.0) -> None:
        """Free every actor and the placement group. ``graceful`` first lets the ranks
        leave the process group; hung ranks are killed regardless. A lent group goes
        back to its lender instead (which shuts down what it does not keep)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.lender is not None:
            lender, self.lender = self.lender, None
            lender.give_back(self, clean=graceful and not self.retire)
            return

        if self._reach is not None:
            self._reach.close()
            self._reach = None
        if self._channel is not None:
            self._channel.close()  # kept: the calls in flight take their answer from it
        actors, self.actors = self.actors, []
        if graceful and actors:
            refs = [a.shutdown_distributed.remote() for a in actors]
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        if self._placement_group is not None:
            try:
                remove_placement_group(self._placement_group)
            except Exception:  # noqa: BLE001
                pass
            self._placement_group = None
        # Wait briefly until Ray reports the actors gone, so "stop" really means the
        # CPUs/GPUs are free when it returns.
        deadline = time.monotonic() + timeout_s
        for actor in actors:
            while time.monotonic() < deadline:
                try:
                    ray.get(actor.command.remote(Ping()), timeout=0.5)
                except Exception:  # noqa: BLE001 - dead: what we want
                    break
                time.sleep(0.05)


@functools.cache
def _rank_actor_class() -> Any:
    """:class:`RankActor` as a Ray actor class, made once per process: Ray exports
    each actor class it is given (pickled and disassembled, ~0.1 s) at its first
    actor, so a class made per rank would cost that for every rank."""
    import ray

    return ray.remote(RankActor)


def _storage_in_folder(storage_path: str) -> tuple[str, ...]:
    """The run storage as a pattern to leave out of the notebook's folder when it is a
    local path inside it (``--storage runs``): every cell writes its journal and
    metrics there, and the copy would carry them to the ranks with every cell."""
    if "://" in storage_path and not storage_path.startswith("file://"):
        return ()
    path = os.path.realpath(storage_path.removeprefix("file://"))
    try:
        inside = os.path.relpath(path, os.path.realpath(os.getcwd()))
    except ValueError:  # another drive
        return ()
    if inside == "." or inside.startswith(".."):
        return ()
    return ("/" + inside.replace(os.sep, "/") + "/",)


def check_capacity(
    cfg: SessionConfig, total: dict[str, float] | None = None, where: str = ""
) -> None:
    """One line when the group cannot fit: ``total`` resources (default: the Ray
    cluster's), described as ``where`` ("this machine", "the Ray cluster")."""
    if total is None:
        import ray

        total = ray.cluster_resources()
    where = where or "the Ray cluster"
    need_cpu = cfg.workers * cfg.cpus_per_worker
    have = rank_cpus(total)
    if need_cpu > have:
        kept = " (one more is kept for Ray Data)" if have < total.get("CPU", 0) else ""
        raise ClusterError(
            f"{cfg.workers} workers × {cfg.cpus_per_worker:g} CPU need {need_cpu:g} CPUs, "
            f"but {where} has {have:g}{kept}. Use fewer --workers or a "
            "smaller --cpus-per-worker (e.g. 0.5)"
        )
    if cfg.gpu and cfg.workers > total.get("GPU", 0):
        raise ClusterError(
            f"--gpu needs one GPU per worker ({cfg.workers}), but {where} has "
            f"{total.get('GPU', 0):g} GPUs. Use fewer --workers, or drop --gpu to train on CPU"
        )


def check_storage_locality(node_count: int, storage_path: str, allowed: bool) -> None:
    """Refuse a node-local storage path for ranks on several nodes: each node would
    keep its own part of every checkpoint and metrics file, and lose it with the node."""
    if node_count > 1 and "://" not in storage_path and not allowed:
        raise ConfigError(
            f"the ranks run on {node_count} nodes but --storage {redact_uri(storage_path)!r} is a local path: "
            "each node would write its own part of every checkpoint there, and it is lost with "
            "the node. Use shared storage (s3://..., gs://...) or, if that path is a filesystem "
            "shared by all nodes, pass --allow-local-storage"
        )
