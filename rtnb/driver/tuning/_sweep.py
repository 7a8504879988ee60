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
comes from a ``GroupPool`` (``_sweep_pool``): the ranks of a finished trial become
the next trial's with a fresh namespace, so a trial does not pay a group's start.

``SweepRunner`` (``_sweep_runner``, with ``rtnb.sweep``) is the one owner of a
sweep's flow (asking for configs, starting trials, the scheduler's decisions,
retries, the end); Tune's pieces and the checks of the user's input are in
``_sweep_tune``, small data helpers in ``_sweep_values``. This module holds what the
user and the views see: :class:`Sweep`, the handle, its trials and events::

    sweep = rtnb.sweep(train_code, {"lr": tune.loguniform(1e-4, 1e-1)},
                       metric="loss", mode="min", num_samples=8,
                       scheduler=ASHAScheduler(max_t=20, grace_period=2))
    sweep.best_config, sweep.best_checkpoint
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rtnb.core._config import SessionConfig
from rtnb.core._redact import redact_uri
from rtnb.driver.tuning._values import config_values, flat_config, notebook_sessions
from rtnb.errors import (
    CellInterrupted,
    ConfigError,
    RtnbError,
)
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import CheckpointInfo, CheckpointStore

__all__ = [
    "Sweep",
    "SweepEvent",
    "SweepEventKind",
    "SweepTrial",
    "TrialState",
    "on_sweep_start",
    "show_to_viewers",
]


# Called with each new sweep before it starts, in the caller's thread (the magics
# register the live view here: the engine never imports widgets).
_VIEWERS: list[Callable[[Sweep], None]] = []


def on_sweep_start(viewer: Callable[[Sweep], None]) -> Callable[[], None]:
    """Call ``viewer(sweep)`` for every sweep started in this process, before its
    first trial; returns the function that removes it."""
    _VIEWERS.append(viewer)
    return lambda: _VIEWERS.remove(viewer) if viewer in _VIEWERS else None


def show_to_viewers(started: Sweep) -> None:
    """A new sweep, before its first trial, to every viewer (a failing view never
    stops the sweep)."""
    for viewer in list(_VIEWERS):
        with contextlib.suppress(Exception):
            viewer(started)


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
            running = notebook_sessions()
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
        session.push(config_values(chosen.config))
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
            rows.append({**row, **{f"config/{k}": v for k, v in flat_config(config).items()}})
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
