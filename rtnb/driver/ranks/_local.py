"""Local mode (``--workers 0``): one rank in the kernel's own process.

:class:`LocalGroup` is a :class:`~rtnb.driver.ranks._group.RankGroup` whose only rank is a
:class:`RankRuntime` in this process, as Ray Train's local mode
(``ScalingConfig(num_workers=0)``) runs the training function in the driver. Cells
go through the same flows (journal, live reports, checkpoints, stop, recovery), so
switching to ranks on Ray (``%rtnb scale 2``) needs no code change, while the
training code runs where ``breakpoint()``, ``%debug`` and an IDE's debugger reach
it. No Ray is started for it.

A pending call is a ``concurrent.futures.Future`` of a small thread pool (as a rank
actor serves a long-poll and control calls at once). torch.distributed gets a
process group of one (gloo, or nccl with ``--gpu``), so code that asks for its rank
or all-reduces runs unchanged; one the user's own code made is left alone.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import os
import socket
import sys
import threading
from typing import Any

from rtnb.core._config import SessionConfig
from rtnb.core._messages import CellRequest, RankUpdate
from rtnb.driver.cluster import StartProgress
from rtnb.driver.ranks._execution import Execution, RankLost
from rtnb.driver.ranks._group import RankInfo
from rtnb.errors import ClusterError, one_line
from rtnb.worker._actor import ACTOR_CONCURRENCY, BATCH_S, POLL_WAIT_S
from rtnb.worker._commands import RankCommand, SetDatasets
from rtnb.worker._runtime import RankContext, RankRuntime

__all__ = ["LocalGroup"]

# How long a cell's input() (pdb's prompt) waits for the lines written before it
# to reach the notebook, so a breakpoint's location shows above its prompt.
_SHOWN_BEFORE_INPUT_S = 2.0


class LocalGroup:
    """One rank in the kernel's process; see the module docstring."""

    relays = False

    def __init__(self, config: SessionConfig, run_name: str, storage_path: str) -> None:
        self.config = config
        self.run_name = run_name
        self.storage_path = storage_path
        self.ranks: list[RankInfo] = []
        self.runtime: RankRuntime | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._own_process_group = False
        self._delivery = _Delivery()
        self._breakpoints = _Breakpoints()

    @property
    def world_size(self) -> int:
        return 1 if self.runtime is not None else 0

    def calls_path(self, rank: int) -> str:
        return "in process"

    def start(self, progress: StartProgress | None = None) -> None:
        progress = progress or StartProgress()
        cfg = self.config
        with progress.phase("ranks", "running rank 0 in this kernel (local mode)"):
            import torch
            import torch.distributed as dist

            device = "cpu"
            if cfg.gpu:
                if not torch.cuda.is_available():
                    raise ClusterError(
                        "--workers 0 --gpu trains on this machine's GPU, but torch sees none "
                        "here: drop --gpu, or use --workers N to train on the cluster's GPUs"
                    )
                device = f"cuda:{torch.cuda.current_device()}"
            context = RankContext(
                world_rank=0,
                world_size=1,
                device=device,
                run_name=self.run_name,
                storage_path=self.storage_path,
                backend=cfg.backend or "gloo",
                pid=os.getpid(),
            )
            self._pool = concurrent.futures.ThreadPoolExecutor(
                ACTOR_CONCURRENCY, thread_name_prefix="rtnb-local"
            )
            self.runtime = RankRuntime(context, in_kernel=True)
            self._breakpoints.install(self.runtime.cell_thread_id)
            from rtnb.worker import _compat, _torchrun

            _compat.install_ray_train_aliases()
            if not dist.is_initialized():
                dist.init_process_group(
                    backend=context.backend, store=dist.HashStore(), rank=0, world_size=1
                )
                self._own_process_group = True
                _torchrun.install_torchrun_compat()
            self.ranks = [
                RankInfo(
                    rank=0,
                    pid=os.getpid(),
                    hostname=socket.gethostname(),
                    node_ip="127.0.0.1",
                    node_id="local",
                    device=device,
                )
            ]

    def shutdown(self, graceful: bool = True, timeout_s: float = 5.0) -> None:
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            # A cell still running here cannot be killed (it is a thread of the
            # kernel): stopping it was the stop protocol's part.
            runtime.close()
        from rtnb.worker import _compat, _torchrun

        if self._own_process_group:
            import torch.distributed as dist

            _torchrun.remove_torchrun_compat()
            if dist.is_initialized():
                dist.destroy_process_group()
            self._own_process_group = False
        _compat.remove_ray_train_aliases()
        self._delivery.close()
        self._breakpoints.remove()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self.ranks = []

    # ---- the rank protocol -------------------------------------------------------------
    def execute(self, request: CellRequest, ranks: list[int]) -> Execution:
        return Execution(self, request, ranks)

    def next_token(self) -> int | None:
        return None

    @staticmethod
    def where(rank: int) -> str | None:
        return None  # every rank is this kernel

    @staticmethod
    def cut_off() -> dict[int, str]:
        return {}

    def relay(self, request: CellRequest, ranks: list[int], wait_s: float) -> Any:
        raise AssertionError("a local group does not relay")

    @staticmethod
    def relay_answers(result: Any) -> dict[int, RankUpdate | None]:
        return {}

    def _call(self, fn, *args) -> concurrent.futures.Future:
        if self._pool is None or self.runtime is None:
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(RankLost("the local rank was stopped"))
            return failed
        return self._pool.submit(fn, *args)

    def _rank(self) -> RankRuntime:
        runtime = self.runtime
        if runtime is None:
            raise RankLost("the local rank was stopped")
        return runtime

    def run(self, rank: int, request: CellRequest) -> Any:
        self._delivery.before_cell(self._rank())

        def run() -> RankUpdate:
            runtime = self._rank()
            runtime.start_cell(request)
            return self._delivery.sent(runtime.wait(POLL_WAIT_S, BATCH_S))

        return self._call(run)

    def poll(self, rank: int) -> Any:
        def poll() -> RankUpdate:
            runtime = self._rank()
            return self._delivery.sent(
                runtime.wait(POLL_WAIT_S, 0.0 if self._delivery.asked() else BATCH_S)
            )

        return self._call(poll)

    def command(self, rank: int, command: RankCommand, payload: Any = None) -> Any:
        return self._call(lambda: self._rank().command(command, payload))

    def share(self, data: bytes) -> Any:
        return data

    def hand_datasets(self, datasets: dict[str, Any], data_config: Any) -> list[Any]:
        """Each dataset whole, as this rank's iterator (a group of one splits nothing)."""
        shards = {name: dataset.iterator() for name, dataset in datasets.items()}
        return [self.command(0, SetDatasets(shards))]

    def check_data_room(self, datasets: dict[str, Any]) -> None:
        """The rank is the kernel: its pipeline shares the kernel's Ray as any would."""

    def data_progress(self) -> tuple[list[dict], dict[str, float]]:
        return [], {}

    # ---- waiting on calls --------------------------------------------------------------
    def gather(self, calls: list[Any], timeout_s: float) -> list[Any]:
        self._delivery.shown()
        return gather_futures(calls, timeout_s)

    def take_ready(self, calls: list[Any], timeout_s: float) -> tuple[list[Any], list[Any]]:
        # The driver is back for more: what it was given before is applied (shown).
        self._delivery.shown()
        return ready_futures(calls, timeout_s)


def gather_futures(calls: list[Any], timeout_s: float) -> list[Any]:
    """The results of rank calls made as futures (ranks in this process), in order; a
    call that raised is a lost rank."""
    _done, pending = concurrent.futures.wait(calls, timeout=timeout_s)
    if pending:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    results = []
    for call in calls:
        error = call.exception()
        if error is not None:
            raise RankLost(one_line(error)) from None
        results.append(call.result())
    return results


def ready_futures(calls: list[Any], timeout_s: float) -> tuple[list[Any], list[Any]]:
    """The futures done within ``timeout_s`` (at least one, unless none is), with
    their results (a lost rank for one that raised)."""
    done, _ = concurrent.futures.wait(
        calls, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
    )
    ready = [c for c in calls if c in done]
    results = []
    for call in ready:
        error = call.exception()
        results.append(RankLost(one_line(error)) if error is not None else call.result())
    return ready, results


class _Delivery:
    """Lets a cell's ``input()`` (pdb's prompt above all) wait until what the cell
    printed before it is in the notebook: its lines reach the notebook through the
    long-poll, so without this a breakpoint's location would show below its prompt.
    ``builtins.input`` is wrapped while a cell may ask for input (ipykernel sets it
    for the cell being executed and puts it back afterwards). Counted in characters:
    those the rank wrote, those handed to the driver in updates, and of those the
    ones the driver has applied (it is back for the next answer)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting = False  # a cell's input() waits for its lines to be shown
        self._sent = 0
        self._shown = 0
        self._wrapped: tuple | None = None  # (the wrapper, the input it wraps)

    def before_cell(self, runtime: RankRuntime) -> None:
        current = builtins.input
        if getattr(current, "__rtnb_local__", False):
            return
        delivery = self

        def input(prompt: object = "") -> str:  # noqa: A001 - the builtin it stands for
            delivery.wait_until_shown(runtime)
            return current(prompt)

        input.__rtnb_local__ = True  # type: ignore[attr-defined]
        builtins.input = input
        self._wrapped = (input, current)

    def close(self) -> None:
        """Put ``builtins.input`` back where it is still the wrapper (a script; in a
        kernel, ipykernel puts its own back after each cell)."""
        wrapped, self._wrapped = self._wrapped, None
        if wrapped is not None and builtins.input is wrapped[0]:
            builtins.input = wrapped[1]

    def asked(self) -> bool:
        return self._waiting

    def sent(self, update: RankUpdate) -> RankUpdate:
        if update.output:
            with self._cond:
                self._sent += sum(len(text) for _stream, text in update.output)
        return update

    def shown(self) -> None:
        with self._cond:
            if self._shown != self._sent:
                self._shown = self._sent
                self._cond.notify_all()

    def wait_until_shown(self, runtime: RankRuntime) -> None:
        """Called in the cell thread: returns once every character written so far
        has reached the driver and been applied (or after a bound)."""
        target = runtime.written_chars
        with self._cond:
            self._waiting = True
        try:
            runtime.wake_poll()
            with self._cond:
                self._cond.wait_for(lambda: self._shown >= target, _SHOWN_BEFORE_INPUT_S)
        finally:
            with self._cond:
                self._waiting = False


class _Breakpoints:
    """``breakpoint()`` in a local cell opens pdb there, answered in the notebook.

    ipykernel points ``sys.breakpointhook`` at debugpy, which does nothing unless
    JupyterLab's debugger is attached: a cell's ``breakpoint()`` would pass
    silently. In the cell thread this hook opens pdb (its prompt is the notebook's
    input box) unless a debugger client is attached (then debugpy stops there) or
    ``PYTHONBREAKPOINT=0``; every other thread keeps the hook it had."""

    def __init__(self) -> None:
        self._previous = None
        self._hook = None

    def install(self, cell_thread: int | None) -> None:
        previous = sys.breakpointhook

        def hook(*args, **kwargs):
            if threading.get_ident() != cell_thread or _debugger_attached():
                return previous(*args, **kwargs)
            if os.environ.get("PYTHONBREAKPOINT") == "0":
                return None
            _stdlib_pdb()().set_trace(sys._getframe(1))
            return None

        self._previous, self._hook = previous, hook
        sys.breakpointhook = hook

    def remove(self) -> None:
        if self._hook is not None and sys.breakpointhook is self._hook:
            sys.breakpointhook = self._previous
        self._previous = self._hook = None


def _stdlib_pdb() -> type:
    """Python's own Pdb: a kernel's ``pdb.Pdb`` is IPython's, which stops on the
    return from the hook that called it instead of at the cell's next line."""
    import pdb

    return next(c for c in pdb.Pdb.__mro__ if c.__module__ == "pdb" and c.__name__ == "Pdb")


def _debugger_attached() -> bool:
    debugpy = sys.modules.get("debugpy")
    try:
        return bool(debugpy is not None and debugpy.is_client_connected())
    except Exception:  # noqa: BLE001 - an older debugpy: no client then
        return False
