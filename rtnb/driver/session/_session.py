"""The driver-side API: one persistent worker group and the cells run on it.

The magics are a thin layer over :class:`Session`; everything here also works
from a plain Python script. The session is the public face of one
:class:`Controller` (``control/_controller.py``): the state machine that alone makes,
replaces, resizes and removes the group (a :class:`RankGroup`; Ray's is
:class:`WorkerGroup`, ``ranks/_group.py``), decides recoveries through the
:class:`FailurePolicy` and an elastic group's sizes through the
:class:`ScalingPolicy` (``lifecycle/_policies.py``), and owns the :class:`CellFlow`
(``cells/_flow.py``) that runs each cell through a :class:`CellHandle` (``cells/_handle.py``).
Beside it: checkpoint commits (:class:`CheckpointCoordinator`, ``cells/_commits.py``),
resume (``cells/_resume.py``) and the MLflow mirror (``session/_tracking.py``). Every action that
changes the ranks' state is written to the run's journal first
(``rtnb.storage._journal``)::

    with rtnb.Session(workers=2) as session:
        session.run("import torch.distributed as dist; x = dist.get_rank()")
        print(session.pull("x"))          # [0, 1]
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rtnb.core._config import SessionConfig, default_run_name
from rtnb.core._context import set_notebook_checkpoints
from rtnb.core._output import OutputSink
from rtnb.core._redact import redact_uri
from rtnb.core._values import PerRank
from rtnb.driver.cells import CellHandle, CheckpointCoordinator, ResumeFlow, ResumePlan
from rtnb.driver.cluster import ClusterConnection, StartProgress, StartReport, connect
from rtnb.driver.control import Controller
from rtnb.driver.detached import DetachedSession
from rtnb.driver.lifecycle import (
    ACTIVE,
    FailurePolicy,
    GroupState,
    RecoveryOutcome,
    ReplayReport,
    ScalingPolicy,
    StateChange,
)
from rtnb.driver.ranks import RankGroup, new_group
from rtnb.driver.session._live import LiveAPI
from rtnb.driver.session._runs import RunAPI
from rtnb.driver.session._status import GroupStatus, group_status
from rtnb.driver.session._tracking import TrackingFlow
from rtnb.errors import ConfigError, SessionError
from rtnb.metrics._store import MetricsStore
from rtnb.storage._checkpoints import CheckpointStore
from rtnb.storage._journal import Journal
from rtnb.storage._rundir import BATCH_RUNS_ENV, RunDirectory

__all__ = ["ResumePlan", "Session"]

_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()
_STARTS = itertools.count(1)


class Session(LiveAPI, RunAPI):
    """A Ray worker group whose ranks keep their Python state across cells.

    Takes the options of ``%rtnb start`` as keyword arguments (see
    :class:`SessionConfig`), or a ready ``config``. ``replay=True`` rebuilds the
    ranks' state from the journal of the run named ``name`` (a new kernel carrying
    on a run). ``failure_policy`` decides what follows a rank's death (default:
    retry ``--max-failures`` times); ``group_factory`` and ``connector`` replace how
    the group is built and Ray reached (``rtnb.sweep``'s trials share a pool so).
    """

    is_trial = detached = False  # a sweep's trial (see _sweep_values); detached: __new__

    def __new__(cls, *args: Any, detached: bool = False, **kwargs: Any) -> Any:
        # detached=True: a DetachedSession's start (the group outlives this process).
        return _detached(cls, *args, **kwargs) if detached else super().__new__(cls)

    def __init__(
        self,
        config: SessionConfig | None = None,
        *,
        replay: bool = False,
        group_factory: Callable[[SessionConfig, str, str], RankGroup] | None = None,
        connector: Callable[..., ClusterConnection] | None = None,
        failure_policy: FailurePolicy | None = None,
        detached: bool = False,
        **options: Any,
    ) -> None:
        config = _config_of(config, options)
        if replay and not config.name:
            raise ConfigError("--replay rebuilds a run from its journal: name it with --name RUN")
        self.run_name = config.name or default_run_name()
        self.run_dir = RunDirectory(config.storage_path, self.run_name)
        self.checkpoints = CheckpointStore(self.run_dir, config.keep, config.score, config.mode)
        self.commits = CheckpointCoordinator(self.checkpoints)
        self.journal = Journal(self.run_dir)
        self.metrics = MetricsStore()
        self.replay_on_start = replay
        # The first error of the MLflow mirror (tracking never stops training).
        self.tracking_error: str | None = None
        self._tracking = TrackingFlow(
            config, self.run_name, self.run_dir, self.metrics, self.checkpoints
        )
        self._controller = Controller(
            config,
            self.run_name,
            self.run_dir,
            self.journal,
            self.commits,
            self.checkpoints,
            self.metrics,
            failure_policy or FailurePolicy(config.max_failures),
            scaling=ScalingPolicy(),
            group_factory=group_factory or new_group,
            connector=connector or connect,
            at_exit=_stop_sessions_at_exit,
            tracking_record=lambda: self._tracking.record,
        )
        self._cells = self._controller.cells
        self._resume = ResumeFlow(
            config, self.run_name, self.checkpoints, self.commits, self._cells
        )
        # The line of the last time an elastic group grew back (None: it did not).
        self.last_growth: str | None = None
        _LIVE.add(self)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] | None = None) -> Session:
        """Connect to Ray and start the worker group (``%rtnb start``).

        ``progress`` is called with a short line as each phase begins (starting or
        joining Ray, placing the ranks, starting them, the process group);
        :attr:`last_start` then holds the seconds each took."""
        self._controller.start(
            StartProgress(progress), self._prepare_start, replay=self.replay_on_start
        )
        _announce_to_batch_runner(self.config.storage_path, self.run_name)
        return self

    def _prepare_start(self) -> None:
        self.started_seq = next(_STARTS)  # which session the notebook started last
        self.checkpoints.cleanup_incomplete()
        self._cells.continue_numbers()
        self._tracking.open()

    def stop(self) -> None:
        """Stop any running cell and free every actor and the placement group;
        returns within ``stop_grace_s`` + 1 s."""
        self._controller.stop()
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
        self._controller.restart(replay)
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
            self.last_growth = self._controller.grow()
            return self
        self._controller.scale(self._controller.resized(workers))
        if self.state in (GroupState.NEW, GroupState.STOPPED):
            return self.start()
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

    # ---- status ------------------------------------------------------------------------
    def status(self) -> GroupStatus:
        """The group, its ranks and the running cell (``%rtnb status``)."""
        return group_status(
            self.run_name,
            self.config,
            self._controller,
            self.active_cell,
            self.metrics,
            self._cells.state_text(),
            self._tracking.record.get("run_id", ""),
        )

    def __repr__(self) -> str:
        return (
            f"<rtnb.Session run={self.run_name!r} state={self.state} workers={self.config.workers}>"
        )

    # ---- what the controller holds --------------------------------------------------------
    @property
    def config(self) -> SessionConfig:
        """The options in force (frozen; ``scale`` puts a resized copy in force)."""
        return self._controller.config

    @property
    def connection(self) -> ClusterConnection | None:
        return self._controller.connection

    @property
    def last_start(self) -> StartReport | None:
        """Seconds per phase of the last start."""
        return self._controller.last_start

    @property
    def last_replay(self) -> ReplayReport | None:
        """Of the last start/restart --replay or scale."""
        return self._controller.last_replay

    @property
    def last_recovery(self) -> RecoveryOutcome | None:
        return self._controller.recovery.last

    @property
    def group(self) -> RankGroup | None:
        """The running worker group (None while there is none)."""
        return self._controller.group

    @property
    def state(self) -> GroupState:
        return self._controller.state

    @property
    def started(self) -> bool:
        """A group exists or is being made (a second start is refused)."""
        return self.state in ACTIVE

    def on_state_change(self, callback: Callable[[StateChange], None]) -> Callable[[], None]:
        return self._controller.state_machine.subscribe(callback)

    @property
    def failures(self) -> int:
        """Group rebuilds spent on --max-failures so far."""
        return self._controller.recovery.failures

    @property
    def ray_lost(self) -> str | None:
        """One line on the Ray this session used being gone, once it is."""
        return self._controller.ray_lost

    @property
    def world_size(self) -> int:
        """How many ranks the group has (1 in local mode, ``--workers 0``; an
        elastic group's current size)."""
        return self._controller.world_size

    @property
    def size_reason(self) -> str | None:
        """Why an elastic group has its size ("elastic 2-4: 3 ranks (...)")."""
        return self._controller.size_reason


def _config_of(config: SessionConfig | None, options: dict[str, Any]) -> SessionConfig:
    if config is not None and options:
        raise ConfigError("pass either a SessionConfig or keyword options, not both")
    try:
        return config or SessionConfig(**options)
    except TypeError as exc:
        raise ConfigError(f"unknown Session option: {exc}") from None


def _detached(
    session_class: type,
    config: SessionConfig | None = None,
    *,
    replay: bool = False,
    idle_timeout_s: float | None = None,
    **options: Any,
) -> DetachedSession:
    """``Session(detached=True)``: a :class:`DetachedSession` not started yet; its
    ``start()`` makes the group's host (which builds a ``session_class`` there)."""

    def announce(started: DetachedSession) -> None:
        _announce_to_batch_runner(started.config.storage_path, started.run_name, detached=True)

    return DetachedSession(
        _config_of(config, options),
        session_class=session_class,
        replay=replay,
        idle_timeout_s=idle_timeout_s,
        on_started=announce,
    )


def started_sessions() -> list[Session]:
    """The sessions of this process that have a group."""
    return [session for session in list(_LIVE) if session.started]


def _notebook_reported_checkpoints(consistency_mode: Any, timeout_s: float | None) -> list:
    """``rtnb.get_all_reported_checkpoints()`` in the notebook: the checkpoints of the
    session started last (a sweep's trials aside)."""
    sessions = [s for s in started_sessions() if not s.is_trial]
    if not sessions:
        raise SessionError(
            "get_all_reported_checkpoints() reads a run's checkpoints: start a session "
            "first (%rtnb start), or call it in a cell"
        )
    latest = max(sessions, key=lambda s: getattr(s, "started_seq", 0))
    return latest.get_all_reported_checkpoints(consistency_mode, timeout_s)


set_notebook_checkpoints(_notebook_reported_checkpoints)


def _announce_to_batch_runner(storage: str, run_name: str, detached: bool = False) -> None:
    """Under ``rtnb run``, tell the runner which run directory this notebook uses, so
    it can keep the output notebook there (and, for a detached group, say at the end
    that it was left running)."""
    path = os.environ.get(BATCH_RUNS_ENV)
    if not path:
        return
    # Masked: this file is on disk; the runner knows the real URI it passed us.
    with contextlib.suppress(OSError), open(path, "a") as out:
        record = {"storage": redact_uri(storage), "run": run_name}
        out.write(json.dumps({**record, "detached": True} if detached else record) + "\n")


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
