"""The kernel's (or a terminal's) side of a detached group (see ``detached/_host.py``).

:func:`start_detached` starts a run's :class:`SessionHost` on a Ray that outlives
the kernel (the warm Ray, or ``--address``) and returns a :class:`DetachedSession`;
:func:`attach` returns one for a host already running, from any kernel. A
``DetachedSession`` has the calls the magics make on a session; cells run in the
host, and a thread follows it: every report since the group started goes into this
side's :class:`MetricsStore` in order (the live view draws the history and goes on),
the output into each cell's sinks, the cells' ends into their
:class:`FollowedCell` handles. While a kernel holds the group, that thread is its
beat; a kernel that dies simply stops beating.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Unpack

from rtnb.core._config import SessionConfig, default_run_name
from rtnb.core._output import OutputSink, print_sink
from rtnb.core._stacks import GroupStacks
from rtnb.core._values import PerRank, from_portable
from rtnb.driver.cluster import ClusterConnection, connect
from rtnb.driver.detached._host import (
    DETACHED_NAMESPACE,
    CellOutcome,
    CellView,
    DetachedGroup,
    FeedChunk,
    Holder,
    SessionHost,
    actor_name,
    idle_seconds,
    run_of,
)
from rtnb.driver.lifecycle import CellOptions
from rtnb.errors import (
    ClusterError,
    ConfigError,
    RtnbError,
    SessionError,
    WaitTimeout,
    one_line,
)
from rtnb.metrics._store import MetricsStore
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import CheckpointInfo, CheckpointStore
from rtnb.storage._result import Result
from rtnb.storage._rundir import BATCH_RUNS_ENV

__all__ = [
    "DetachedSession",
    "FollowedCell",
    "attach",
    "detached_groups",
    "start_detached",
    "stop_detached",
]

_HOST_CONCURRENCY = 64
_CALL_TIMEOUT_S = 300.0
# A cell's output kept here for views that subscribe late (the run's logs/ keep all).
_LOG_LINES = 20_000


def _ray():
    import ray

    return ray


class HostGone(SessionError):
    """The detached group's host is gone: stopped, freed when idle, or killed."""


def _get(ref: Any, timeout: float = _CALL_TIMEOUT_S) -> Any:
    """A host call's answer; an rtnb error raised there is raised here as itself (one
    line), not wrapped in Ray's traceback."""
    ray = _ray()
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, RtnbError):
            raise cause from None
        raise SessionError(f"the detached group's host failed: {one_line(cause)}") from None
    except ray.exceptions.RayActorError:
        raise HostGone(
            "the detached group is gone (stopped, freed by its idle timeout, or killed)"
        ) from None
    except ray.exceptions.GetTimeoutError:
        raise SessionError(
            f"the detached group's host did not answer within {timeout:g} s (busy, or its "
            "machine is overloaded); the group goes on: try again"
        ) from None


def _this_kernel() -> Holder:
    return Holder(
        kernel=f"kernel pid {os.getpid()} on {socket.gethostname()}",
        token=secrets.token_hex(8),
        pid=os.getpid(),
        hostname=socket.gethostname(),
    )


class FollowedCell:
    """A host's cell seen from here: the calls views and magics make on a
    :class:`CellHandle` (value, error, output sinks, stop)."""

    def __init__(
        self,
        host: Any,
        view: CellView,
        steps: Callable[[], dict[int, int]] = dict,
        token: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._host = host
        self._steps = steps
        self._token = token
        self.cell_id = view.cell_id
        self.name = view.name
        self.background = view.background
        self.ranks = view.ranks
        self.started_at = view.started_at
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._log: deque[tuple[int, str, str]] = deque(maxlen=_LOG_LINES)
        self._sinks: list[OutputSink] = []
        self._callbacks: list[Callable[[FollowedCell], None]] = []
        self.update(view)

    def update(self, view: CellView) -> None:
        if self._done.is_set() and not view.done:
            return  # an answer sent before the end, read after it
        self._view = view
        self.restarted_from, self.recoveries = view.restarted_from, view.recoveries
        if view.done and not self._done.is_set():
            with self._lock:
                self._done.set()
                callbacks = list(self._callbacks)
            for callback in callbacks:
                with contextlib.suppress(Exception):
                    callback(self)

    def gone(self, why: str) -> None:
        """The host went away while this cell ran."""
        if not self._done.is_set():
            self.update(dataclasses.replace(self._view, done=True, error=SessionError(why)))

    def output(self, rank: int, stream: str, text: str) -> None:
        with self._lock:
            self._log.append((rank, stream, text))
            sinks = list(self._sinks)
        for sink in sinks:
            with contextlib.suppress(Exception):
                sink(rank, stream, text)

    def add_sink(self, sink: OutputSink, replay: bool = True) -> None:
        with self._lock:
            earlier = list(self._log) if replay else []
            self._sinks.append(sink)
        for line in earlier:
            sink(*line)

    @property
    def log(self) -> list[tuple[int, str, str]]:
        with self._lock:
            return list(self._log)

    def add_done_callback(self, callback: Callable[[FollowedCell], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def steps(self) -> dict[int, int]:
        """Each rank's last reported step."""
        return self._steps()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` for the cell's end; whether it ended."""
        return self._done.wait(timeout)

    @property
    def error(self) -> BaseException | None:
        return self._view.error

    @property
    def elapsed_s(self) -> float:
        return (self._view.ended_at or time.time()) - self.started_at

    def wait(self, timeout: float | None = None) -> Any:
        """The cell's value per rank once it ends (its error raised)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            outcome: CellOutcome | None = _get(
                self._host.outcome.remote(self.cell_id, max(0.0, left)), timeout=left + 60
            )
            if outcome is not None:
                if outcome.error is not None:
                    raise outcome.error
                return PerRank({rank: from_portable(p) for rank, p in outcome.values.items()})
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"{self.name} is still running after {timeout:g} s; it goes on "
                    "(`%rtnb wait` again for its value)"
                )

    result = wait

    def stop(self, reason: str = "stopped by the user") -> None:
        _get(self._host.stop_cell.remote(self.cell_id, reason, self._token()))

    def run_here(self) -> Any:
        """Wait in this thread for the cell's end; Ctrl-C stops it on every rank."""
        while True:
            try:
                return self.wait()
            except KeyboardInterrupt:
                self.stop("interrupted (Ctrl-C / kernel interrupt)")

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<rtnb.FollowedCell {self.name} {state}>"


class DetachedSession:
    """A detached group, held (or, for ``rtnb attach`` in a terminal, only followed)
    from this process. Its cells run in the group's host; ``stop()`` frees the group,
    ``release()`` leaves it running."""

    is_trial = False
    detached = True

    def __init__(
        self,
        config: SessionConfig,
        *,
        session_class: type | None = None,
        replay: bool = False,
        idle_timeout_s: float | None = None,
        on_started: Callable[[DetachedSession], None] | None = None,
    ) -> None:
        """``Session(detached=True)``: the options, checked; :meth:`start` makes the
        group's host. (:func:`attach` binds one to a running host instead.)"""
        if replay and not config.name:
            raise ConfigError("--replay rebuilds a run from its journal: name it with --name RUN")
        if config.local:
            raise ConfigError(
                "--detached runs the group outside this kernel and local mode (--workers 0) "
                "inside it: drop one of them"
            )
        if idle_timeout_s is not None and idle_timeout_s <= 0:
            raise ConfigError(f"--idle-timeout must be positive, got {idle_timeout_s:g}")
        self.run_name = config.name or default_run_name()
        self._config = dataclasses.replace(config, name=self.run_name)
        self._start_with = (session_class, replay, idle_timeout_s, on_started)
        self._host: Any = None
        self._holder: Holder | None = None
        self._connection: ClusterConnection | None = None
        self.metrics = MetricsStore()
        self.last_start: str | None = None
        self.last_replay: str | None = None
        self.last_profile = None
        self.last_growth: str | None = None
        self.ended: str | None = None  # why the group is gone, once it is
        self.taken_by: str | None = None  # the kernel that took this group over
        self._cells: dict[int, FollowedCell] = {}
        self._cells_lock = threading.Lock()  # this thread's new cells vs the follower's
        self._last_background: FollowedCell | None = None
        self._cursors = (0, 0, 0)
        self._closing = threading.Event()

    def start(self, progress: Callable[[str], None] | None = None) -> DetachedSession:
        """Start the group's host (it outlives this kernel) and hold it from here."""
        if self._host is not None:
            raise SessionError(f"run {self.run_name!r} is already started")
        session_class, replay, idle_s, on_started = self._start_with
        if session_class is None:
            raise SessionError("this detached session was attached, not made to start")
        host, config, holder, connection, start_line, replay_line = start_detached(
            session_class, self._config, replay, idle_s, progress
        )
        self.last_start, self.last_replay = start_line, replay_line
        self.bind_host(host, config, holder, [], connection)
        if on_started is not None:
            on_started(self)
        return self

    @classmethod
    def bound_to(
        cls,
        host: Any,
        config: SessionConfig,
        holder: Holder | None,
        views: list[CellView],
        connection: ClusterConnection | None,
    ) -> DetachedSession:
        """A session of a host that runs already (:func:`attach`)."""
        session = cls(config)
        session.bind_host(host, config, holder, views, connection)
        return session

    def bind_host(
        self,
        host: Any,
        config: SessionConfig,
        holder: Holder | None,
        views: list[CellView],
        connection: ClusterConnection | None,
    ) -> None:
        """From now on this session's calls go to ``host``; its feed is followed."""
        self._host, self._config, self._holder, self._connection = host, config, holder, connection
        for view in views:
            self._cell(view)
        # The history first, in this thread: a view shown right after sees all of it
        # (up to what the host had at the first answer; the rest comes live).
        first = self._pull(0.0)
        while first is not None and self._cursors[0] < first.reports_end:
            if self._pull(0.0) is None:
                break
        threading.Thread(target=self._follow, name="rtnb-follow", daemon=True).start()

    def __enter__(self) -> DetachedSession:
        return self if self._host is not None else self.start()

    def __exit__(self, *exc_info: Any) -> None:
        # A detached group outlives the block, as it outlives the kernel: let go.
        if self._host is not None:
            self.release()

    # ---- following -------------------------------------------------------------------
    def _pull(self, timeout_s: float) -> FeedChunk | None:
        try:
            chunk = _get(
                self._host.follow.remote(*self._cursors, self._token(), timeout_s), timeout=60
            )
        except HostGone as exc:
            self._gone(str(exc))
            return None
        except Exception:  # noqa: BLE001 - a slow or odd answer: the next pull asks again
            return None
        self._apply(chunk)
        return chunk

    def _follow(self) -> None:
        while not self._closing.is_set() and self.ended is None:
            chunk = self._pull(1.0)
            if chunk is None and self.ended is None:
                self._closing.wait(1.0)

    def _apply(self, chunk: FeedChunk) -> None:
        for item in chunk.reports:
            if item[0] == "begin":
                self.metrics.begin(item[1], item[2])
            else:
                self.metrics.add(item[1], item[2])
        for view in chunk.cells:
            self._cell(view)
        for cell_id, rank, stream, text in chunk.output:
            cell = self._cells.get(cell_id)
            if cell is not None:
                cell.output(rank, stream, text)
        self._cursors = (chunk.reports_at, chunk.output_at, chunk.cells_at)
        if chunk.taken_by is not None:
            self.taken_by = chunk.taken_by
            self._holder = None
        if chunk.ended is not None:
            self._gone(f"the detached group of run {self.run_name!r} was freed: {chunk.ended}")

    def _cell(self, view: CellView) -> FollowedCell:
        with self._cells_lock:
            cell = self._cells.get(view.cell_id)
            if cell is None:
                cell = FollowedCell(self._host, view, self._steps, self._token)
                self._cells[view.cell_id] = cell
                if view.background:
                    self._last_background = cell
                return cell
        cell.update(view)
        return cell

    def _token(self) -> str | None:
        holder = self._holder
        return holder.token if holder is not None else None

    def _steps(self) -> dict[int, int]:
        return {rank: report.step for rank, report in self.metrics.last.items()}

    def _gone(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
        for cell in self.cells:
            cell.gone(why)

    # ---- what a session has ----------------------------------------------------------
    @property
    def config(self) -> SessionConfig:
        return self._config

    @property
    def started(self) -> bool:
        """Whether this process has the group: held by it, and not freed."""
        return self.ended is None and self._holder is not None

    @property
    def held(self) -> bool:
        """Whether this process holds the group (not taken over by another kernel)."""
        return self._holder is not None and self.ended is None

    @property
    def world_size(self) -> int:
        return _get(self._host.world_size.remote())

    @property
    def cells(self) -> list[FollowedCell]:
        with self._cells_lock:
            return [self._cells[cid] for cid in sorted(self._cells)]

    @property
    def active_cell(self) -> FollowedCell | None:
        running = [c for c in self.cells if not c.done()]
        return running[-1] if running else None

    def _require_held(self) -> None:
        if self.ended is not None:
            raise SessionError(self.ended)
        if self._host is None:
            raise SessionError("the detached group is not started yet: call start() first")
        if self._holder is None:
            taken = f"{self.taken_by} took it over; " if self.taken_by else ""
            raise SessionError(
                f"this kernel does not hold run {self.run_name!r}: {taken}"
                f"`%rtnb attach {self.run_name} --take` takes it back"
            )

    # ---- calls the host makes on its session ----------------------------------------
    def _in_host(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._require_held()
        return _get(self._host.call.remote(name, args, kwargs, self._token()))

    def status(self) -> Any:  # a GroupStatus, made in the host
        return self._in_host("status")

    def pull(self, name: str, ranks: Iterable[int] | str | None = None) -> list[Any]:
        return self._in_host("pull", name, ranks)

    def push(self, values: dict[str, Any], ranks: Iterable[int] | str | None = None) -> None:
        self._in_host("push", values, ranks)

    def names_on_ranks(self) -> set[str]:
        return self._in_host("names_on_ranks")

    def list_checkpoints(
        self, include_incomplete: bool = False, run: str | None = None
    ) -> list[CheckpointInfo]:
        return self._in_host("list_checkpoints", include_incomplete, run)

    def latest_checkpoint_id(self) -> str | None:
        return self._in_host("latest_checkpoint_id")

    def stacks(self, ranks: Iterable[int] | str | None = None) -> GroupStacks:
        return self._in_host("stacks", ranks)

    def set_controls(self, values: dict[str, Any] | None = None, **named: Any) -> int | None:
        return self._in_host("set_controls", values, **named)

    def trigger(self, name: str) -> int:
        return self._in_host("trigger", name)

    def save_now(self) -> int:
        return self._in_host("save_now")

    def result(self) -> Result:
        return self._in_host("result")

    def load(self, checkpoint_id: str = "latest", run: str | None = None) -> Checkpoint:
        return self._in_host("load", checkpoint_id, run)

    def prepare_resume(self, checkpoint_id: str = "latest", *, run: str | None = None) -> Any:
        return self._in_host("prepare_resume", checkpoint_id, run=run)

    # ---- what lives in a kernel: refused in one line -----------------------------------
    def debug(
        self,
        rank: int | None = None,
        ask: Callable[[str], str] | None = None,
        show: Callable[[str], None] | None = None,
    ) -> None:
        raise _not_from_a_kernel("debug")

    def profile(self, steps: int = 20) -> int | None:
        raise _not_from_a_kernel("profile")

    def set_datasets(
        self, datasets: Mapping[str, Any] | None = None, dataset_config: Any = None, **named: Any
    ) -> None:
        raise SessionError(
            "--datasets is not available on a detached group: hand the datasets "
            "in the cell (ray.data.read_...)"
        )

    def prepare_import(self, path: str, argv: list[str] | None = None) -> Any:
        raise _not_from_a_kernel("import")

    @property
    def dataset_names(self) -> list[str]:
        self._require_held()
        return _get(self._host.call.remote("dataset_names", (), {}, self._token()))

    def scale(self, workers: int | tuple[int, int] | None = None) -> DetachedSession:
        """A group of ``workers`` ranks holding the same state, in the host."""
        if workers == 0:
            raise ConfigError(
                "a detached group cannot go to local mode (--workers 0 runs the rank in "
                "this kernel): `%rtnb stop` it and start one without --detached"
            )
        return self._changed("scale", workers)

    def restart(self, replay: bool = False) -> DetachedSession:
        """A fresh group in the host (``replay``: with the ranks' state)."""
        return self._changed("restart", replay)

    def _changed(self, name: str, argument: Any) -> DetachedSession:
        self._require_held()
        _get(self._host.call.remote(name, (argument,), {}, self._token()))
        self._config, self.last_replay, self.last_growth = _get(self._host.after_change.remote())
        return self

    def checkpoint_store(self, run: str | None = None) -> CheckpointStore:
        """This run's checkpoints (or another run's of the same storage), read here;
        a delete goes through the host, whose store guards what a recovery loads."""
        store = CheckpointStore.of_run(self._config.storage_path, run or self.run_name)
        token = self._token()

        def delete(checkpoint_id: str, _index: bool = True) -> None:
            _get(self._host.delete_checkpoint.remote(checkpoint_id, run, token))

        store.delete = delete  # type: ignore[method-assign]
        return store

    def resume(
        self, checkpoint_id: str = "latest", *, run: str | None = None, background: bool = True
    ) -> Any:
        """The last training cell again from ``checkpoint_id``, in the group's host."""
        self._require_held()
        view = _get(self._host.resume.remote(checkpoint_id, run, self._token()))
        if view is None:
            return None
        cell = self._cell(view)
        cell.add_sink(print_sink(), replay=True)
        return cell if background else cell.run_here()

    # ---- cells -----------------------------------------------------------------------
    def _start_cell(self, code: str, background: bool, options: CellOptions) -> FollowedCell:
        self._require_held()
        if options.get("datasets"):
            self.set_datasets()  # refused in one line
        if not isinstance(code, str):
            raise ConfigError("a detached group runs code given as text")
        ranks = options.get("ranks")
        sent = {
            "ranks": list(ranks) if ranks is not None and not isinstance(ranks, str) else ranks,
            "timeout": options.get("timeout"),
            "total_steps": options.get("total_steps"),
            "once": options.get("once", False),
            "label": options.get("label"),
            "config": options.get("config"),
        }
        view = _get(self._host.run.remote(code, background, sent, self._token()))
        cell = self._cell(view)
        cell.add_sink(options.get("output") or print_sink(), replay=True)
        return cell

    def run_background(self, code: str, **options: Unpack[CellOptions]) -> FollowedCell:
        """Start ``code`` in the group's host; its handle at once."""
        options["output"] = options.get("output") or (lambda rank, stream, text: None)
        return self._start_cell(code, True, options)

    def begin_cell(self, code: str, **options: Unpack[CellOptions]) -> FollowedCell:
        """A foreground cell: it runs in the host (so it goes on if this kernel
        dies); ``run_here()`` waits for it."""
        return self._start_cell(code, False, options)

    def run(self, code: str, **options: Unpack[CellOptions]) -> Any:
        return self.begin_cell(code, **options).run_here()

    def wait(self, timeout: float | None = None) -> Any:
        """The value of the last background cell, once it ends (``%rtnb wait``)."""
        cell = self._last_background
        if cell is None:
            raise SessionError("no background cell to wait for")
        return cell.wait(timeout)

    # ---- the end ---------------------------------------------------------------------
    def stop(self) -> None:
        """Free the group: stop its cells, its ranks and its host."""
        if self.ended is None:
            self._require_held()
            try:
                with contextlib.suppress(SessionError):
                    _get(self._host.free.remote("stopped by the user"))
                self._gone(f"the detached group of run {self.run_name!r} was stopped")
                _wait_gone(self.run_name)
            finally:
                self._close()
        self._close()

    def release(self) -> None:
        """Leave the group running without this kernel (its idle timeout counts from
        when no cell runs)."""
        if self._holder is not None and self.ended is None:
            with contextlib.suppress(Exception):
                _ray().get(self._host.release.remote(self._holder.token), timeout=10)
        self._holder = None
        self._close()

    def _close(self) -> None:
        self._closing.set()
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.shutdown()
            self._connection = None

    def __repr__(self) -> str:
        return f"<rtnb.DetachedSession run={self.run_name!r}>"


# ---- starting, attaching, listing, stopping --------------------------------------------
def _host_placement(connection: ClusterConnection) -> dict[str, Any]:
    """Where the host goes. A kernel that joined a cluster as a node of its own (its
    machine is not one of the cluster's) must not get it: Ray places a CPU-less actor
    on its caller's node, and that node ends with this kernel. The head's machine
    outlives any worker's."""
    if connection.joined_as is None or connection.client_mode:
        return {}
    return {"resources": {"node:__internal_head__": 0.001}}


def start_detached(
    session_class: type,
    config: SessionConfig,
    replay: bool,
    idle_timeout_s: float | None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Any, SessionConfig, Holder, ClusterConnection, str | None, str | None]:
    """Start a detached group's host for ``config`` (the session's own options): the
    host, the options in force there, this kernel as its holder, the connection, and
    the start's and replay's lines."""
    say = progress or (lambda line: None)
    run = config.name or default_run_name()
    config = dataclasses.replace(config, name=run, storage=config.storage_path)
    need = 0.0 if config.local else config.workers * config.cpus_per_worker
    connection = connect(
        config.address,
        timeout_s=config.connect_timeout_s,
        listen=config.listen,
        need_cpus=need,
        ranks=config.workers,
        progress=say,
        outlive_kernel=True,
    )
    ray = _ray()
    if not connection.owned and _ray_dies_with_this_process():
        # (the warm-or-embedded choice was connect's: it never embeds for a detached group)
        connection.shutdown()
        raise ConfigError(
            "--detached needs a Ray that outlives this kernel, and the Ray this kernel "
            "uses is its own (its ray.init()), which ends with it: give a cluster's "
            "--address, or free the warm Ray"
        )
    with contextlib.suppress(ValueError):
        ray.get_actor(actor_name(run), namespace=DETACHED_NAMESPACE)
        connection.shutdown()
        raise ConfigError(
            f"run {run!r} already has a detached group: `%rtnb attach {run}` (or `rtnb stop {run}`)"
        )
    holder = _this_kernel()
    # Not the batch runner's file: the kernel announces the run (as detached) itself.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != BATCH_RUNS_ENV}
    say(f"starting the detached group of run {run!r} (its host outlives this kernel)")
    try:
        host = (
            ray.remote(SessionHost)
            .options(
                name=actor_name(run),
                namespace=DETACHED_NAMESPACE,
                lifetime="detached",
                num_cpus=0,
                max_concurrency=_HOST_CONCURRENCY,
                max_restarts=0,
                **_host_placement(connection),
            )
            .remote(
                session_class,
                config,
                replay,
                env,
                os.getcwd(),
                list(sys.path),
                idle_seconds(idle_timeout_s),
            )
        )
    except ValueError:  # the name was taken since the look above: a start beside this one
        connection.shutdown()
        raise ConfigError(
            f"run {run!r} already has a detached group: `%rtnb attach {run}`"
        ) from None
    try:
        in_force, start_line, replay_line = _get(host.start.remote(holder))
    except BaseException:
        with contextlib.suppress(Exception):
            ray.kill(host, no_restart=True)
        connection.shutdown()
        raise
    return host, in_force, holder, connection, start_line, replay_line


def _ray_dies_with_this_process() -> bool:
    """Whether the Ray this process uses is its own child (the user's own
    ``ray.init()``): a group on it would end with the kernel."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
        return any("gcs_server" in child.name() for child in children)
    except psutil.Error:
        return False


def _join(address: str | None) -> ClusterConnection | None:
    """The Ray detached groups live on: ``address``, else the Ray this process uses,
    else the running warm Ray (None when there is none)."""
    from rtnb.driver.cluster import join_running_warm_ray

    ray = _ray()
    if address is not None or ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return connect(address)
    if join_running_warm_ray() is None:
        return None
    return ClusterConnection(address="the warm Ray", owned=True, client_mode=False)


def _host_of(run: str, address: str | None) -> tuple[Any, ClusterConnection]:
    connection = _join(address)
    if connection is None:
        raise SessionError(
            f"no detached group of run {run!r}: no warm Ray runs here (give the cluster's "
            "--address if it runs on one)"
        )
    try:
        return _ray().get_actor(actor_name(run), namespace=DETACHED_NAMESPACE), connection
    except ValueError:
        connection.shutdown()
        raise SessionError(
            f"no detached group of run {run!r} on this Ray; `rtnb ps` lists the ones there are"
        ) from None


def attach(
    run: str, *, take: bool = False, address: str | None = None, observe: bool = False
) -> DetachedSession:
    """The detached group of ``run``, held by this kernel from now on (``take``: even
    when another kernel holds it). ``observe``: follow it without holding it (the
    terminal's ``rtnb attach``).

    Example::

        In [1]: session = rtnb.attach("bert-long")
        In [2]: session.wait()
    """
    host, connection = _host_of(run, address)
    holder = None if observe else _this_kernel()
    try:
        config, views = _get(host.hold.remote(holder, take))
    except BaseException:
        connection.shutdown()
        raise
    return DetachedSession.bound_to(host, config, holder, views, connection)


def detached_groups(address: str | None = None) -> list[DetachedGroup]:
    """The detached groups on the warm Ray (or ``address``): ``rtnb ps``."""
    connection = _join(address)
    if connection is None:
        return []
    ray = _ray()
    try:
        names = [
            entry["name"]
            for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry.get("namespace") == DETACHED_NAMESPACE and run_of(entry["name"])
        ]
        rows = []
        for name in sorted(names):
            with contextlib.suppress(ValueError, SessionError):
                actor = ray.get_actor(name, namespace=DETACHED_NAMESPACE)
                rows.append(_get(actor.describe.remote(), timeout=30))
        return rows
    finally:
        connection.shutdown()


def stop_detached(run: str, address: str | None = None) -> None:
    """Free the detached group of ``run`` (``rtnb stop RUN``), held by anyone."""
    host, connection = _host_of(run, address)
    try:
        with contextlib.suppress(SessionError):
            _get(host.free.remote("stopped from a terminal (rtnb stop)"))
        _wait_gone(run)
    finally:
        connection.shutdown()


def _wait_gone(run: str, timeout_s: float = 30.0) -> None:
    """Until the host of ``run`` is gone (its ranks with it)."""
    ray = _ray()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(actor_name(run), namespace=DETACHED_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)
    raise ClusterError(f"the detached group of run {run!r} did not end within {timeout_s:g} s")


def _not_from_a_kernel(what: str) -> SessionError:
    return SessionError(
        f"{what} is not available on a detached group from a kernel; "
        "`%rtnb stop` it and start one without --detached to use it"
    )
