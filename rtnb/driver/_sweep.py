"""Hyperparameter sweeps: Ray Tune decides, rtnb runs each trial on a reused group.

``rtnb.sweep(code_or_fn, param_space, metric=..., mode=..., ...)`` takes Ray Tune's
own pieces: its search spaces (``tune.choice``, ``tune.loguniform``,
``tune.grid_search`` ...), its variant generator for ``num_samples``, its
``Searcher`` classes (Optuna's and the others, wrapped in a ``ConcurrencyLimiter``
or not) and its early-stopping ``TrialScheduler`` classes (ASHA, the median stopping
rule, FIFO), driven through their public callbacks with real ``tune`` ``Trial``
objects. What runs a trial is not Tune's controller (which starts a trainable actor
per trial, and a ``TorchTrainer`` in it starts a group of its own) but one
:class:`~rtnb.Session` per trial, each a journaled run in storage, whose group
comes from a :class:`GroupPool`: the ranks of a finished trial become the next
trial's with a fresh namespace, so a trial does not pay a group's start.

:class:`SweepRunner` is the one owner of a sweep's flow (asking for configs,
starting trials, the scheduler's decisions, retries, the end); :class:`Sweep` is
the handle the user and the views hold::

    sweep = rtnb.sweep(train_code, {"lr": tune.loguniform(1e-4, 1e-1)},
                       metric="loss", mode="min", num_samples=8,
                       scheduler=ASHAScheduler(max_t=20, grace_period=2))
    sweep.best_config, sweep.best_checkpoint
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import enum
import inspect
import keyword
import math
import queue
import textwrap
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rtnb.core._config import SessionConfig, check_name
from rtnb.core._context import CONFIG_NAME
from rtnb.core._redact import redact_uri
from rtnb.driver._cells import check_syntax
from rtnb.driver._cluster import ClusterConnection, connect
from rtnb.driver._embedded import rank_cpus
from rtnb.driver._group import RankGroup, WorkerGroup
from rtnb.driver._startup import StartProgress
from rtnb.errors import (
    CellError,
    CellInterrupted,
    ClusterError,
    ConfigError,
    RtnbError,
    one_line,
)
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import CheckpointInfo, CheckpointStore
from rtnb.storage._layout import SWEEP_RECORD
from rtnb.storage._rundir import RunDirectory

__all__ = [
    "GroupPool",
    "Sweep",
    "SweepEvent",
    "SweepEventKind",
    "SweepTrial",
    "TrialState",
    "on_sweep_start",
    "sweep",
]

# Schedulers that pause trials and resume them later (from a checkpoint, perhaps
# with another trial's weights): rtnb's trials run to their end or stop early.
_PAUSING = ("HyperBandScheduler", "PopulationBasedTraining", "ResourceChangingScheduler")
# Search-space objects of other libraries, which Tune does not sample.
_FOREIGN_SPACES = ("optuna", "hyperopt", "skopt", "nevergrad", "ConfigSpace", "scipy", "ax")
# How long the runner waits for an event before it looks at its slots again.
_TICK_S = 0.5

# Called with each new sweep before it starts, in the caller's thread (the magics
# register the live view here: the engine never imports widgets).
_VIEWERS: list[Callable[[Sweep], None]] = []


def on_sweep_start(viewer: Callable[[Sweep], None]) -> Callable[[], None]:
    """Call ``viewer(sweep)`` for every sweep started in this process, before its
    first trial; returns the function that removes it."""
    _VIEWERS.append(viewer)
    return lambda: _VIEWERS.remove(viewer) if viewer in _VIEWERS else None


class TrialState(str, enum.Enum):
    """Where a sweep's trial stands (Tune's words where it has them)."""

    PENDING = "pending"
    RUNNING = "running"
    TERMINATED = "terminated"  # ran to its end
    STOPPED = "stopped"  # stopped early by the scheduler, or by the user
    ERROR = "error"

    def __str__(self) -> str:
        return self.value

    @property
    def ended(self) -> bool:
        return self in (TrialState.TERMINATED, TrialState.STOPPED, TrialState.ERROR)


@dataclass
class SweepTrial:
    """One trial: its config, its run in storage and what it reported.

    ``steps``/``values`` are the sweep's metric per result (the mean over the ranks
    of each step all of them reported), what the scheduler saw."""

    index: int
    trial_id: str
    config: dict[str, Any]
    run_name: str
    state: TrialState = TrialState.PENDING
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    stopped_at: int | None = None  # the iteration the scheduler stopped it at
    note: str = ""  # why it stopped, or its error, in one line
    failures: int = 0
    value: Any = None  # the cell's value per rank, when it ran to its end
    started: float = 0.0
    ended: float = 0.0

    @property
    def iterations(self) -> int:
        return len(self.values)

    def score(self, mode: str, scope: str = "last") -> float | None:
        """The trial's score: its last value (Tune's default scope) or its best."""
        if not self.values:
            return None
        if scope == "last":
            return self.values[-1]
        return min(self.values) if mode == "min" else max(self.values)

    def copy(self) -> SweepTrial:
        return dataclasses.replace(self, steps=list(self.steps), values=list(self.values))

    def row(self, mode: str) -> dict[str, Any]:
        return {
            "trial": self.index,
            "trial_id": self.trial_id,
            "run": self.run_name,
            "state": str(self.state),
            "iterations": self.iterations,
            "last_step": self.steps[-1] if self.steps else None,
            "last": self.score(mode, "last"),
            "best": self.score(mode, "all"),
            "stopped_at": self.stopped_at,
            "failures": self.failures,
            "note": self.note,
            "config": self.config,
        }


class SweepEventKind(str, enum.Enum):
    STARTED = "started"  # a trial's cell started
    RESULT = "result"  # a trial has a new value of the metric
    ENDED = "ended"  # a trial ended (see its state)
    DONE = "done"  # the sweep ended

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SweepEvent:
    kind: SweepEventKind
    trial: int | None = None


# ---- the groups trials run on ------------------------------------------------------------
class GroupPool:
    """The worker groups of a sweep, lent to one trial at a time.

    A finished trial's group goes back here and is lent to the next trial with its
    ranks renewed for that trial's run (a fresh namespace, the same processes and
    process group). At most ``capacity`` groups exist at once; a group a trial gave
    back unclean (a rank died, the cell could not stop) is shut down, not lent."""

    def __init__(self, config: SessionConfig, capacity: int) -> None:
        self.config = config
        self.capacity = capacity
        self.started = 0  # groups started (each paid a group's start)
        self.lent = 0  # trials that got a group
        self._idle: list[WorkerGroup] = []
        self._live: list[WorkerGroup] = []
        self._lock = threading.Lock()
        self._closed = False

    def factory(self, config: SessionConfig, run_name: str, storage_path: str) -> RankGroup:
        """A trial :class:`Session`'s ``group_factory``."""
        return LentGroup(self, run_name, storage_path)

    def take(self, run_name: str, storage_path: str, progress: StartProgress | None) -> WorkerGroup:
        while True:
            with self._lock:
                if self._closed:
                    raise ClusterError("the sweep is over: its groups are shut down")
                group = self._idle.pop() if self._idle else None
            if group is None:
                break
            try:
                group.gather(group.renew(run_name, storage_path), 60)
            except Exception:  # noqa: BLE001 - a rank died while idle: start another
                self._discard(group)
                continue
            with self._lock:
                self.lent += 1
            return group
        group = WorkerGroup(self.config, run_name, storage_path)
        group.start(progress)
        with self._lock:
            self._live.append(group)
            self.started += 1
            self.lent += 1
            closed = self._closed
        if closed:  # the sweep ended while this group started
            self._discard(group)
            raise ClusterError("the sweep is over: its groups are shut down")
        return group

    def give_back(self, group: WorkerGroup, clean: bool) -> None:
        with self._lock:
            keep = clean and not self._closed and group in self._live
            if keep:
                self._idle.append(group)
        if not keep:
            self._discard(group)

    def _discard(self, group: WorkerGroup) -> None:
        with self._lock:
            if group in self._live:
                self._live.remove(group)
            if group in self._idle:
                self._idle.remove(group)
        group.shutdown(graceful=False, timeout_s=2.0)

    def close(self) -> None:
        """Shut every group down (their CPUs are free when this returns)."""
        with self._lock:
            self._closed = True
            groups, self._live, self._idle = list(self._live), [], []
        for group in groups:
            group.shutdown(graceful=False, timeout_s=2.0)


class LentGroup:
    """A :class:`RankGroup` lent by a :class:`GroupPool` to one trial's session: its
    start takes a group from the pool, its shutdown gives it back (a graceful one
    only: after a failure the group is shut down)."""

    def __init__(self, pool: GroupPool, run_name: str, storage_path: str) -> None:
        self._pool = pool
        self._run_name = run_name
        self._storage_path = storage_path
        self._group: WorkerGroup | None = None
        self._sound = True

    def start(self, progress: StartProgress | None = None) -> None:
        self._group = self._pool.take(self._run_name, self._storage_path, progress)

    def discard_on_return(self) -> None:
        """Its trial failed: whatever the session's stop says, the group is shut down
        (a broken process group, a CUDA error, must not reach the next trial)."""
        self._sound = False

    def shutdown(self, graceful: bool = True, timeout_s: float = 5.0) -> None:
        group, self._group = self._group, None
        if group is not None:
            self._pool.give_back(group, clean=graceful and self._sound)

    def __getattr__(self, name: str) -> Any:
        # The rank protocol, the ranks and the size are the lent group's.
        group = self.__dict__.get("_group")
        if group is None:
            raise AttributeError(name)
        return getattr(group, name)


# ---- the search: Tune's pieces ------------------------------------------------------------
class _Suggestions:
    """The next trial's config, from Tune's variant generator (grid and random
    search, ``num_samples`` times over) or from a Tune ``Searcher``."""

    def __init__(self, param_space: dict, num_samples: int, searcher: Any) -> None:
        self.param_space = param_space
        self.num_samples = num_samples
        self.searcher = searcher
        self.made = 0
        self.finished = False
        self._variants = None if searcher is not None else self._generate()

    def _generate(self):
        from ray.tune.search.variant_generator import format_vars, generate_variants

        for _ in range(self.num_samples):
            for resolved, config in generate_variants(copy.deepcopy(self.param_space)):
                yield config, format_vars(resolved)

    def next(self, trial_id: str) -> tuple[dict, str] | None:
        """(config, tag) for the next trial; None when none now (the searcher wants
        results first) or none any more (:attr:`finished`)."""
        if self.finished:
            return None
        if self._variants is not None:
            try:
                config, tag = next(self._variants)
            except StopIteration:
                self.finished = True
                return None
            self.made += 1
            return config, tag
        if self.made >= self.num_samples:
            self.finished = True
            return None
        from ray.tune.search import Searcher
        from ray.tune.utils.util import merge_dicts

        suggestion = self.searcher.suggest(trial_id)
        if suggestion == Searcher.FINISHED:
            self.finished = True
            return None
        if suggestion is None:
            return None
        self.made += 1
        config = merge_dicts(_constants(self.param_space), copy.deepcopy(suggestion))
        return config, ",".join(f"{k}={_short(v)}" for k, v in _flat(suggestion).items())

    @property
    def total(self) -> int | None:
        """How many trials the sweep will have, when known."""
        if self.searcher is not None:
            return self.num_samples
        from ray.tune.search.variant_generator import parse_spec_vars

        _resolved, _domains, grids = parse_spec_vars(self.param_space)
        return self.num_samples * math.prod(len(grid.categories) for _path, grid in grids)


class _Controller:
    """What Tune's schedulers ask of the controller that drives them."""

    def __init__(self) -> None:
        self.trials: list[Any] = []

    def get_trials(self) -> list[Any]:
        return list(self.trials)

    def get_live_trials(self) -> list[Any]:
        from ray.tune.experiment import Trial

        return [t for t in self.trials if t.status not in (Trial.TERMINATED, Trial.ERROR)]


@dataclass
class _Running:
    """A running trial's session, cell and Tune trial (the runner's own)."""

    trial: SweepTrial
    session: Any
    tune_trial: Any
    handle: Any = None
    stop_reason: str | None = None
    at_end: bool = False  # the scheduler's stop came at its max_t: the trial's end
    last_result: dict[str, Any] | None = None
    iterations: int = 0  # results the scheduler was given (Tune's training_iteration)
    # Steps not settled yet: {step: {rank: {metric: value}}}; each rank's newest step.
    pending: dict[int, dict[int, dict[str, float]]] = field(default_factory=dict)
    progress: dict[int, int] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)  # every metric name the trial reported
    unsubscribe: Callable[[], None] | None = None


# ---- the handle -------------------------------------------------------------------------
class Sweep:
    """A running or finished sweep (see the module docstring).

    ``trials`` is a snapshot of every trial; ``best_trial``/``best_config``/
    ``best_checkpoint`` name the best by ``metric``/``mode`` (Tune's default scope,
    each trial's last result); :meth:`resume_best` carries the best trial on in the
    notebook's own group. :meth:`wait` blocks until the sweep ends; :meth:`stop`
    stops every trial at a step boundary.
    """

    @staticmethod
    def on_start(viewer: Callable[[Sweep], None]) -> Callable[[], None]:
        """Call ``viewer(sweep)`` for every sweep this process starts, before its
        first trial (the notebook shows its view so); returns the function that
        removes it."""
        return on_sweep_start(viewer)

    def __init__(
        self,
        name: str,
        code: str | Callable,
        param_space: dict,
        metric: str,
        mode: str,
        storage: str,
        total: int | None,
        trial_config: SessionConfig,
        max_concurrent_trials: int,
    ) -> None:
        self.name = name
        self.code = code
        self.param_space = param_space
        self.metric = metric
        self.mode = mode
        self.storage = storage
        self.total = total
        self.trial_config = trial_config
        self.max_concurrent_trials = max_concurrent_trials
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.error: RtnbError | None = None
        self.interrupted = False
        self.groups_started = 0
        self._trials: list[SweepTrial] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._subscribers: list[Callable[[SweepEvent], None]] = []
        self._stop_requested = threading.Event()
        self.stop_reason = "stopped by the user"

    # ---- what views read ------------------------------------------------------------------
    @property
    def trials(self) -> list[SweepTrial]:
        with self._lock:
            return [t.copy() for t in self._trials]

    def subscribe(self, callback: Callable[[SweepEvent], None]) -> Callable[[], None]:
        """``callback(event)`` on each trial's start, result and end, and the sweep's end
        (from the sweep's own threads)."""
        self._subscribers.append(callback)
        if self.ended_at is not None:
            callback(SweepEvent(SweepEventKind.DONE))
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def emit(self, event: SweepEvent) -> None:
        for callback in list(self._subscribers):
            try:
                callback(event)
            except Exception:  # noqa: BLE001 - a broken view must not stop the sweep
                pass

    def done(self) -> bool:
        return self._done.is_set()

    def state_text(self) -> str:
        trials = self.trials
        counts = {s: sum(t.state is s for t in trials) for s in TrialState}
        parts = [f"{counts[s]} {s}" for s in TrialState if counts[s]]
        total = f"{len(trials)}" + (f" of {self.total}" if self.total else "")
        return (
            f"sweep {self.name} · {self.outcome} · {total} trials "
            f"({', '.join(parts) or 'none yet'})"
        )

    @property
    def outcome(self) -> str:
        """running, done, interrupted or failed."""
        if self.ended_at is None:
            return "running"
        return "failed" if self.error else "interrupted" if self.interrupted else "done"

    # ---- waiting and stopping -------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> Sweep:
        """Block until the sweep ends (Ctrl-C stops it: every trial at a step boundary,
        every group freed); raises its error if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._done.wait(0.2):
                if deadline is not None and time.monotonic() >= deadline:
                    from rtnb.errors import WaitTimeout

                    raise WaitTimeout(f"sweep {self.name} is still running after {timeout:g} s")
        except KeyboardInterrupt:
            self.stop("interrupted (Ctrl-C / kernel interrupt)")
            ended = self._done.wait(self.trial_config.stop_grace_s + 30.0)
            interrupted = CellInterrupted(
                f"sweep {self.name} interrupted: {self.state_text()}; "
                + (
                    "every trial stopped at a step boundary, their committed checkpoints "
                    "kept, every group freed"
                    if ended
                    else "its trials are still stopping (sweep.wait() for the end)"
                )
            )
            interrupted.sweep = self  # what it found so far stays at hand
            raise interrupted from None
        if self.error is not None:
            self.error.sweep = self
            raise self.error
        return self

    def stop(self, reason: str = "stopped by the user") -> None:
        """Stop the sweep: running trials stop at a step boundary, no new one starts."""
        self.stop_reason = reason
        self._stop_requested.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    # ---- what its runner changes ---------------------------------------------------------
    def add_trial(self, trial: SweepTrial) -> None:
        with self._lock:
            self._trials.append(trial)
        self.emit(SweepEvent(SweepEventKind.STARTED, trial.index))

    def add_result(self, trial: SweepTrial, step: int, value: float) -> None:
        with self._lock:
            trial.steps.append(step)
            trial.values.append(value)
        self.emit(SweepEvent(SweepEventKind.RESULT, trial.index))

    def end_trial(self, trial: SweepTrial, state: TrialState, note: str) -> None:
        with self._lock:
            trial.state, trial.note, trial.ended = state, note, time.time()

    def finish(self) -> None:
        """The sweep ended: views leave their lasting output (in the waiting cell,
        before :meth:`wait` returns), then waiters wake."""
        self.ended_at = time.time()
        self.emit(SweepEvent(SweepEventKind.DONE))
        self._done.set()

    # ---- the best trial -----------------------------------------------------------------
    def best_trial(self, scope: str = "last") -> SweepTrial | None:
        """The trial with the best score (``scope="last"``: each trial's last value, as
        Tune's ``get_best_result``; ``"all"``: its best value)."""
        if scope not in ("last", "all"):
            raise ConfigError(f"scope is 'last' or 'all', not {scope!r}")
        scored = [(t.score(self.mode, scope), t) for t in self.trials]
        scored = [(s, t) for s, t in scored if s is not None and not math.isnan(s)]
        if not scored:
            return None
        pick = min if self.mode == "min" else max
        return pick(scored, key=lambda st: st[0])[1]

    @property
    def best_config(self) -> dict[str, Any] | None:
        best = self.best_trial()
        return None if best is None else best.config

    def checkpoint_info(self, trial: SweepTrial) -> CheckpointInfo | None:
        """A trial's checkpoint to carry on from: its best by the sweep's metric
        when its checkpoints carry it, else its latest."""
        store = CheckpointStore.of_run(self.storage, trial.run_name)
        committed = [c for c in store.list() if c.status == "committed"]
        if not committed:
            return None
        scored = [c for c in committed if isinstance(c.metrics.get(self.metric), (int, float))]
        if scored:
            pick = min if self.mode == "min" else max
            return pick(scored, key=lambda c: c.metrics[self.metric])
        return store.latest()

    @property
    def best_checkpoint(self) -> Checkpoint | None:
        """The best trial's checkpoint (see :meth:`checkpoint_info`), or None."""
        best = self.best_trial()
        info = None if best is None else self.checkpoint_info(best)
        if best is None or info is None:
            return None
        return CheckpointStore.of_run(self.storage, best.run_name).get(info.id)

    def resume_trial(
        self, session: Any = None, trial: int | None = None, *, background: bool = False
    ):
        """Carry trial ``trial`` (default: the best) on in ``session``, the notebook's
        own group (default: the one this kernel started, ``%rtnb start``): its config
        is pushed to the ranks (as variables and ``rtnb.get_config()``), its
        checkpoint loaded (``rtnb.get_checkpoint()``) and the sweep's training code
        run again from there. Returns the cell's value (its handle with
        ``background``).

        Example::

            In [8]: sweep.resume_best()
        """
        if session is None:
            running = _notebook_sessions()
            if len(running) != 1:
                raise ConfigError(
                    "start the notebook's group first (`%rtnb start`), then resume the trial "
                    "into it"
                    if not running
                    else "several groups run in this kernel: pass the session, "
                    "sweep.resume_trial(session)"
                )
            session = running[0]
        chosen = self.best_trial() if trial is None else self._trial(trial)
        if chosen is None:
            raise ConfigError(f"sweep {self.name} has no trial that reported {self.metric!r} yet")
        if redact_uri(session.config.storage_path) != redact_uri(self.storage):
            raise ConfigError(
                f"the notebook's group keeps its runs in {redact_uri(session.config.storage_path)}, "
                f"the sweep in {redact_uri(self.storage)}: start the group with --storage "
                f"{redact_uri(self.storage)} to resume a trial"
            )
        info = self.checkpoint_info(chosen)
        if info is not None:
            session.load(info.id, run=chosen.run_name)
        label = f"trial {chosen.index} of sweep {self.name}"
        if callable(self.code):
            run = session.run_background if background else session.run
            return run(self.code, config=chosen.config, label=label)
        session.push(_config_values(chosen.config))
        run = session.run_background if background else session.run
        return run(self.code, label=label)

    resume_best = resume_trial

    def _trial(self, index: int) -> SweepTrial:
        trials = self.trials
        if not 0 <= index < len(trials):
            raise ConfigError(f"sweep {self.name} has trials 0-{len(trials) - 1}, not {index}")
        return trials[index]

    def dataframe(self):
        """One row per trial: its config (``config/NAME`` columns), state and scores."""
        import pandas as pd

        rows = []
        for trial in self.trials:
            row = trial.row(self.mode)
            config = row.pop("config")
            rows.append({**row, **{f"config/{k}": v for k, v in _flat(config).items()}})
        return pd.DataFrame(rows)

    def record(self) -> dict[str, Any]:
        """What ``sweep.json`` in the sweep's folder says."""
        return {
            "name": self.name,
            "metric": self.metric,
            "mode": self.mode,
            "state": self.outcome,
            "error": str(self.error) if self.error else None,
            "started": self.started_at,
            "ended": self.ended_at,
            "workers": self.trial_config.workers,
            "max_concurrent_trials": self.max_concurrent_trials,
            "groups_started": self.groups_started,
            "trials": [t.row(self.mode) for t in self.trials],
        }

    def __repr__(self) -> str:
        best = self.best_trial()
        shown = (
            f", best trial {best.index} {self.metric}={best.score(self.mode):.4g} {best.config}"
            if best is not None
            else ""
        )
        return f"<rtnb.Sweep {self.state_text()}{shown}>"


# ---- the flow -----------------------------------------------------------------------------
class SweepRunner:
    """Owns one sweep's flow, in a thread of its own (see the module docstring).

    Failures follow Tune's ``FailureConfig``: a trial whose cell fails (its code
    raised, a rank died) is retried ``max_failures`` times (-1: always) on a fresh
    group from its latest checkpoint, then marked ``error``; ``fail_fast`` ends the
    sweep at the first error. The trial's own session does not recover by itself
    (``max_failures=0`` there), so each failure counts once."""

    def __init__(
        self,
        handle: Sweep,
        suggestions: _Suggestions,
        scheduler: Any,
        max_failures: int,
        fail_fast: bool,
        connection: ClusterConnection,
        own_connection: bool,
    ) -> None:
        self.sweep = handle
        self.suggestions = suggestions
        self.scheduler = scheduler
        self.max_failures = max_failures
        self.fail_fast = fail_fast
        self.connection = connection
        self.own_connection = own_connection
        self.pool = GroupPool(handle.trial_config, handle.max_concurrent_trials)
        self.controller = _Controller()
        self.events: queue.Queue = queue.Queue()
        self.running: dict[int, _Running] = {}
        self.trials: list[SweepTrial] = []  # the sweep's, in order (the runner's to change)
        # Where a scheduler's max_t is (a stop there is the trial's end, not early).
        self.max_t = getattr(scheduler, "_max_t", None)
        self.thread = threading.Thread(
            target=self._run, name=f"rtnb-sweep-{handle.name}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    # ---- the loop --------------------------------------------------------------------
    def _run(self) -> None:
        sweep = self.sweep
        try:
            while True:
                if sweep.stop_requested:
                    sweep.interrupted = True
                    break
                self._fill_slots()
                if not self.running and self.suggestions.finished:
                    break
                try:
                    event = self.events.get(timeout=_TICK_S)
                except queue.Empty:
                    # A cell whose end was not heard of (never expected; never a hang).
                    for running in list(self.running.values()):
                        if running.handle is not None and running.handle.done():
                            self.events.put(("ended", running.trial.index, running.handle))
                    continue
                self._handle(event)
        except RtnbError as exc:
            sweep.error = exc
        except Exception as exc:  # noqa: BLE001 - the sweep ends with one line, never hangs
            sweep.error = ConfigError(f"the sweep failed: {one_line(exc)}")
        finally:
            self._end()

    def _fill_slots(self) -> None:
        from ray.tune.experiment import Trial

        while len(self.running) < self.sweep.max_concurrent_trials:
            index = len(self.trials)
            trial_id = f"{self.sweep.name}_{index:05d}"
            suggestion = self.suggestions.next(trial_id)
            if suggestion is None:
                if not self.running:  # nothing will ever tell it more: it is done
                    self.suggestions.finished = True
                return
            config, tag = suggestion
            trial = SweepTrial(
                index=index,
                trial_id=trial_id,
                config=config,
                run_name=f"{self.sweep.name}-t{index:03d}",
            )
            tune_trial = Trial(
                "rtnb", config=config, trial_id=trial_id, experiment_tag=tag, stub=True
            )
            tune_trial.set_status(Trial.RUNNING)
            self.controller.trials.append(tune_trial)
            self.trials.append(trial)
            self.sweep.add_trial(trial)
            self.scheduler.on_trial_add(self.controller, tune_trial)
            self._start_trial(_Running(trial, None, tune_trial))

    def _start_trial(self, running: _Running) -> None:
        from rtnb.driver._session import Session

        trial = running.trial
        config = dataclasses.replace(self.sweep.trial_config, name=trial.run_name)
        connection = self.connection
        session = Session(
            config,
            group_factory=self.pool.factory,
            connector=lambda *_a, **_k: ClusterConnection(
                address=connection.address, owned=False, client_mode=connection.client_mode
            ),
        )
        running.session = session
        _TRIAL_SESSIONS.add(session)
        self.running[trial.index] = running
        trial.state, trial.started = TrialState.RUNNING, time.time()
        try:
            session.start()
            self.sweep.groups_started = self.pool.started
            running.unsubscribe = session.metrics.subscribe(
                lambda rank, batch: self._on_reports(running, rank, batch)
            )
            self._run_cell(running)
        except RtnbError as exc:
            # This trial fails; the sweep goes on (as Tune's would), unless fail_fast.
            self._trial_failed(running, f"it could not start: {one_line(exc)}")
            return
        self._write_record()

    def _run_cell(self, running: _Running) -> None:
        code, trial = self.sweep.code, running.trial
        quiet = lambda _rank, _stream, _text: None  # noqa: E731 - in the run's logs/
        if callable(code):
            handle = running.session.run_background(code, config=trial.config, output=quiet)
        else:
            running.session.push(_config_values(trial.config))
            handle = running.session.run_background(code, output=quiet, label=trial.trial_id)
        running.handle = handle
        handle.add_done_callback(lambda h: self.events.put(("ended", trial.index, h)))

    def _on_reports(self, running: _Running, rank: int, batch) -> None:
        """A rank's reports (the cell's poll thread): each step becomes one result,
        the mean of every number the ranks reported for it, once every rank is past it
        (its reports arrive in order, so then nothing more of that step will come). A
        metric only some ranks report is the mean over those that did; a rank that
        reports nothing at all holds the results back until the trial ends."""
        world = running.session.world_size
        for step, _when, metrics in batch.rows():
            running.reported.update(metrics)
            running.progress[rank] = max(running.progress.get(rank, -1), step)
            numbers = {
                k: float(v)
                for k, v in metrics.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            if numbers:
                running.pending.setdefault(step, {})[rank] = numbers
        if len(running.progress) < world:
            return
        behind = min(running.progress.values())
        for done in sorted(s for s in running.pending if s <= behind):
            self.events.put(("result", running.trial.index, done, _mean(running.pending.pop(done))))

    def _handle(self, event: tuple) -> None:
        kind, index = event[0], event[1]
        running = self.running.get(index)
        if running is None:
            return
        if kind == "result":
            self._result(running, event[2], event[3])
        elif kind == "ended" and event[2] is running.handle:
            self._ended(running)

    def _result(self, running: _Running, step: int, means: dict[str, float]) -> None:
        from ray.tune.schedulers import TrialScheduler

        trial, metric = running.trial, self.sweep.metric
        if running.stop_reason is not None or metric not in means:
            return  # what comes after a stop is not the trial's: the scheduler had it end
        running.iterations += 1
        result = {
            **means,
            "training_iteration": running.iterations,
            "step": step,
            "time_total_s": time.time() - trial.started,
            "trial_id": trial.trial_id,
        }
        self.sweep.add_result(trial, step, means[metric])
        decision = self.scheduler.on_trial_result(self.controller, running.tune_trial, result)
        running.tune_trial.update_last_result(result)
        running.last_result = result
        if decision in (TrialScheduler.STOP, TrialScheduler.PAUSE):
            at_end = self.max_t is not None and running.iterations >= self.max_t
            running.stop_reason = (
                f"ran its max_t={self.max_t} iterations"
                if at_end
                else f"stopped early by {type(self.scheduler).__name__} at iteration "
                f"{running.iterations} (step {step})"
            )
            running.at_end = at_end
            trial.stopped_at = None if at_end else running.iterations
            if running.handle is not None and not running.handle.done():
                running.handle.stop(running.stop_reason)
        elif self.suggestions.searcher is not None:
            self.suggestions.searcher.on_trial_result(trial.trial_id, result)

    def _ended(self, running: _Running) -> None:
        trial, handle = running.trial, running.handle
        error = handle.error
        for step in sorted(running.pending):  # what no rank will report more of
            self._result(running, step, _mean(running.pending.pop(step)))
        if error is None or running.at_end:
            state, note = TrialState.TERMINATED, ""
            trial.stopped_at = None
            trial.value = handle.wait(0) if error is None else None
        elif running.stop_reason is not None:
            state, note = TrialState.STOPPED, running.stop_reason
        elif self.sweep.stop_requested:
            state, note = TrialState.STOPPED, self.sweep.stop_reason
        elif self.max_failures < 0 or trial.failures < self.max_failures:
            self._retry(running, error)
            return
        else:
            self._trial_failed(running, one_line(error))
            return
        if state is TrialState.TERMINATED and not trial.values and running.reported:
            self._close_trial(running, TrialState.ERROR, "it never reported the metric")
            raise ConfigError(
                f"trial {trial.index} ended without reporting {self.sweep.metric!r} (it "
                f"reported {', '.join(sorted(running.reported - {'step'})) or 'only steps'}): "
                "name a metric the training code reports"
            )
        self._tell_tune_it_ended(running)
        self._close_trial(running, state, note)

    def _retry(self, running: _Running, error: BaseException) -> None:
        """Run the trial again on a fresh group (as Tune restarts a trial on a new
        actor), from its latest checkpoint."""
        from ray.tune.experiment import Trial

        trial = running.trial
        trial.failures += 1
        trial.note = f"retry {trial.failures}: {one_line(error)}"
        running.pending.clear()
        running.progress.clear()  # the new attempt's steps start from its checkpoint
        running.tune_trial.set_status(Trial.RUNNING)
        try:
            running.session.restart()
            if running.session.latest_checkpoint_id():
                running.session.load("latest")
            self._run_cell(running)
        except RtnbError as exc:
            self._trial_failed(running, f"its retry could not start: {one_line(exc)}")

    def _trial_failed(self, running: _Running, note: str) -> None:
        from ray.tune.experiment import Trial

        trial = running.trial
        running.tune_trial.set_status(Trial.ERROR)
        self.scheduler.on_trial_error(self.controller, running.tune_trial)
        if self.suggestions.searcher is not None:
            self.suggestions.searcher.on_trial_complete(trial.trial_id, error=True)
        self._close_trial(running, TrialState.ERROR, note)
        if self.fail_fast:
            raise ConfigError(
                f"trial {trial.index} failed and the sweep fails fast (FailureConfig"
                f"(fail_fast=True)): {note}"
            )

    def _tell_tune_it_ended(self, running: _Running) -> None:
        from ray.tune.experiment import Trial

        running.tune_trial.set_status(Trial.TERMINATED)
        if running.last_result is None:
            # Nothing to complete with (a scheduler keeps what it is given: the median
            # rule would read an empty result's time): the trial is taken off instead.
            self.scheduler.on_trial_remove(self.controller, running.tune_trial)
        else:
            self.scheduler.on_trial_complete(
                self.controller, running.tune_trial, running.last_result
            )
        if self.suggestions.searcher is not None:
            self.suggestions.searcher.on_trial_complete(
                running.trial.trial_id, result=running.last_result
            )

    def _close_trial(self, running: _Running, state: TrialState, note: str) -> None:
        """The trial's session stops; its group goes back to the pool only after an
        end that leaves it sound (a failed trial's group is shut down)."""
        self.sweep.end_trial(running.trial, state, note)
        self.running.pop(running.trial.index, None)
        if running.unsubscribe is not None:
            running.unsubscribe()
        session = running.session
        if state is TrialState.ERROR and isinstance(session.group, LentGroup):
            session.group.discard_on_return()
        with contextlib.suppress(Exception):
            session.stop()
        self._write_record()
        self.sweep.emit(SweepEvent(SweepEventKind.ENDED, running.trial.index))

    def _end(self) -> None:
        """Every running trial stops at a step boundary, every group is freed."""
        sweep = self.sweep
        reason = sweep.stop_reason if sweep.stop_requested else "stopped because the sweep ended"
        for running in list(self.running.values()):
            if running.handle is not None and not running.handle.done():
                running.stop_reason = running.stop_reason or reason
                running.handle.stop(reason)
        grace = sweep.trial_config.stop_grace_s + 10.0
        for running in list(self.running.values()):
            if running.handle is not None:
                running.handle.wait_left(grace)
            self._close_trial(
                running, TrialState.STOPPED, running.trial.note or running.stop_reason or reason
            )
        self.pool.close()
        for trial in self.trials:
            if not trial.state.ended:
                sweep.end_trial(trial, TrialState.STOPPED, reason)
        if self.own_connection and not _notebook_sessions():
            with contextlib.suppress(Exception):
                self.connection.shutdown()
        sweep.ended_at = time.time()
        self._write_record()
        sweep.finish()

    def _write_record(self) -> None:
        with contextlib.suppress(Exception):  # the trials' own runs hold what matters
            RunDirectory(self.sweep.storage, self.sweep.name).write_json(
                SWEEP_RECORD, _jsonable(self.sweep.record())
            )


def _mean(per_rank: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the ranks that reported it."""
    sums: dict[str, list[float]] = {}
    for numbers in per_rank.values():
        for name, value in numbers.items():
            sums.setdefault(name, []).append(value)
    return {name: sum(values) / len(values) for name, values in sums.items()}


# ---- the entry point ----------------------------------------------------------------------
def sweep(
    train: str | Callable,
    param_space: Mapping[str, Any],
    *,
    metric: str | None = None,
    mode: str | None = None,
    num_samples: int = 1,
    max_concurrent_trials: int | None = None,
    scheduler: Any = None,
    search_alg: Any = None,
    tune_config: Any = None,
    failure_config: Any = None,
    max_failures: int | None = None,
    workers: int = 2,
    cpus_per_worker: float | None = None,
    gpu: bool = False,
    storage: str | None = None,
    name: str | None = None,
    address: str | None = None,
    background: bool = False,
) -> Sweep:
    """Run a hyperparameter search whose trials each train on ``workers`` ranks.

    ``train`` is a training cell's code (the trial's config arrives as variables and
    ``rtnb.get_config()``) or a function ``train(config)`` (Ray Train's
    ``train_loop_per_worker``). The rest are Ray Tune's: ``param_space`` with
    Tune's search spaces (``{"train_loop_config": {...}}`` as given to a
    ``TorchTrainer`` under a ``Tuner`` works too), ``metric``/``mode``,
    ``num_samples``, ``max_concurrent_trials`` (default: as many as fit in the free
    CPUs), a ``scheduler`` that stops trials early (``ASHAScheduler``,
    ``MedianStoppingRule``), a ``search_alg`` (a Tune ``Searcher`` such as
    ``OptunaSearch``), or a ``tune.TuneConfig`` holding them; ``failure_config``
    (``tune.FailureConfig``) or ``max_failures``: how often a failed trial is
    retried, from its latest checkpoint. Each trial is a run named
    ``NAME-tNNN`` in ``storage``. Blocks until the sweep ends (Ctrl-C stops it
    cleanly) unless ``background``.

    Example::

        In [6]: from ray import tune
        In [7]: s = rtnb.sweep(code, {"lr": tune.loguniform(1e-4, 1e-1)}, metric="loss",
           ...:                mode="min", num_samples=8, scheduler=ASHAScheduler(max_t=20))
        In [8]: s.best_config
    """
    if tune_config is not None:
        metric = metric or tune_config.metric
        mode = mode or tune_config.mode
        num_samples = tune_config.num_samples if num_samples == 1 else num_samples
        max_concurrent_trials = max_concurrent_trials or tune_config.max_concurrent_trials
        scheduler = scheduler or tune_config.scheduler
        search_alg = search_alg or tune_config.search_alg
    fail_fast = False
    if failure_config is not None:
        if max_failures is None:
            max_failures = int(failure_config.max_failures)  # -1: retry always, as in Tune
        fail_fast = bool(failure_config.fail_fast)
    max_failures = int(max_failures or 0)
    code = _check_train(train)
    space = _check_space(param_space)
    scheduler = _check_scheduler(scheduler)
    searcher = _check_searcher(search_alg)
    metric, mode = _metric_and_mode(metric, mode, scheduler, searcher)
    _check_reports(code, metric)
    if searcher is not None:
        try:
            # False when the searcher was made with its own space: it keeps that.
            searcher.set_search_properties(metric, mode, copy.deepcopy(space))
        except ValueError as exc:
            raise ConfigError(f"the search algorithm refused the sweep: {one_line(exc)}") from None
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ConfigError(f"num_samples must be a whole number ≥ 1, got {num_samples!r}")
    if max_concurrent_trials is not None and (
        not isinstance(max_concurrent_trials, int) or max_concurrent_trials < 1
    ):
        raise ConfigError(
            f"max_concurrent_trials must be a whole number ≥ 1, got {max_concurrent_trials!r}"
        )
    name = (
        check_name(name, "sweep name") if name is not None else time.strftime("sweep-%Y%m%d-%H%M%S")
    )
    try:
        trial_config = SessionConfig(
            workers=workers,
            gpu=gpu,
            address=address,
            storage=storage,
            # The runner retries a failed trial (FailureConfig); its session does not
            # recover by itself, so each failure counts once.
            max_failures=0,
            score=metric,
            mode=mode,
            **({"cpus_per_worker": cpus_per_worker} if cpus_per_worker is not None else {}),
        )
    except TypeError as exc:
        raise ConfigError(f"bad sweep option: {exc}") from None
    if trial_config.local or trial_config.elastic:
        raise ConfigError("a sweep's trials run on a fixed number of ranks: workers=N, N ≥ 1")
    suggestions = _Suggestions(space, num_samples, searcher)
    if searcher is None:
        try:
            total = suggestions.total
        except Exception as exc:  # noqa: BLE001 - Tune's own words on a bad space
            raise ConfigError(f"param_space is not a Tune search space: {one_line(exc)}") from None
    else:
        total = num_samples
    connection, own = _connect(trial_config)
    try:
        concurrent = _concurrency(trial_config, max_concurrent_trials, total)
        scheduler.set_search_properties(metric, mode)
        handle = Sweep(
            name,
            code,
            space,
            metric,
            mode,
            trial_config.storage_path,
            total,
            trial_config,
            concurrent,
        )
        RunDirectory(trial_config.storage_path, name).ensure_writable()
    except BaseException:
        if own and not _notebook_sessions():
            with contextlib.suppress(Exception):
                connection.shutdown()
        raise
    for viewer in list(_VIEWERS):
        with contextlib.suppress(Exception):
            viewer(handle)
    SweepRunner(handle, suggestions, scheduler, max_failures, fail_fast, connection, own).start()
    if background:
        return handle
    return handle.wait()


# ---- checks: one line before any trial starts ---------------------------------------------
def _check_train(train: Any) -> str | Callable:
    if callable(train):
        return train
    if not isinstance(train, str) or not train.strip():
        raise ConfigError(
            "a sweep trains with a cell's code (a string) or a function train(config), "
            f"not {type(train).__name__}"
        )
    code = textwrap.dedent(train)
    try:
        check_syntax(code, "<sweep trial>")
    except CellError as exc:
        raise CellError(
            str(exc)
            .replace("the cell has", "the trial's code has", 1)
            .replace("was not sent to the ranks", "no trial started", 1),
            exc_type="SyntaxError",
        ) from None
    return code


def _check_space(param_space: Any) -> dict:
    if not isinstance(param_space, Mapping):
        raise ConfigError(
            f"param_space must be a dict of Tune search spaces, e.g. "
            f"{{'lr': tune.loguniform(1e-4, 1e-1)}}, not {type(param_space).__name__}"
        )
    space = dict(param_space)
    if set(space) == {"train_loop_config"} and isinstance(space["train_loop_config"], Mapping):
        space = dict(space["train_loop_config"])  # as given to a TorchTrainer under a Tuner
    for path, value in _walk(space):
        module = type(value).__module__.split(".")[0]
        if module in _FOREIGN_SPACES:
            raise ConfigError(
                f"param_space[{path}] is a {type(value).__module__}.{type(value).__name__}: "
                "a sweep takes Ray Tune's search spaces (tune.loguniform(...), "
                "tune.choice([...]), tune.grid_search([...])); a library's own space goes "
                "to its Tune searcher (e.g. OptunaSearch(space=...), search_alg=...)"
            )
    return space


def _walk(space: Mapping, prefix: str = ""):
    for key, value in space.items():
        path = f"{prefix}{key!r}"
        if isinstance(value, Mapping) and "grid_search" not in value:
            yield from _walk(value, f"{path}][")
        else:
            yield path, value


def _check_scheduler(scheduler: Any) -> Any:
    from ray.tune.schedulers import FIFOScheduler, TrialScheduler

    if scheduler is None:
        return FIFOScheduler()
    if isinstance(scheduler, str):
        from ray.tune.schedulers import ASHAScheduler, MedianStoppingRule

        made = {"asha": ASHAScheduler, "median": MedianStoppingRule, "fifo": FIFOScheduler}
        if scheduler not in made:
            raise ConfigError(
                f"scheduler={scheduler!r}: use 'asha', 'median', 'fifo' or a Tune scheduler "
                "object, e.g. ASHAScheduler(max_t=20, grace_period=2)"
            )
        return made[scheduler]()
    if not isinstance(scheduler, TrialScheduler):
        raise ConfigError(
            f"scheduler must be a Ray Tune TrialScheduler (ASHAScheduler, MedianStoppingRule, "
            f"FIFOScheduler), not {type(scheduler).__name__}"
        )
    for cls in type(scheduler).__mro__:
        if cls.__name__ in _PAUSING:
            raise ConfigError(
                f"{type(scheduler).__name__} pauses trials and resumes them later; a sweep's "
                "trials run to their end or stop early: use ASHAScheduler, "
                "AsyncHyperBandScheduler or MedianStoppingRule"
            )
    return scheduler


def _check_searcher(search_alg: Any) -> Any:
    if search_alg is None:
        return None
    if search_alg == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch

            return OptunaSearch()
        except (ImportError, AssertionError):
            raise ConfigError("search_alg='optuna' needs Optuna: pip install optuna") from None
    if isinstance(search_alg, str):
        raise ConfigError(
            f"search_alg={search_alg!r}: use 'optuna' or a Tune Searcher object, e.g. "
            "OptunaSearch(), HyperOptSearch()"
        )
    from ray.tune.search import Searcher

    if not isinstance(search_alg, Searcher):
        raise ConfigError(
            f"search_alg must be a Ray Tune Searcher (OptunaSearch, HyperOptSearch, ... "
            f"optionally in a ConcurrencyLimiter), not {type(search_alg).__name__}"
        )
    return search_alg


def _metric_and_mode(metric: Any, mode: Any, scheduler: Any, searcher: Any) -> tuple[str, str]:
    for source in (scheduler, searcher):
        if source is None:
            continue
        own = getattr(source, "_metric", None), getattr(source, "_mode", None)
        for given, its, what in ((metric, own[0], "metric"), (mode, own[1], "mode")):
            if given and its and given != its:
                raise ConfigError(
                    f"the sweep's {what} is {given!r} but {type(source).__name__} was made "
                    f"with {what}={its!r}: give it in one place"
                )
        metric = metric or own[0]
        mode = mode or own[1]
    if not metric or not isinstance(metric, str):
        raise ConfigError(
            "name the metric the sweep optimises: metric='loss' (a key the training code "
            "passes to rtnb.report) and mode='min' or 'max'"
        )
    if mode not in ("min", "max"):
        raise ConfigError(f"mode is 'min' or 'max' (for metric {metric!r}), not {mode!r}")
    return metric, mode


def _check_reports(code: str | Callable, metric: str) -> None:
    """One line when every ``report(...)`` of the training code is a dict literal and
    none names ``metric`` (code that reports some other way is left to the trials)."""
    if callable(code):
        try:
            source = textwrap.dedent(inspect.getsource(code))
        except (OSError, TypeError):
            return
    else:
        source = code
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    names: set[str] = set()
    found = False
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called != "report":
            continue
        found = True
        arg = (
            node.args[0]
            if node.args
            else next((k.value for k in node.keywords if k.arg == "metrics"), None)
        )
        if not isinstance(arg, ast.Dict) or not all(
            isinstance(k, ast.Constant) and isinstance(k.value, str) for k in arg.keys
        ):
            return  # built at run time: the trials tell
        names.update(k.value for k in arg.keys)
    if found and metric not in names:
        raise ConfigError(
            f"the training code never reports {metric!r} (its report() calls name "
            f"{', '.join(sorted(names)) or 'nothing'}): name one of those as the metric"
        )


def _connect(config: SessionConfig) -> tuple[ClusterConnection, bool]:
    """The Ray the trials run on: this process's, else the one ``%rtnb start`` would
    join or start; (the connection, whether the sweep started it)."""
    import ray

    if ray.is_initialized():
        return connect(None), False
    connection = connect(
        config.address,
        timeout_s=config.connect_timeout_s,
        listen=config.listen,
        need_cpus=config.workers * config.cpus_per_worker,
        ranks=config.workers,
    )
    return connection, True


def _concurrency(config: SessionConfig, asked: int | None, total: int | None) -> int:
    """How many trials run at once: ``asked``, which must fit in the cluster's CPUs
    (and GPUs), else as many as the free ones hold (at least one)."""
    import ray

    per_trial = config.workers * config.cpus_per_worker
    cluster = ray.cluster_resources()
    free = ray.available_resources()
    cpus, free_cpus = rank_cpus(cluster), rank_cpus(free, cluster)
    if asked is not None:
        need = asked * per_trial
        if need > cpus + 1e-9:
            raise ClusterError(
                f"max_concurrent_trials {asked} × {config.workers} ranks × "
                f"{config.cpus_per_worker:g} CPU need {need:g} CPUs, but the cluster has "
                f"{cpus:g}: lower max_concurrent_trials, workers or cpus_per_worker"
            )
        if config.gpu and asked * config.workers > cluster.get("GPU", 0.0):
            raise ClusterError(
                f"max_concurrent_trials {asked} × {config.workers} GPU ranks need "
                f"{asked * config.workers} GPUs, but the cluster has {cluster.get('GPU', 0):g}"
            )
        if need > free_cpus + 1e-9:
            raise ClusterError(
                f"max_concurrent_trials {asked} × {config.workers} ranks × "
                f"{config.cpus_per_worker:g} CPU need {need:g} CPUs, but only {free_cpus:g} "
                f"of the cluster's {cpus:g} are free (the notebook's group holds its share): "
                "lower max_concurrent_trials or cpus_per_worker, or stop the group"
            )
        concurrent = asked
    else:
        if per_trial > free_cpus + 1e-9:
            raise ClusterError(
                f"a trial of {config.workers} ranks × {config.cpus_per_worker:g} CPU needs "
                f"{per_trial:g} CPUs, but {free_cpus:g} of the cluster's {cpus:g} are free: "
                "use fewer workers or a smaller cpus_per_worker (e.g. 0.5)"
            )
        concurrent = max(1, int(free_cpus / per_trial + 1e-9)) if per_trial else 1
        if config.gpu:
            concurrent = max(1, min(concurrent, int(free.get("GPU", 0.0)) // config.workers))
    return max(1, min(concurrent, total)) if total else concurrent


# ---- small helpers --------------------------------------------------------------------------
_TRIAL_SESSIONS: weakref.WeakSet = weakref.WeakSet()


def _notebook_sessions() -> list:
    """The sessions of this process that have a group, sweeps' trials left out."""
    from rtnb.driver._session import started_sessions

    return [s for s in started_sessions() if s not in _TRIAL_SESSIONS]


def _config_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rank variables a trial's config becomes: each key that can be a variable
    (``lambda`` cannot: ``rtnb.get_config()["lambda"]``), and the whole config for
    ``rtnb.get_config()``."""
    values = {
        k: v
        for k, v in config.items()
        if isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k)
    }
    values[CONFIG_NAME] = dict(config)
    return values


def _constants(space: Mapping[str, Any]) -> dict[str, Any]:
    """``space`` without its search dimensions (a searcher's suggestion fills them)."""
    from ray.tune.search.sample import Domain

    out: dict[str, Any] = {}
    for key, value in space.items():
        if isinstance(value, Mapping) and "grid_search" not in value:
            out[key] = _constants(value)
        elif not isinstance(value, Domain) and not (
            isinstance(value, Mapping) and "grid_search" in value
        ):
            out[key] = value
    return out


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
