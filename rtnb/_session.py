"""The driver-side API: one persistent worker group and the cells run on it.

The magics are a thin layer over :class:`Session`; everything here also works
from a plain Python script::

    with rtnb.Session(workers=2) as session:
        session.run("import torch.distributed as dist; x = dist.get_rank()")
        print(session.pull("x"))          # [0, 1]
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import keyword
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from rtnb._cell import CellHandle, OutputSink, _Restart, print_sink
from rtnb._checkpoint import Checkpoint
from rtnb._checkpoints import CheckpointStore
from rtnb._cluster import ClusterConnection, connect
from rtnb._config import SessionConfig, parse_ranks
from rtnb._group import WorkerGroup
from rtnb._metrics import MetricsStore
from rtnb._metricslog import MetricsLog
from rtnb._result import Result, mean_of_last
from rtnb._rundir import BATCH_RUNS_ENV, RunDirectory
from rtnb._state import GroupState, StateChange, StateMachine
from rtnb._status import GroupStatus, RankStatus
from rtnb._tensorboard import TensorBoardExporter
from rtnb._values import PerRank, from_portable
from rtnb.errors import (
    CellError,
    CheckpointError,
    ConfigError,
    RtnbError,
    SessionError,
    WorkerGroupError,
)

__all__ = ["Session"]

_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()


class Session:
    """A Ray worker group whose ranks keep their Python state across cells.

    Takes the options of ``%rtnb start`` as keyword arguments (see
    :class:`SessionConfig`), or a ready ``config``. ``group_factory`` lets tests
    substitute the worker group.
    """

    def __init__(
        self,
        config: SessionConfig | None = None,
        *,
        group_factory: Callable[[SessionConfig, str, str], WorkerGroup] | None = None,
        connector: Callable[..., ClusterConnection] | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise ConfigError("pass either a SessionConfig or keyword options, not both")
        try:
            self.config = config or SessionConfig(**options)
        except TypeError as exc:
            raise ConfigError(f"unknown Session option: {exc}") from None
        self.run_name = self.config.name or time.strftime("run-%Y%m%d-%H%M%S")
        self.run_dir = RunDirectory(self.config.storage_path, self.run_name)
        self.checkpoints = CheckpointStore(
            self.run_dir, self.config.keep, self.config.score, self.config.mode
        )
        self._chosen_checkpoint: Checkpoint | None = None
        self.state_machine = StateMachine()
        self.metrics = MetricsStore()
        self.history: list[str] = []
        self.connection: ClusterConnection | None = None
        self._group: WorkerGroup | None = None
        self._group_factory = group_factory or WorkerGroup
        self._connector = connector or connect
        self._cell_ids = itertools.count(1)
        self._active: CellHandle | None = None
        self._last_background: CellHandle | None = None
        self._last_error: BaseException | None = None
        self._last_training_code: str | None = None
        self.failures = 0  # group rebuilds spent on --max-failures
        self._lock = threading.RLock()
        _LIVE.add(self)

    # ---- lifecycle ---------------------------------------------------------------------
    @property
    def state(self) -> GroupState:
        return self.state_machine.state

    def on_state_change(self, callback: Callable[[StateChange], None]) -> Callable[[], None]:
        return self.state_machine.subscribe(callback)

    def start(self) -> Session:
        """Connect to Ray and start the worker group (``%rtnb start``)."""
        with self._lock:
            if self.state in (GroupState.READY, GroupState.RUNNING, GroupState.STARTING):
                raise SessionError(
                    f"the worker group of run {self.run_name!r} is already started; "
                    "use `%rtnb restart` for a fresh one or `%rtnb stop` first"
                )
            self.state_machine.to(GroupState.STARTING)
            try:
                self.run_dir.ensure_writable()
                self._attach_metrics_outputs()
                self.checkpoints.cleanup_incomplete()
                if self.connection is None:
                    self.connection = self._connector(
                        self.config.address,
                        timeout_s=self.config.connect_timeout_s,
                    )
                    _stop_sessions_at_exit()
                self._group = self._new_group()
            except RtnbError as exc:
                self.state_machine.to(GroupState.FAILED, str(exc))
                raise
            except BaseException as exc:
                self.state_machine.to(GroupState.FAILED, str(exc))
                raise SessionError(f"starting the worker group failed: {exc}") from None
            self.state_machine.to(GroupState.READY)
            self._continue_step_count()
            self._write_run_json()
            self._push_checkpoint()
            _announce_to_batch_runner(self.config.storage_path, self.run_name)
        return self

    def last_step(self) -> int:
        """The highest step reported in this run so far, in any session."""
        steps = [rep.step for rep in self.metrics.last.values()]
        if self.run_dir.exists("run.json"):
            steps.append(int(self.run_dir.read_json("run.json").get("last_step", 0)))
        latest = self.checkpoints.latest()
        if latest is not None:
            steps.append(latest.step)
        return max(steps, default=0)

    def _continue_step_count(self) -> None:
        # A run continued by a new session (same --name and storage) keeps counting
        # steps: its series stay monotonic and its checkpoint ids are never reused.
        import ray

        step = self.last_step()
        if step and self._group is not None:
            try:
                ray.get([a.set_step.remote(step) for a in self._group.actors], timeout=60)
            except ray.exceptions.RayError:
                pass  # a rank already died: the next cell's poll reports it

    def _attach_metrics_outputs(self) -> None:
        if self.metrics.log is None:
            self.metrics.log = MetricsLog(self.run_dir)
        if self.config.tensorboard and self.metrics.exporter is None:
            if not self.run_dir.is_local:
                raise ConfigError(
                    "--tensorboard writes event files next to the run: it needs a local --storage"
                )
            self.metrics.exporter = TensorBoardExporter(f"{self.run_dir.path}/tensorboard")

    # ---- checkpoints ---------------------------------------------------------------------
    def _commit_checkpoints(self, handle: CellHandle) -> None:
        committed = self.checkpoints.commit_ready(dict(handle.steps), set(handle.ranks))
        if committed and self._chosen_checkpoint is None:
            self._push_checkpoint()

    def _push_checkpoint(self) -> None:
        """Make ``rtnb.get_checkpoint()`` on every rank return the chosen checkpoint,
        else the latest committed one (a new kernel resumes a named run from it)."""
        group = self._group
        if group is None:
            return
        checkpoint = self._chosen_checkpoint
        if checkpoint is None:
            latest = self.checkpoints.latest()
            checkpoint = self.checkpoints.get(latest.id) if latest is not None else None
        import ray

        # Waited for: calls to a threaded actor are not ordered, so a cell sent right
        # after could otherwise still see the previous checkpoint.
        try:
            ray.get([actor.set_checkpoint.remote(checkpoint) for actor in group.actors], timeout=60)
        except ray.exceptions.RayError:
            pass  # a rank just died: the cell's poll reports it, and a rebuilt group gets this push

    def checkpoint_store(self, run: str | None = None) -> CheckpointStore:
        """This run's checkpoints, or those of another run in the same storage."""
        if run is None or run == self.run_name:
            return self.checkpoints
        other = RunDirectory(self.config.storage_path, run)
        if not other.exists("run.json"):
            raise CheckpointError(
                f"no run {run!r} in {self.config.storage_path} (see `%rtnb runs`)"
            )
        return CheckpointStore(other)

    def load(self, checkpoint_id: str = "latest", run: str | None = None) -> Checkpoint:
        """Make ``rtnb.get_checkpoint()`` return this checkpoint on every rank, without
        running anything (the browser's Load button)."""
        checkpoint = self.checkpoint_store(run).get(checkpoint_id)
        checkpoint.verify()
        self._chosen_checkpoint = checkpoint
        self._push_checkpoint()
        return checkpoint

    def list_checkpoints(self, include_incomplete: bool = False, run: str | None = None):
        return self.checkpoint_store(run).list(include_incomplete)

    def resume(
        self, checkpoint_id: str = "latest", *, run: str | None = None, background: bool = False
    ):
        """Load a checkpoint and run the last training cell again from it (the
        browser's Resume button), starting the group first if it is not running.

        Returns the cell's value (or its handle with ``background``), or None when no
        training cell ran yet: then the next one starts from the checkpoint.
        """
        if self.state in (GroupState.NEW, GroupState.STOPPED, GroupState.FAILED):
            self.start()
        self.load(checkpoint_id, run=run)
        code = self._last_training_code
        if code is None:
            return None
        if background:
            return self.run_background(code)
        return self.run(code)

    def result(self) -> Result:
        """The run so far as an :class:`rtnb.Result` (metrics, dataframe, path)."""
        self.metrics.flush()
        per_rank = {
            r: dict(rep.metrics, step=rep.step) for r, rep in sorted(self.metrics.last.items())
        }
        latest = self.checkpoints.latest()
        return Result(
            path=self.run_dir.uri,
            metrics=mean_of_last(per_rank),
            metrics_per_rank=per_rank,
            checkpoint=self.checkpoints.get(latest.id) if latest is not None else None,
            best_checkpoints=[
                (self.checkpoints.get(c.id), c.metrics) for c in self.checkpoints.list()
            ],
            error=self._last_error,
            run_name=self.run_name,
        )

    def _write_run_json(self) -> None:
        group = self._group
        ranks = [vars(r) for r in group.ranks] if group is not None else []
        self.run_dir.write_json(
            "run.json",
            {
                "run_name": self.run_name,
                "status": str(self.state),
                "config": self.config.to_dict(),
                "ranks": ranks,
                "last_step": max((rep.step for rep in self.metrics.last.values()), default=0),
                "updated": time.time(),
            },
        )

    def _new_group(self) -> WorkerGroup:
        group = self._group_factory(self.config, self.run_name, self.config.storage_path)
        group.start()
        return group

    def stop(self) -> None:
        """Stop any running cell and free every actor and the placement group."""
        with self._lock:
            if self.state in (GroupState.NEW, GroupState.STOPPED):
                return
            active = self._active
            if active is not None and not active.done():
                active.stop("stopped because the worker group is stopping")
                active._done.wait(timeout=2 * self.config.stop_grace_s + 5)
            self.state_machine.to(GroupState.STOPPING)
            group, self._group = self._group, None
            if group is not None:
                group.shutdown()
            if self.connection is not None:
                self.connection.shutdown()
                self.connection = None
            self.metrics.flush()
            if self.metrics.exporter is not None:
                self.metrics.exporter.close()
                self.metrics.exporter = None
            self.state_machine.to(GroupState.STOPPED)
            try:
                self._write_run_json()
            except Exception:  # noqa: BLE001 - stopping must not fail on a storage hiccup
                pass

    def restart(self) -> Session:
        """A fresh group with the same options; rank variables are dropped."""
        with self._lock:
            if self.state in (GroupState.NEW, GroupState.STOPPED):
                return self.start()
            self._rebuild("restart requested")
            self.history.clear()
            self.failures = 0
        return self

    def scale(self, workers: int) -> Session:
        """Restart the group with ``workers`` ranks."""
        with self._lock:
            old = self.config.workers
            self.config.workers = workers
            try:
                self.config.validate()
            except ConfigError:
                self.config.workers = old
                raise
            return self.restart()

    def _rebuild(self, reason: str) -> None:
        with self._lock:
            self.state_machine.to(GroupState.RESTARTING, reason)
            group, self._group = self._group, None
            if group is not None:
                group.shutdown(graceful=False)
            try:
                self._group = self._new_group()
            except RtnbError as exc:
                self.state_machine.to(GroupState.FAILED, str(exc))
                raise
            self.state_machine.to(GroupState.READY, reason)
            self._continue_step_count()
            self._write_run_json()
            self._push_checkpoint()

    def _can_recover(self) -> bool:
        return self.failures < self.config.max_failures

    def _recover(self, reason: str) -> dict[int, str]:
        """Rebuild after a rank died mid-cell and replay the cells run so far.

        Returns the ranks that died during the replay (empty when it went through).
        """
        import ray

        self.failures += 1
        try:
            return self._rebuild_and_replay(reason)
        except (ray.exceptions.RayError, WorkerGroupError) as exc:
            # A rank of the new group died while it was being set up: that is
            # another failure, retried while --max-failures allows.
            if self.state is GroupState.FAILED:
                self.state_machine.to(GroupState.RESTARTING, "retrying after a failed rebuild")
                self.state_machine.to(GroupState.READY)
            return {
                -1: str(exc).strip().splitlines()[0][:200]
                if str(exc).strip()
                else type(exc).__name__
            }

    def _rebuild_and_replay(self, reason: str) -> dict[int, str]:
        self._rebuild(reason)
        # Files a dead rank left half-written never got a manifest: drop them.
        self.checkpoints.drop_pending()
        self.checkpoints.cleanup_incomplete()
        group = self._require_group()
        self.state_machine.to(GroupState.RUNNING, f"recovering: {reason}")
        for code in list(self.history):
            replay = CellHandle(self, next(self._cell_ids), code, list(range(group.world_size)))
            replay.replay = True
            replay._dispatch()
            try:
                replay._drive()
            except _Restart:
                return dict(replay._dead)
            failed = {r: u for r, u in replay._finished.items() if u["state"] != "done"}
            if failed:
                rank, update = next(iter(sorted(failed.items())))
                summary = (update.get("error") or ("interrupted", ""))[0]
                raise WorkerGroupError(
                    f"replaying cell {replay.cell_id} failed on rank {rank}: {summary}"
                )
        return {}

    def _require_group(self) -> WorkerGroup:
        if self._group is None or self.state not in (GroupState.READY, GroupState.RUNNING):
            raise SessionError(
                "no worker group is running: start one with `%rtnb start` (or Session.start())"
            )
        return self._group

    def __enter__(self) -> Session:
        if self.state in (GroupState.NEW, GroupState.STOPPED):
            self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # ---- cells -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.config.workers

    def _begin(
        self,
        code: str | Callable,
        ranks: Iterable[int] | str | None,
        timeout: float | None,
        background: bool,
        config: Any = None,
        total_steps: int | None = None,
    ) -> CellHandle:
        with self._lock:
            group = self._require_group()
            if self._active is not None and not self._active.done():
                raise SessionError(
                    f"cell {self._active.cell_id} is still running"
                    + (" in the background" if self._active.background else "")
                    + ": wait for it (`%rtnb wait`) or stop it (`handle.stop()`) first"
                )
            rank_list = _ranks(ranks, group.world_size)
            cell_id = next(self._cell_ids)
            if callable(code):
                code = self._stage_callable(code, config, rank_list)
            elif not isinstance(code, str):
                raise ConfigError(
                    f"Session.run takes code (str) or a function, got {type(code).__name__}"
                )
            check_syntax(code, cell_id)
            if timeout is not None and timeout <= 0:
                raise ConfigError(f"--timeout must be > 0 seconds, got {timeout:g}")
            if total_steps is not None and total_steps < 1:
                raise ConfigError(f"--steps must be ≥ 1, got {total_steps}")
            handle = CellHandle(self, cell_id, code, rank_list, timeout, background)
            self.metrics.begin(rank_list, total_steps)
            self._active = handle
            self.state_machine.to(GroupState.RUNNING, f"cell {cell_id}")
            return handle

    def _stage_callable(self, fn: Callable, config: Any, ranks: list[int]) -> str:
        self.push({"__rtnb_fn__": fn, "__rtnb_config__": config}, ranks=ranks)
        return "__rtnb_fn__(__rtnb_config__)" if config is not None else "__rtnb_fn__()"

    def run(
        self,
        code: str | Callable,
        *,
        ranks: Iterable[int] | str | None = None,
        timeout: float | None = None,
        config: Any = None,
        output: OutputSink | None = None,
        total_steps: int | None = None,
    ) -> PerRank:
        """Run ``code`` (or ``fn()``/``fn(config)``) on the ranks and wait for it.

        Output streams to ``output(rank, stream, text)`` while it runs (default:
        printed with a ``[rank N]`` tag). Returns the last expression's value per
        rank. Ctrl-C stops the cell on every rank (see :class:`CellHandle`).
        """
        handle = self._begin(
            code, ranks, timeout, background=False, config=config, total_steps=total_steps
        )
        handle.add_sink(output or print_sink())
        return handle._run_foreground()

    def begin_cell(
        self,
        code: str | Callable,
        *,
        ranks: Iterable[int] | str | None = None,
        timeout: float | None = None,
        total_steps: int | None = None,
        output: OutputSink | None = None,
    ) -> CellHandle:
        """A foreground cell's handle before it runs, so views can subscribe to it
        first; run it with :meth:`CellHandle.run_here`. Output is printed unless
        ``output`` says otherwise."""
        handle = self._begin(code, ranks, timeout, background=False, total_steps=total_steps)
        handle.add_sink(output or print_sink())
        return handle

    def run_background(
        self,
        code: str | Callable,
        *,
        ranks: Iterable[int] | str | None = None,
        timeout: float | None = None,
        config: Any = None,
        output: OutputSink | None = None,
        total_steps: int | None = None,
    ) -> CellHandle:
        """Start ``code`` on the ranks and return its :class:`CellHandle` at once."""
        handle = self._begin(
            code, ranks, timeout, background=True, config=config, total_steps=total_steps
        )
        if output is not None:
            handle.add_sink(output)
        self._last_background = handle
        handle._run_background()
        return handle

    def wait(self, timeout: float | None = None) -> PerRank:
        """The value of the last background cell, once it ends (``%rtnb wait``)."""
        handle = self._last_background
        if handle is None:
            raise SessionError(
                "no background cell was started in this session: use `%%rtrain --background`"
            )
        return handle.wait(timeout)

    @property
    def active_cell(self) -> CellHandle | None:
        return self._active if self._active is not None and not self._active.done() else None

    def _cell_ended(self, handle: CellHandle) -> None:
        with self._lock:
            self.metrics.flush()
            self._last_error = handle.error
            if handle.reported:
                self._last_training_code = handle.code
            if handle.error is None:
                self.history.append(handle.code)
            if self.state is GroupState.RUNNING and self._active is handle:
                self.state_machine.to(GroupState.READY, f"cell {handle.cell_id} ended")

    # ---- variables ---------------------------------------------------------------------
    def pull(self, name: str, ranks: Iterable[int] | str | None = None) -> list[Any]:
        """The value of ``name`` on each rank, in rank order (``%rtnb pull``)."""
        import ray

        if not name.isidentifier():
            raise ConfigError(f"{name!r} is not a Python variable name")
        group = self._require_group()
        rank_list = _ranks(ranks, group.world_size)
        answers = ray.get([group.actors[r].pull.remote(name) for r in rank_list], timeout=120)
        missing = [r for r, (found, *_rest) in zip(rank_list, answers) if not found]
        if missing:
            raise SessionError(
                f"{name!r} is not defined on rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))}: define it in a %%rtrain cell first"
            )
        return [from_portable((data, text)) for _found, data, text in answers]

    def push(self, values: dict[str, Any], ranks: Iterable[int] | str | None = None) -> None:
        """Set each ``name: value`` in the namespace of every rank (``%rtnb push``)."""
        import ray

        for name in values:
            if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
                raise ConfigError(f"{name!r} is not a Python variable name")
        group = self._require_group()
        rank_list = _ranks(ranks, group.world_size)
        ref = ray.put(dict(values))
        ray.get([group.actors[r].push.remote(ref) for r in rank_list], timeout=300)

    # ---- status ------------------------------------------------------------------------
    def status(self) -> GroupStatus:
        group = self._group
        active = self.active_cell
        ranks = []
        if group is not None:
            for info in group.ranks:
                state, step = "idle", 0
                if active is not None and info.rank in active.ranks:
                    state, step = (
                        active.states.get(info.rank, "running"),
                        active.steps.get(info.rank, 0),
                    )
                last = self.metrics.last.get(info.rank)
                if last is not None:
                    step = max(step, last.step)
                ranks.append(
                    RankStatus(
                        info.rank,
                        f"{info.hostname} ({info.node_ip})",
                        info.pid,
                        info.device,
                        step,
                        state,
                    )
                )
        cell = ""
        if active is not None:
            cell = f"cell {active.cell_id}{' (background)' if active.background else ''} running for {active.elapsed_s:.1f} s"
        return GroupStatus(
            state=str(self.state),
            run_name=self.run_name,
            address=self.connection.address if self.connection else "-",
            backend=self.config.backend or "",
            world_size=self.config.workers,
            ranks=ranks,
            cell=cell,
        )

    def __repr__(self) -> str:
        return (
            f"<rtnb.Session run={self.run_name!r} state={self.state} workers={self.config.workers}>"
        )


def _ranks(ranks: Iterable[int] | str | None, world_size: int) -> list[int]:
    if ranks is None or isinstance(ranks, str):
        return parse_ranks(ranks, world_size)
    return parse_ranks(",".join(str(int(r)) for r in ranks), world_size)


def check_syntax(code: str, cell_id: int = 0) -> None:
    """Raise CellError for a SyntaxError before anything is sent to the ranks."""
    import traceback

    try:
        compile(code, f"<rtrain-cell-{cell_id}>", "exec")
    except SyntaxError as exc:
        text = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
        raise CellError(
            f"the cell has a SyntaxError and was not sent to the ranks:\n{text}",
            exc_type="SyntaxError",
        ) from None


def _announce_to_batch_runner(storage: str, run_name: str) -> None:
    """Under ``rtnb run``, tell the runner which run directory this notebook uses, so
    it can keep the output notebook there."""
    path = os.environ.get(BATCH_RUNS_ENV)
    if not path:
        return
    with contextlib.suppress(OSError), open(path, "a") as out:
        out.write(json.dumps({"storage": storage, "run": run_name}) + "\n")


def _stop_sessions_at_exit() -> None:
    """Register the exit hook once Ray is imported: atexit runs hooks last-in first-out,
    and Ray's own shutdown hook, run while ranks are still alive, stalls the exit for
    ~20 s (and a kernel manager that loses patience SIGTERMs the kernel mid-way)."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        atexit.register(_stop_all_sessions)
        _EXIT_HOOKED = True


_EXIT_HOOKED = False


def _stop_all_sessions() -> None:
    # A kernel that exits (or is shut down) must not leave ranks holding CPUs/GPUs.
    for session in list(_LIVE):
        try:
            session.stop()
        except BaseException:  # noqa: BLE001
            pass
