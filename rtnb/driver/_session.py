"""The driver-side API: one persistent worker group and the cells run on it.

The magics are a thin layer over :class:`Session`; everything here also works
from a plain Python script. The session is a facade over one owner per flow:

- start, rebuild, stop and the Ray under the group: :class:`GroupLifecycle`
  (``_lifecycle.py``), which alone holds the group (a :class:`RankGroup`; Ray's is
  :class:`WorkerGroup`, ``_group.py``);
- cells, ``push`` and ``pull``: :class:`CellFlow` (``_cells.py``), driving each cell
  through a :class:`CellHandle` (``_cell.py``);
- recovery after a failure, replay, scale and restart: :class:`RecoveryFlow`
  (``_recovery.py``), deciding through the :class:`FailurePolicy` (``_policy.py``);
- checkpoint commits: :class:`CheckpointCoordinator` (``_commits.py``);

and every action that changes the ranks' state is written to the run's journal
first (``rtnb.storage._journal``)::

    with rtnb.Session(workers=2) as session:
        session.run("import torch.distributed as dist; x = dist.get_rank()")
        print(session.pull("x"))          # [0, 1]
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rtnb.core._config import SessionConfig
from rtnb.core._messages import SAVE_TRIGGER
from rtnb.core._output import OutputSink
from rtnb.core._profile import ProfileReport
from rtnb.core._redact import redact_uri
from rtnb.core._score import score_rule
from rtnb.core._stacks import GroupStacks
from rtnb.core._text import mean_over_ranks
from rtnb.core._values import PerRank
from rtnb.driver._cell import CellHandle
from rtnb.driver._cells import CellFlow
from rtnb.driver._cluster import ClusterConnection, connect
from rtnb.driver._commits import CheckpointCoordinator
from rtnb.driver._export import ExportedScript, export_run
from rtnb.driver._group import RankGroup
from rtnb.driver._import import TrainScript, read_train_script
from rtnb.driver._lifecycle import GroupLifecycle, new_group
from rtnb.driver._policy import FailurePolicy, RecoveryOutcome, ReplayReport
from rtnb.driver._recovery import RecoveryFlow, Replayer
from rtnb.driver._resume import ResumeFlow, ResumePlan
from rtnb.driver._startup import StartProgress, StartReport
from rtnb.driver._state import GroupState, StateChange
from rtnb.driver._status import GroupStatus, group_status
from rtnb.driver._tracking import TrackingFlow
from rtnb.errors import ClusterError, ConfigError
from rtnb.metrics._store import MetricsStore
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import CheckpointStore
from rtnb.storage._journal import Journal
from rtnb.storage._result import Result
from rtnb.storage._rundir import BATCH_RUNS_ENV, RunDirectory

__all__ = ["ResumePlan", "Session"]

_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()


class Session:
    """A Ray worker group whose ranks keep their Python state across cells.

    Takes the options of ``%rtnb start`` as keyword arguments (see
    :class:`SessionConfig`), or a ready ``config``. ``replay=True`` rebuilds the
    ranks' state from the journal of the run named ``name`` (a new kernel carrying
    on a run). ``group_factory`` lets tests substitute the worker group;
    ``failure_policy`` decides what follows a rank's death (default: retry
    ``--max-failures`` times).
    """

    def __init__(
        self,
        config: SessionConfig | None = None,
        *,
        replay: bool = False,
        group_factory: Callable[[SessionConfig, str, str], RankGroup] | None = None,
        connector: Callable[..., ClusterConnection] | None = None,
        failure_policy: FailurePolicy | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise ConfigError("pass either a SessionConfig or keyword options, not both")
        try:
            self.config = config or SessionConfig(**options)
        except TypeError as exc:
            raise ConfigError(f"unknown Session option: {exc}") from None
        if replay and not self.config.name:
            raise ConfigError("--replay rebuilds a run from its journal: name it with --name RUN")
        self.run_name = self.config.name or time.strftime("run-%Y%m%d-%H%M%S")
        self.run_dir = RunDirectory(self.config.storage_path, self.run_name)
        self.checkpoints = CheckpointStore(
            self.run_dir, self.config.keep, self.config.score, self.config.mode
        )
        self.commits = CheckpointCoordinator(self.checkpoints)
        self.journal = Journal(self.run_dir)
        self.policy = failure_policy or FailurePolicy(self.config.max_failures)
        self.metrics = MetricsStore()
        self.replay_on_start = replay
        # The first error of the MLflow mirror (tracking never stops training).
        self.tracking_error: str | None = None
        lock = threading.RLock()  # one for the group's changes and the cells' starts
        self._lifecycle = GroupLifecycle(
            self.config,
            self.run_name,
            self.run_dir,
            self.journal,
            self.commits,
            self.metrics,
            group_factory=group_factory or new_group,
            connector=connector or connect,
            lock=lock,
            at_exit=_stop_sessions_at_exit,
        )
        self._tracking = TrackingFlow(
            self.config, self.run_name, self.run_dir, self.metrics, self.checkpoints
        )
        self._lifecycle.tracking_record = lambda: self._tracking.record
        self._cells = CellFlow(
            self.config,
            self._lifecycle,
            self.journal,
            self.commits,
            self.checkpoints,
            self.metrics,
            self.policy,
            lock,
        )
        replayer = Replayer(
            self.journal,
            self._cells.world_size,
            self._cells.send_values,
            self._cells.run_replayed,
            self._cells.hand_datasets,
            self._cells.send_controls,
        )
        self._recovery = RecoveryFlow(
            self.config, self._lifecycle, self.policy, replayer, self.checkpoints
        )
        self._cells.attach_recovery(self._recovery)
        self._resume = ResumeFlow(
            self.config, self.run_name, self.checkpoints, self.commits, self.journal, self._cells
        )
        self._lock = lock
        # The line of the last time an elastic group grew back (None: it did not).
        self.last_growth: str | None = None
        _LIVE.add(self)

    # ---- what the flows hold -------------------------------------------------------------
    @property
    def connection(self) -> ClusterConnection | None:
        return self._lifecycle.connection

    @property
    def last_start(self) -> StartReport | None:
        """Seconds per phase of the last start."""
        return self._lifecycle.last_start

    @property
    def last_replay(self) -> ReplayReport | None:
        """Of the last start/restart --replay or scale."""
        return self._recovery.last_replay

    @property
    def last_recovery(self) -> RecoveryOutcome | None:
        return self._recovery.last_recovery

    @property
    def group(self) -> RankGroup | None:
        """The running worker group (None while there is none)."""
        return self._lifecycle.group

    @property
    def state(self) -> GroupState:
        return self._lifecycle.state

    @property
    def started(self) -> bool:
        """A group is starting, ready or running (a second start is refused)."""
        return self.state in (GroupState.STARTING, GroupState.READY, GroupState.RUNNING)

    def on_state_change(self, callback: Callable[[StateChange], None]) -> Callable[[], None]:
        return self._lifecycle.state_machine.subscribe(callback)

    @property
    def failures(self) -> int:
        """Group rebuilds spent on --max-failures so far."""
        return self.policy.failures

    @property
    def ray_lost(self) -> str | None:
        """One line on the Ray this session used being gone, once it is."""
        return self._lifecycle.ray_lost

    @property
    def world_size(self) -> int:
        """How many ranks the group has (1 in local mode, ``--workers 0``; an
        elastic group's current size)."""
        return self._lifecycle.world_size

    @property
    def size_reason(self) -> str | None:
        """Why an elastic group has its size ("elastic 2-4: 3 ranks (...)")."""
        return self._lifecycle.size_reason

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] | None = None) -> Session:
        """Connect to Ray and start the worker group (``%rtnb start``).

        ``progress`` is called with a short line as each phase begins (starting or
        joining Ray, placing the ranks, starting them, the process group);
        :attr:`last_start` then holds the seconds each took."""
        with self._lock:
            self._lifecycle.start(
                StartProgress(progress), self._prepare_start, replay=self.replay_on_start
            )
            if self.replay_on_start:
                self._recovery.replay_onto_new_group("start --replay")
            _announce_to_batch_runner(self.config.storage_path, self.run_name)
        return self

    def _prepare_start(self) -> None:
        self.checkpoints.cleanup_incomplete()
        self._cells.continue_numbers()
        self._tracking.open()

    def stop(self) -> None:
        """Stop any running cell and free every actor and the placement group;
        returns within ``stop_grace_s`` + 1 s."""
        clean = self.ray_lost is None and self._cells.stop_active(
            "stopped because the worker group is stopping"
        )
        self._lifecycle.stop(graceful=clean)
        self.tracking_error = self._tracking.close() or self.tracking_error

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run this run is mirrored into (``--mlflow``), while it is open."""
        return self._tracking.record.get("run_id")

    def restart(self, replay: bool = False) -> Session:
        """A new group with the same options. Rank variables are dropped, unless
        ``replay``: then the journal is replayed onto the new group and the next
        cell continues from the latest checkpoint."""
        if self.state in (GroupState.NEW, GroupState.STOPPED):
            return self.start()
        self._cells.stop_active("stopped because the worker group restarts")
        with self._lock:
            self._recovery.restart(replay)
        return self

    def scale(self, workers: int | tuple[int, int] | None = None) -> Session:
        """A new group of ``workers`` ranks holding the same variables: the journal
        is replayed onto it (``prepare_data_loader`` re-shards for the new world
        size) and the next training cell continues from the latest checkpoint.
        ``(MIN, MAX)``: an elastic group; ``0``: local mode; None: an elastic group
        below MAX grows now to what the cluster has room for (else at the next cell).

        Example::

            In [7]: session.scale(4)
        """
        if workers is None:
            if not self.config.elastic:
                raise ConfigError(
                    "scale needs a size (N, MIN-MAX or 0); only an elastic group grows by itself"
                )
            self._cells.stop_active("stopped because the elastic group grows")
            with self._lock:
                self.last_growth = self._recovery.grow()
            return self
        old = self._recovery.resize(workers)
        if self.state in (GroupState.NEW, GroupState.STOPPED):
            return self.start()
        self._cells.stop_active(
            f"stopped because the worker group scales to {self.config.workers_text} ranks"
        )
        with self._lock:
            self._recovery.scale(old)
        return self

    def __enter__(self) -> Session:
        if self.state in (GroupState.NEW, GroupState.STOPPED):
            self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # ---- cells -------------------------------------------------------------------------
    def run(
        self,
        code: str | Callable,
        *,
        ranks: Iterable[int] | str | None = None,
        timeout: float | None = None,
        config: Any = None,
        output: OutputSink | None = None,
        total_steps: int | None = None,
        once: bool = False,
        label: str | None = None,
        datasets: Mapping[str, Any] | None = None,
    ) -> PerRank:
        """Run ``code`` (or ``fn()``/``fn(config)``) on the ranks and wait for it.

        Output streams to ``output(rank, stream, text)`` while it runs (default:
        printed with a ``[rank N]`` tag). Returns the last expression's value per
        rank. Ctrl-C stops the cell on every rank (see :class:`CellHandle`). A
        function is recorded in the journal by value, so a replay after a failure
        (or in a new kernel) runs it again. ``once``: never replay this cell.
        ``label``: the notebook's name for the cell (Jupyter's ``[4]``), which its
        messages and tracebacks then use instead of rtnb's cell number.
        ``datasets``: Ray Datasets handed to the ranks first (see :meth:`set_datasets`).
        """
        if datasets is not None:
            self.set_datasets(datasets)
        handle = self._cells.begin(
            code, ranks, timeout, False, config, total_steps, once, label, output
        )
        return handle.run_here()

    def set_datasets(
        self, datasets: Mapping[str, Any] | None = None, dataset_config: Any = None, **named: Any
    ) -> None:
        """Hand Ray Datasets to the ranks, as ``TorchTrainer(datasets=...,
        dataset_config=...)`` does: in a cell, ``rtnb.get_dataset_shard(name)`` (or
        ``ray.train.get_dataset_shard``) is the rank's streaming shard. Each is split
        across the ranks (``streaming_split(world_size, equal=True)``) unless a
        ``ray.train.DataConfig(datasets_to_split=[...])`` leaves it whole. They stay
        for later cells and are handed again to every new group (recovery, scale,
        ``--replay``). The Datasets' preprocessing runs on the cluster.

        Example::

            In [2]: session.set_datasets(train=ray.data.range(1000).map(double))
        """
        self._cells.set_datasets({**(datasets or {}), **named}, dataset_config)

    @property
    def dataset_names(self) -> list[str]:
        """The names of the datasets handed to the ranks."""
        return self._cells.dataset_names

    def begin_cell(
        self,
        code: str | Callable,
        *,
        ranks: Iterable[int] | str | None = None,
        timeout: float | None = None,
        total_steps: int | None = None,
        output: OutputSink | None = None,
        once: bool = False,
        label: str | None = None,
        datasets: Mapping[str, Any] | None = None,
    ) -> CellHandle:
        """A foreground cell's handle before it runs, so views can subscribe to it
        first; run it with :meth:`CellHandle.run_here`. Output is printed unless
        ``output`` says otherwise."""
        if datasets is not None:
            self.set_datasets(datasets)
        return self._cells.begin(
            code, ranks, timeout, False, None, total_steps, once, label, output
        )

    def run_background(
        self,
        code: str | Callable,
        *,
        ranks: Iterable[int] | str | None = None,
        timeout: float | None = None,
        config: Any = None,
        output: OutputSink | None = None,
        total_steps: int | None = None,
        once: bool = False,
        label: str | None = None,
        datasets: Mapping[str, Any] | None = None,
    ) -> CellHandle:
        """Start ``code`` on the ranks and return its :class:`CellHandle` at once."""
        if datasets is not None:
            self.set_datasets(datasets)
        handle = self._cells.begin(
            code, ranks, timeout, True, config, total_steps, once, label, output
        )
        handle.run_in_background()
        return handle

    def wait(self, timeout: float | None = None) -> PerRank:
        """The value of the last background cell, once it ends (``%rtnb wait``)."""
        return self._cells.wait(timeout)

    @property
    def active_cell(self) -> CellHandle | None:
        return self._cells.active

    def set_controls(self, values: dict[str, Any] | None = None, **named: Any) -> int | None:
        """Change values the ranks read with ``rtnb.control(name, default)``
        (``%rtnb set lr=3e-4``). While a cell runs, every rank takes the change at
        the same step, which is returned (the driver picks one no rank has begun);
        else it holds from the next cell on (None). Journaled: a recovery or a
        replay applies it at the same step again.

        In [1]: session.set_controls(lr=3e-4)
        Out[1]: 52
        """
        return self._cells.set_controls({**(values or {}), **named})

    def trigger(self, name: str) -> int:
        """Run every rank's ``rtnb.on_trigger(name, fn)`` handler at one step of the
        running cell (``%rtnb trigger eval``): that step. Journaled like a control.

        In [1]: session.trigger("eval")
        Out[1]: 310
        """
        return self._cells.fire(name)

    def save_now(self) -> int:
        """Checkpoint at the next common step of the running cell on every rank,
        through ``rtnb.on_save(fn)`` (``%rtnb save-now``): fn returns the state (or a
        Checkpoint) and it is committed as that step's checkpoint. The step.

        In [1]: session.save_now()
        Out[1]: 311
        """
        return self._cells.fire(SAVE_TRIGGER)

    def debug(
        self,
        rank: int | None = None,
        ask: Callable[[str], str] | None = None,
        show: Callable[[str], None] | None = None,
    ) -> None:
        """A pdb prompt on a rank (``%rtnb debug [RANK]``): a rank the running
        background cell left at a breakpoint, else a post-mortem of the last failed
        cell on that rank (the first rank it failed on), with its frames and locals.
        ``ask`` reads a line (the notebook's input box), ``show`` prints pdb's output.

        In [1]: %rtnb debug 1
        [rtnb] post-mortem of rank 1 at cell [5] line 7
        (Pdb rank 1) p x
        """
        self._cells.debug(
            rank,
            ask or input,
            show or (lambda text: print(text, end="", flush=True)),
        )

    def profile(self, steps: int = 20) -> int | None:
        """Profile ``steps`` steps on every rank with torch.profiler (``%rtnb profile
        --steps N``): of the running cell from a common step (the first profiled
        step is returned), else of the next cell. When every rank is done,
        ``last_profile`` has the merged Chrome/Perfetto trace (one row per rank,
        in the run directory's ``profiles/``) and each rank's time in compute,
        communication, data, rtnb and idle, with the straggler named.

        In [1]: session.profile(steps=20)
        Out[1]: 121
        """
        return self._cells.profile(steps)

    @property
    def last_profile(self) -> ProfileReport | None:
        return self._cells.last_profile

    def stacks(self, ranks: Iterable[int] | str | None = None) -> GroupStacks:
        """Where each rank's cell is right now, identical stacks folded and the odd
        ranks first (``%rtnb stacks``); works while a cell runs, in the background
        or from another thread. A rank whose Python does not answer within a second
        (native code holding the GIL) is read with ``py-spy dump``.

        In [1]: session.stacks()
        rank 1: in all_reduce (torch/distributed/distributed_c10d.py:2950) at cell [5] line 12
        """
        return self._cells.stacks(ranks)

    def pull(self, name: str, ranks: Iterable[int] | str | None = None) -> list[Any]:
        """The value of ``name`` on each rank, in rank order (``%rtnb pull``)."""
        return self._cells.pull(name, ranks)

    def push(self, values: dict[str, Any], ranks: Iterable[int] | str | None = None) -> None:
        """Set each ``name: value`` in the namespace of every rank (``%rtnb push``).

        The values are serialized once: the same bytes go to the ranks and, beside
        the journal entry, to storage, so a replay pushes them again."""
        self._cells.push(values, ranks)

    # ---- checkpoints and results -------------------------------------------------------
    def checkpoint_store(self, run: str | None = None) -> CheckpointStore:
        """This run's checkpoints, or those of another run in the same storage."""
        return self._resume.store(run)

    def load(self, checkpoint_id: str = "latest", run: str | None = None) -> Checkpoint:
        """Make ``rtnb.get_checkpoint()`` return this checkpoint on every rank, without
        running anything (the browser's Load button)."""
        return self._resume.load(checkpoint_id, run)

    def latest_checkpoint_id(self) -> str | None:
        """The checkpoint a recovery would restart from: the latest of the line of
        training the ranks are on (see ``_commits``)."""
        return self.commits.latest_id()

    def list_checkpoints(self, include_incomplete: bool = False, run: str | None = None):
        return self._resume.store(run).list(include_incomplete)

    def prepare_resume(
        self, checkpoint_id: str = "latest", *, run: str | None = None
    ) -> ResumePlan:
        """Resume's first half (``%rtnb resume`` runs the cell itself): start the
        group if it is not running, load the checkpoint, and say which training
        cell runs from it."""
        if self.state in (GroupState.NEW, GroupState.STOPPED, GroupState.FAILED):
            self.start()
        return self._resume.plan(checkpoint_id, run)

    def resume(
        self, checkpoint_id: str = "latest", *, run: str | None = None, background: bool = False
    ):
        """Load a checkpoint and run the last training cell again from it (the
        browser's Resume button), starting the group first if it is not running.

        Returns the cell's value (or its handle with ``background``), or None when no
        training cell ran yet: then the next one starts from the checkpoint.
        """
        plan = self.prepare_resume(checkpoint_id, run=run)
        if plan.code is None:
            return None
        if background:
            return self.run_background(plan.code, label=plan.label)
        return self.run(plan.code, label=plan.label)

    def result(self) -> Result:
        """The run so far as an :class:`rtnb.Result` (metrics, dataframe, path)."""
        self.metrics.flush()
        per_rank = {
            r: dict(rep.metrics, step=rep.step) for r, rep in sorted(self.metrics.last.items())
        }
        return Result.of_run(
            self.run_dir,
            metrics=mean_over_ranks(per_rank),
            metrics_per_rank=per_rank,
            checkpoint=self.commits.latest(),
            best_checkpoints=[
                (self.checkpoints.get(c.id), c.metrics) for c in self.checkpoints.list()
            ],
            error=self._cells.last_error,
            run_name=self.run_name,
            mlflow_run_id=self.mlflow_run_id,
            score_rule=score_rule(self.config.score, self.config.mode, self.metrics.metric_names()),
        )

    def export(self, path: str, *, force: bool = False) -> ExportedScript:
        """Write this run's training as a standalone Ray Train script (``%rtnb
        export``): the cells that built the ranks' state, in order, as
        ``train_loop_per_worker``, the pushed values as its config, the session's
        options as ``ScalingConfig``/``RunConfig``; it never imports rtnb and also
        runs under ``torchrun``. A file at ``path`` that is not an earlier export is
        kept unless ``force``.

        Example::

            In [9]: session.export("train.py")
        """
        return export_run(self.config.storage_path, self.run_name, path, force, self)

    def prepare_import(self, path: str) -> TrainScript:
        """``%rtnb import``'s first half: read a Ray Train script (never running it
        here) and scale the group to its ``ScalingConfig(num_workers=N)`` (the
        journal keeps the ranks' state); the returned script's ``code`` is the cell
        that runs its ``train_loop_per_worker`` with its ``train_loop_config``.

        Example::

            In [4]: script = session.prepare_import("train.py")
            In [5]: session.run(script.code)
        """
        script = read_train_script(path)
        if script.gpu and not self.config.gpu:
            script.notes.append(
                "the script asks for GPUs (use_gpu=True); this group has none: start one with --gpu"
            )
        size = script.workers
        if size == 0:
            script.notes.insert(
                0,
                "the script runs in Ray Train's local mode (num_workers=0; under torchrun, "
                f"one process per torchrun rank): it runs on this group's {self.world_size} ranks",
            )
        elif size is not None and size != self.config.workers:
            try:
                # At the script's fixed size: an elastic group's MIN would pass a size
                # that scale() then cannot place.
                self._lifecycle.check_fits(
                    dataclasses.replace(self.config, workers=size, min_workers=None)
                )
            except ClusterError as exc:
                # A laptop runs a cluster's script on the group it has, as it is.
                script.notes.insert(
                    0,
                    f"the script asks for {size} workers ({str(exc).split('. ')[0]}): "
                    f"it runs on this group's {self.world_size} ranks",
                )
            else:
                self.scale(size)
                script.notes.insert(0, f"scaled to the script's {size} ranks: {self.last_replay}")
        return script

    # ---- status ------------------------------------------------------------------------
    def status(self) -> GroupStatus:
        """The group, its ranks and the running cell (``%rtnb status``)."""
        return group_status(
            self.run_name,
            self.config,
            self._lifecycle,
            self.active_cell,
            self.metrics,
            self._cells.state_text(),
            self._tracking.record.get("run_id", ""),
        )

    def __repr__(self) -> str:
        return (
            f"<rtnb.Session run={self.run_name!r} state={self.state} workers={self.config.workers}>"
        )


def started_sessions() -> list[Session]:
    """The sessions of this process that have a group."""
    return [session for session in list(_LIVE) if session.started]


def _announce_to_batch_runner(storage: str, run_name: str) -> None:
    """Under ``rtnb run``, tell the runner which run directory this notebook uses, so
    it can keep the output notebook there."""
    path = os.environ.get(BATCH_RUNS_ENV)
    if not path:
        return
    # Masked: this file is on disk; the runner knows the real URI it passed us.
    with contextlib.suppress(OSError), open(path, "a") as out:
        out.write(json.dumps({"storage": redact_uri(storage), "run": run_name}) + "\n")


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
