"""A worker group without Ray: N real rank runtimes in this process, each reached
through the rank protocol's calls, with the faults a cluster has made on demand.

``ThreadedGroup`` is a :class:`~rtnb.driver.ranks._group.RankGroup` whose ranks are
:class:`~rtnb.worker._runtime.RankRuntime` objects in threads of the test's own
process (each call a future of a thread pool, as a rank actor serves its calls
concurrently), so a ``Session`` built on it runs the real controller, cell flow,
cell handle, failure policy, stop protocol, checkpoint commits, journal and replay in
milliseconds. What Ray would add (processes, placement, ``torch.distributed``) is
left out: the Ray suite keeps those contract scenarios.

The faults are the group's, as a cluster makes them: ``lose(rank)`` is a rank's
process gone (every call in flight and every later one fails as Ray's do), and
``cut(rank, why)`` a machine that stopped answering. A cell's code reaches them as
``lose_me()`` (its own rank lost where it stands) and ``RANK``.

A process holds one "current" rank for ``rtnb.report()`` and its friends; with
several ranks in one process, :func:`threaded_ranks` points those lookups at the rank
whose cell thread is asking (report's C path then leaves every report to Python).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from rtnb.core._config import SessionConfig
from rtnb.core._messages import CellRequest, RankUpdate
from rtnb.driver.cluster import ClusterConnection, StartProgress
from rtnb.driver.ranks._execution import Execution, RankLost
from rtnb.driver.ranks._group import RankInfo
from rtnb.driver.ranks._local import gather_futures, ready_futures
from rtnb.worker._actor import ACTOR_CONCURRENCY, BATCH_S, POLL_WAIT_S
from rtnb.worker._commands import RankCommand
from rtnb.worker._runtime import RankContext, RankRuntime

_LIVE: list[ThreadedGroup] = []  # the groups whose ranks answer "who am I" now


def _rank_of_this_thread() -> RankRuntime | None:
    me = threading.get_ident()
    for group in list(_LIVE):
        for runtime in group.runtimes:
            if runtime is not None and runtime.cell_thread_id == me:
                return runtime
    return None


@contextlib.contextmanager
def threaded_ranks() -> Iterator[None]:
    """While open, ``rtnb.report()``, ``get_context()``, ``get_checkpoint()`` and a
    checkpoint's state file name the rank whose cell thread calls them."""
    # What a rank's process imports before its first cell: two cell threads importing
    # Ray at once would each see the other's half-made module.
    import ray.train  # noqa: F401
    import torch  # noqa: F401

    from rtnb.driver.ranks import _builder
    from rtnb.storage import _checkpoint
    from rtnb.worker import _api, _reporting, _runtime

    def reports():
        runtime = _rank_of_this_thread()
        return runtime.reports if runtime is not None else None

    def rank() -> int:
        runtime = _rank_of_this_thread()
        return runtime.context.world_rank if runtime is not None else 0

    saved = (
        _runtime.current_runtime,
        _api.current_runtime,
        _reporting.current_reports,
        _checkpoint.current_rank,
        _reporting.RankReports.make_current,
        _builder.check_capacity,
    )
    # Any size fits: the ranks are threads, with no cluster to place them on.
    _builder.check_capacity = lambda *_args, **_kwargs: None
    _runtime.current_runtime = _api.current_runtime = _rank_of_this_thread
    _reporting.current_reports = reports
    _checkpoint.current_rank = rank
    # No rank is "the" rank of this process: report's C path reads this and, finding
    # none, hands every report to the Python path, which asks the thread.
    _reporting.RankReports.make_current = lambda self, current=True: None
    _reporting._CURRENT = None
    _runtime._CURRENT = None
    try:
        yield
    finally:
        (
            _runtime.current_runtime,
            _api.current_runtime,
            _reporting.current_reports,
            _checkpoint.current_rank,
            _reporting.RankReports.make_current,
            _builder.check_capacity,
        ) = saved


class _NoRay(ClusterConnection):
    """Owned (no other cluster's versions to ask), yet nothing of Ray's to let go of:
    the test process's own Ray driver, which other tests use, stays connected."""

    def shutdown(self) -> None:
        pass


def no_ray(*_args: Any, **_kwargs: Any) -> ClusterConnection:
    """A session's ``connector`` for a threaded group: the ranks need no Ray."""
    return _NoRay(address="in this process", owned=True, client_mode=False)


class ThreadedGroup:
    """``config.workers`` rank runtimes in this process; see the module docstring."""

    relays = False

    def __init__(self, config: SessionConfig, run_name: str, storage_path: str) -> None:
        self.config = config
        self.run_name = run_name
        self.storage_path = storage_path
        self.ranks: list[RankInfo] = []
        self.runtimes: list[RankRuntime | None] = []
        self._lost: dict[int, str] = {}
        self._cut: dict[int, str] = {}
        self._pending: dict[int, set[concurrent.futures.Future]] = {}
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def world_size(self) -> int:
        return len(self.runtimes)

    def calls_path(self, rank: int) -> str:
        return "in process"

    def start(self, progress: StartProgress | None = None) -> None:
        size = self.config.workers
        self._pool = concurrent.futures.ThreadPoolExecutor(
            ACTOR_CONCURRENCY * size, thread_name_prefix="rtnb-threaded-rank"
        )
        for rank in range(size):
            context = RankContext(
                world_rank=rank,
                world_size=size,
                run_name=self.run_name,
                storage_path=self.storage_path,
                backend="gloo",
                pid=os.getpid(),
            )
            runtime = RankRuntime(context, capture_output=False)
            runtime.push({"RANK": rank, "lose_me": self._loser(rank)})
            self.runtimes.append(runtime)
            self._pending[rank] = set()
        self.ranks = [
            RankInfo(
                rank=r,
                pid=os.getpid(),
                hostname="threads",
                node_ip="127.0.0.1",
                node_id="t",
                device="cpu",
            )
            for r in range(size)
        ]
        _LIVE.append(self)

    def shutdown(self, graceful: bool = True, timeout_s: float = 5.0) -> None:
        for rank in range(len(self.runtimes)):
            self._end(rank, "the group was shut down")
        with contextlib.suppress(ValueError):
            _LIVE.remove(self)
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # ---- faults ------------------------------------------------------------------------
    def lose(self, rank: int, why: str = "the actor died unexpectedly") -> None:
        """Rank ``rank``'s process is gone: its calls in flight and later ones fail."""
        self._end(rank, why)

    def cut(self, rank: int, why: str) -> None:
        """Rank ``rank``'s machine stopped answering (its calls never would)."""
        self._cut[rank] = why

    def _loser(self, rank: int) -> Callable[[], None]:
        def lose_me() -> None:
            self.lose(rank)
            # The process is gone: nothing after this line of the cell runs.
            raise SystemExit

        return lose_me

    def _end(self, rank: int, why: str) -> None:
        with self._lock:
            if rank in self._lost:
                return
            self._lost[rank] = why
            pending, self._pending[rank] = self._pending.get(rank, set()), set()
            runtime = self.runtimes[rank]
            self.runtimes[rank] = None
        for call in pending:
            if not call.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    call.set_exception(RankLost(why))
        if runtime is not None:
            runtime.interrupt()
            runtime.close()

    # ---- the rank protocol -------------------------------------------------------------
    def execute(self, request: CellRequest, ranks: list[int]) -> Execution:
        return Execution(self, request, ranks)

    def next_token(self) -> int | None:
        return None

    def where(self, rank: int) -> str | None:
        return None

    def cut_off(self) -> dict[int, str]:
        return dict(self._cut)

    def relay(self, request: CellRequest, ranks: list[int], wait_s: float) -> Any:
        raise AssertionError("a threaded group does not relay")

    def relay_answers(self, result: Any) -> dict[int, RankUpdate | None]:
        return {}

    def _call(self, rank: int, fn: Callable[[RankRuntime], Any]) -> concurrent.futures.Future:
        answer: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            runtime = self.runtimes[rank] if rank < len(self.runtimes) else None
            if runtime is None or self._pool is None:
                answer.set_exception(RankLost(self._lost.get(rank, "no such rank")))
                return answer
            self._pending[rank].add(answer)

        def call() -> None:
            try:
                result = fn(runtime)
            except BaseException as exc:  # noqa: BLE001 - the caller's future says it
                outcome: tuple[str, Any] = ("error", exc)
            else:
                outcome = ("ok", result)
            with self._lock:
                self._pending.get(rank, set()).discard(answer)
            if answer.done():  # the rank was lost meanwhile: its answer never came
                return
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                if outcome[0] == "ok":
                    answer.set_result(outcome[1])
                else:
                    answer.set_exception(outcome[1])

        self._pool.submit(call)
        return answer

    def run(self, rank: int, request: CellRequest) -> Any:
        def run(runtime: RankRuntime) -> RankUpdate:
            runtime.start_cell(request)
            return runtime.wait(POLL_WAIT_S, BATCH_S)

        return self._call(rank, run)

    def poll(self, rank: int) -> Any:
        return self._call(rank, lambda runtime: runtime.wait(POLL_WAIT_S, BATCH_S))

    def command(self, rank: int, command: RankCommand, payload: Any = None) -> Any:
        return self._call(rank, lambda runtime: runtime.command(command, payload))

    def share(self, data: bytes) -> Any:
        return data

    def hand_datasets(self, datasets: dict[str, Any], data_config: Any) -> list[Any]:
        raise AssertionError("a threaded group takes no datasets")

    def check_data_room(self, datasets: dict[str, Any]) -> None:
        """Nothing to check: no pipeline runs beside these ranks."""

    def data_progress(self) -> tuple[list[dict], dict[str, float]]:
        return [], {}

    # ---- waiting on calls --------------------------------------------------------------
    def gather(self, calls: list[Any], timeout_s: float) -> list[Any]:
        return gather_futures(calls, timeout_s)

    def take_ready(self, calls: list[Any], timeout_s: float) -> tuple[list[Any], list[Any]]:
        return ready_futures(calls, timeout_s)
