"""A detached group's host: the session that outlives its notebook's kernel.

``%rtnb start --detached`` does not keep the session in the kernel. It starts a
:class:`SessionHost`, a detached Ray actor named after the run, which holds an
ordinary :class:`rtnb.Session` (the same controller, cell flow, checkpoint commits,
recovery and journal as any session) and drives its cells. The ranks are the host's
actors, so they live as long as the host does, not as long as a kernel: a kernel
that dies, restarts or is culled leaves the cell running, its reports going into
the run's metrics record and its checkpoints being committed.

Kernels (and ``rtnb attach`` in a terminal) follow the host (``detached/_client.py``):
every report it received since the start, the cells' output and their states, in
order, through :meth:`SessionHost.follow`. One kernel at a time *holds* it (beats
every second; :data:`HOLDER_STALE_S` without a beat and it holds nothing). A host
with no cell running and no kernel holding it for its idle time frees its ranks and
ends (``RTNB_DETACHED_IDLE_S``, default :data:`DEFAULT_IDLE_S`).

This module never imports the session's module (the session's ``detached=True``
reaches it, and the class the host builds is handed in), so there is no cycle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rtnb.core._values import to_portable
from rtnb.errors import SessionError, one_line
from rtnb.storage._layout import DETACHED_MARK

__all__ = [
    "DEFAULT_IDLE_S",
    "DETACHED_NAMESPACE",
    "HOLDER_STALE_S",
    "IDLE_ENV",
    "CellOutcome",
    "CellView",
    "DetachedGroup",
    "FeedChunk",
    "Holder",
    "SessionHost",
    "actor_name",
]

DETACHED_NAMESPACE = "rtnb-detached"
_PREFIX = "rtnb-run:"
IDLE_ENV = "RTNB_DETACHED_IDLE_S"
DEFAULT_IDLE_S = 1800.0
# A holder beats every second; a kernel that died is let go of after this long.
HOLDER_STALE_S = 5.0
# Output lines kept for followers (the run's logs/ keep every one).
_OUTPUT_KEPT = 20_000


def actor_name(run: str) -> str:
    return _PREFIX + run


def run_of(actor: str) -> str | None:
    return actor[len(_PREFIX) :] if actor.startswith(_PREFIX) else None


def idle_seconds(given: float | None = None) -> float:
    if given is not None:
        return given
    try:
        return float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_S))
    except ValueError:
        return DEFAULT_IDLE_S


@dataclass(frozen=True)
class Holder:
    """Who holds a host: ``kernel`` for people ("kernel pid 812 on laptop"), ``token``
    to tell two clients apart."""

    kernel: str
    token: str
    pid: int = 0
    hostname: str = ""

    def dead(self) -> bool:
        """Known dead: a process of this machine that is gone (a zombie too), by the
        warm pool's own rule for its kernels."""
        from rtnb.driver.cluster import kernel_alive

        return (
            bool(self.pid)
            and self.hostname == socket.gethostname()
            and not kernel_alive(self.pid, None)
        )


@dataclass
class CellView:
    """A cell of the host as followers see it."""

    cell_id: int
    name: str
    background: bool
    ranks: list[int]
    started_at: float
    done: bool = False
    error: BaseException | None = None
    restarted_from: str | None = None
    recoveries: int = 0
    ended_at: float | None = None


@dataclass
class CellOutcome:
    """A cell's end: its value per rank (as ``to_portable`` packs a rank's value:
    a value only the host can unpickle, or too large, still prints), or its error."""

    values: dict[int, tuple[bytes | None, str]] = field(default_factory=dict)
    error: BaseException | None = None


@dataclass
class FeedChunk:
    """What a follower had not seen: reports (``("begin", ranks, total_steps)`` or
    ``("batch", rank, ReportBatch)``) and output lines ``(cell_id, rank, stream,
    text)`` after its cursors, every cell that changed, and whether the group is gone."""

    reports_at: int
    output_at: int
    cells_at: int
    reports: list[tuple] = field(default_factory=list)
    output: list[tuple[int, int, str, str]] = field(default_factory=list)
    cells: list[CellView] = field(default_factory=list)
    taken_by: str | None = None  # this follower's hold went to another kernel
    ended: str | None = None  # the group was freed (why)
    reports_end: int = 0  # how many reports the host had when it answered


@dataclass
class DetachedGroup:
    """A row of ``rtnb ps``."""

    run: str
    state: str
    ranks: int
    step: int | None
    since: float
    cpus: float
    gpus: float
    held_by: str | None
    cell: str | None
    idle_for_s: float | None
    idle_timeout_s: float
    storage: str


class SessionHost:
    """The detached session's actor body (plain Python; ``_attached`` wraps it).

    Calls that change the group take the caller's token and are refused to a kernel
    that does not hold it, and to everyone once the group is being freed."""

    def __init__(
        self,
        session_class: type,
        config: Any,
        replay: bool,
        env: dict[str, str],
        cwd: str,
        path: list[str],
        idle_s: float,
    ) -> None:
        # The kernel's environment, directory and import path: the ranks the session
        # starts inherit them, as from a kernel (credentials, user modules).
        os.environ.update(env)
        with contextlib.suppress(OSError):
            os.chdir(cwd)
        sys.path[:0] = [p for p in path if p not in sys.path]
        self._lock = threading.Condition()
        # Built in start(): a bad option or storage then comes back as its own line.
        self._make_session = lambda: session_class(config, replay=replay)
        self._session: Any = None
        self._run_name = str(config.name)
        self._idle_s = idle_s
        self._reports: list[tuple] = []
        self._output: deque[tuple[int, int, str, str]] = deque()
        self._output_base = 0
        self._cells: dict[int, Any] = {}
        self._views: dict[int, CellView] = {}
        self._cell_versions: dict[int, int] = {}
        self._version = 0
        self._last_background: int | None = None
        self._holder: Holder | None = None
        self._beat = 0.0
        self._taken: dict[str, str] = {}
        self._since = time.time()
        self._idle_since: float | None = None
        self._ended: str | None = None
        self._pool: Any = None

    # ---- lifecycle -------------------------------------------------------------------
    def start(self, holder: Holder | None) -> tuple[Any, str, str | None]:
        """Start the group; the config in force, the start's line, the replay's."""
        if holder is not None:
            self._hold(holder, take=False)
        session = self._make_session()
        session.metrics.subscribe(self._on_batch)
        session.metrics.on_begin(self._on_begin)
        self._pool = _lease_warm_pool(session.run_name)
        self._session = session
        try:
            session.start()
        except BaseException:
            self.free("its start failed")
            raise
        with self._lock:
            self._beat = time.monotonic()  # the start took a while: the holder is fresh
        # The runs table (any kernel, `rtnb runs`) tells this run needs no kernel.
        session.run_dir.write_json(DETACHED_MARK, {"since": self._since})
        threading.Thread(target=self._watch_idle, name="rtnb-detached-idle", daemon=True).start()
        return session.config, str(session.last_start), _text(session.last_replay)

    def free(self, why: str) -> None:
        """Stop the session (every cell, every rank), let the warm Ray go, end."""
        with self._lock:
            if self._ended is not None:
                return
            self._ended = why
            self._lock.notify_all()
        self._end()

    def _end(self) -> None:
        session = self._session
        try:
            if session is not None:
                session.stop()
                session.run_dir.remove(DETACHED_MARK)
        finally:
            if self._pool is not None:
                self._pool.detach()
            threading.Thread(target=_end_this_actor, daemon=True).start()

    def _live(self, token: str | None) -> Any:
        """The session, for a call that uses it: refused once the group is being freed,
        and to a kernel that does not hold it (``token`` None: a terminal, a view)."""
        with self._lock:
            if self._ended is not None or self._session is None:
                raise SessionError(
                    f"the detached group of run {self._run_name!r} "
                    + (f"was freed: {self._ended}" if self._ended else "is still starting")
                )
            holder = self._holder
            if token is not None and holder is not None and holder.token != token:
                raise SessionError(
                    f"this kernel does not hold run {self._run_name!r}: {holder.kernel} "
                    f"took it over; `%rtnb attach {self._run_name} --take` takes it back"
                )
            return self._session

    # ---- holding ---------------------------------------------------------------------
    def hold(self, holder: Holder | None, take: bool) -> tuple[Any, list[CellView]]:
        """``holder`` is now the kernel of this group (``take``: even when another
        kernel holds it; None: only followed); the config in force and the cells."""
        session = self._live(None)
        if holder is not None:
            self._hold(holder, take)
        with self._lock:
            return session.config, _copies(self._views)

    def _hold(self, holder: Holder, take: bool) -> None:
        with self._lock:
            if self._ended is not None:
                raise SessionError(f"the detached group of run {self._run_name!r} was freed")
            current = self._holder
            if current is not None and current.token != holder.token:
                if self._fresh() and not take:
                    raise SessionError(
                        f"run {self._run_name!r} is attached to {current.kernel}: "
                        f"`%rtnb attach {self._run_name} --take` takes it over "
                        "(that kernel is told and lets go)"
                    )
                # Told on its next call, alive or back from a pause: it holds nothing.
                self._taken[current.token] = holder.kernel
            self._holder, self._beat = holder, time.monotonic()
            self._idle_since = None

    def release(self, token: str) -> None:
        with self._lock:
            if self._holder is not None and self._holder.token == token:
                self._holder = None

    def _fresh(self) -> bool:
        holder = self._holder
        return (
            holder is not None
            and time.monotonic() - self._beat < HOLDER_STALE_S
            and not holder.dead()
        )

    # ---- following -------------------------------------------------------------------
    def follow(
        self,
        reports_at: int,
        output_at: int,
        cells_at: int,
        token: str | None,
        timeout_s: float,
        max_reports: int = 5000,
    ) -> FeedChunk:
        """What came after the cursors, once something did (or after ``timeout_s``).
        A holder's call is its beat."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                taken = self._taken.pop(token, None) if token else None
                if token and self._holder is not None and self._holder.token == token:
                    self._beat = time.monotonic()
                output_end = self._output_base + len(self._output)
                news = (
                    len(self._reports) > reports_at
                    or output_end > output_at
                    or self._version > cells_at
                )
                left = deadline - time.monotonic()
                if news or taken or self._ended or left <= 0:
                    break
                self._lock.wait(min(left, 1.0))
            reports = self._reports[reports_at : reports_at + max_reports]
            start = max(output_at, self._output_base) - self._output_base
            output = [self._output[i] for i in range(start, len(self._output))]
            changed = {
                cid: self._views[cid] for cid, v in self._cell_versions.items() if v > cells_at
            }
            return FeedChunk(
                reports_at + len(reports),
                output_end,
                self._version,
                reports,
                output,
                _copies(changed),
                taken,
                self._ended,
                len(self._reports),
            )

    def _on_batch(self, rank: int, batch: Any) -> None:
        with self._lock:
            self._reports.append(("batch", rank, batch))
            self._lock.notify_all()

    def _on_begin(self, ranks: list[int], total_steps: int | None) -> None:
        with self._lock:
            self._reports.append(("begin", list(ranks), total_steps))
            self._lock.notify_all()

    def _on_output(self, cell_id: int, rank: int, stream: str, text: str) -> None:
        with self._lock:
            self._output.append((cell_id, rank, stream, text))
            if len(self._output) > _OUTPUT_KEPT:
                self._output.popleft()
                self._output_base += 1
            self._lock.notify_all()

    # ---- cells -----------------------------------------------------------------------
    def run(
        self, code: str, background: bool, options: dict[str, Any], token: str | None
    ) -> CellView:
        """Start ``code`` on the ranks in the host (every cell runs there, so that it
        goes on without a kernel)."""
        sink = _CellSink(self._on_output)
        handle = self._live(token).run_background(code, output=sink, **options)
        view = CellView(
            handle.cell_id, handle.name, background, list(handle.ranks), handle.started_at
        )
        with self._lock:
            self._cells[handle.cell_id] = handle
            self._views[handle.cell_id] = view
            self._changed(handle.cell_id)
            if background:
                self._last_background = handle.cell_id
            answer = dataclasses.replace(view)
        sink.known_as(handle.cell_id)
        handle.add_done_callback(self._ended_cell)
        return answer

    def resume(self, checkpoint_id: str, run: str | None, token: str | None) -> CellView | None:
        """The last training cell again from a checkpoint, in the background (None: no
        training cell ran yet; the next one starts from it)."""
        plan = self._live(token).prepare_resume(checkpoint_id, run=run)
        return None if plan.code is None else self.run(plan.code, True, {}, token)

    def _ended_cell(self, handle: Any) -> None:
        with self._lock:
            view = self._views[handle.cell_id]
            view.done, view.error = True, _sendable_error(handle.error)
            view.restarted_from = handle.restarted_from
            view.recoveries, view.ended_at = handle.recoveries, time.time()
            self._changed(handle.cell_id)

    def _changed(self, cell_id: int) -> None:
        self._version += 1
        self._cell_versions[cell_id] = self._version
        self._lock.notify_all()

    def outcome(self, cell_id: int | None, timeout_s: float) -> CellOutcome | None:
        """The cell's end (the last background cell's for None); None while it runs."""
        with self._lock:
            cell_id = self._last_background if cell_id is None else cell_id
            handle = self._cells.get(cell_id) if cell_id is not None else None
        if handle is None:
            raise SessionError("no background cell to wait for")
        try:
            value = handle.wait(timeout_s)
        except TimeoutError:
            return None
        except BaseException as exc:  # noqa: BLE001 - the cell's error, kept
            return CellOutcome(error=_sendable_error(exc))
        return CellOutcome(values={rank: to_portable(item) for rank, item in value.items()})

    def stop_cell(self, cell_id: int, reason: str, token: str | None) -> None:
        self._live(token)
        handle = self._cells.get(cell_id)
        if handle is not None:
            handle.stop(reason)

    def call(self, name: str, args: tuple, kwargs: dict, token: str | None) -> Any:
        """One of the session's own calls (pull, push, status, scale, ...), or the
        value of one of its properties."""
        session = self._live(token)
        attribute = getattr(session, name)
        result = attribute(*args, **kwargs) if callable(attribute) else attribute
        return None if result is session else result

    def after_change(self) -> tuple[Any, str | None, str | None]:
        """After a scale or restart: the config in force, the replay's line and the
        growth's."""
        session = self._live(None)
        return session.config, _text(session.last_replay), session.last_growth

    def delete_checkpoint(self, checkpoint_id: str, run: str | None, token: str | None) -> None:
        """The browser's Delete, through the host's store: it guards what a recovery
        would load and owns the index."""
        self._live(token).checkpoint_store(run).delete(checkpoint_id)

    def world_size(self) -> int:
        return self._live(None).world_size

    # ---- rtnb ps / idle --------------------------------------------------------------
    def describe(self) -> DetachedGroup:
        session = self._session
        with self._lock:
            held = self._holder.kernel if self._fresh() and self._holder else None
            running = [v for v in self._views.values() if not v.done]
            idle_for = None if self._idle_since is None else time.monotonic() - self._idle_since
            ended = self._ended
        if session is None or ended is not None:
            state = "stopping" if ended is not None else "starting"
            return DetachedGroup(
                self._run_name,
                state,
                0,
                None,
                self._since,
                0.0,
                0.0,
                held,
                None,
                None,
                self._idle_s,
                "",
            )
        config = session.config
        last = session.metrics.last
        ranks = session.world_size if session.started else 0
        return DetachedGroup(
            run=session.run_name,
            state=str(session.state),
            ranks=ranks,
            step=max((r.step for r in last.values()), default=None),
            since=self._since,
            cpus=ranks * config.cpus_per_worker if not config.local else 0.0,
            gpus=float(ranks) if config.gpu else 0.0,
            held_by=held,
            cell=running[-1].name if running else None,
            idle_for_s=idle_for,
            idle_timeout_s=self._idle_s,
            storage=config.storage_path,
        )

    def _watch_idle(self) -> None:
        while True:
            time.sleep(0.5)
            with self._lock:
                if self._ended is not None:
                    return
                busy = self._fresh() or any(not v.done for v in self._views.values())
                now = time.monotonic()
                if busy:
                    self._idle_since = None
                    continue
                if self._idle_since is None:
                    self._idle_since = now
                if now - self._idle_since < self._idle_s:
                    continue
                # Decided and marked in one critical section: an attach or a cell that
                # comes now is refused rather than freed under it.
                self._ended = (
                    f"no cell ran and no kernel was attached for {self._idle_s:g} s "
                    f"(the detached idle timeout, {IDLE_ENV})"
                )
                self._lock.notify_all()
            self._end()
            return


def _copies(views: dict[int, CellView]) -> list[CellView]:
    """Copies taken under the lock: Ray pickles the answer after it is let go."""
    return [dataclasses.replace(view) for view in views.values()]


class _CellSink:
    """A host cell's output sink from its first line on: lines before the cell's id
    is known wait here, in order, and go to the feed once it is."""

    def __init__(self, feed: Any) -> None:
        self._feed = feed
        self._lock = threading.Lock()
        self._cell_id: int | None = None
        self._early: list[tuple[int, str, str]] = []

    def __call__(self, rank: int, stream: str, text: str) -> None:
        with self._lock:
            if self._cell_id is None:
                self._early.append((rank, stream, text))
                return
            self._feed(self._cell_id, rank, stream, text)

    def known_as(self, cell_id: int) -> None:
        with self._lock:
            self._cell_id = cell_id
            for line in self._early:
                self._feed(cell_id, *line)
            self._early.clear()


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _sendable_error(error: BaseException | None) -> BaseException | None:
    """A cell's error as a kernel can receive it: itself when it pickles, else its line."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - an exception class only the ranks have
        return SessionError(one_line(error))


def _lease_warm_pool(run: str) -> Any:
    """On the warm Ray: take its spare ranks as a kernel would (this process holds the
    lease, so a kernel's death takes nothing), and keep the warm Ray from ending
    while this group runs. None on another Ray."""
    from rtnb.driver.cluster import warm_lease_in_host

    return warm_lease_in_host(os.getpid(), run)


def _end_this_actor() -> None:
    import ray

    time.sleep(0.2)  # the free() call's answer goes out first
    with contextlib.suppress(Exception):
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
