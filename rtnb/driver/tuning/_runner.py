"""The one owner of a sweep's flow (SweepRunner, in a thread of its own), and
``rtnb.sweep`` that starts one (see rtnb.driver.tuning._sweep for the whole design)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rtnb.core._config import SessionConfig, check_name
from rtnb.driver.cluster import ClusterConnection, connect, rank_cpus
from rtnb.driver.lifecycle import FailurePolicy
from rtnb.driver.ranks import WorkerGroup
from rtnb.driver.tuning._pool import GroupPool
from rtnb.driver.tuning._sweep import (
    Sweep,
    SweepEvent,
    SweepEventKind,
    SweepTrial,
    TrialState,
    show_to_viewers,
)
from rtnb.driver.tuning._tune import (
    Suggestions,
    TuneController,
    check_reports,
    check_scheduler,
    check_searcher,
    check_space,
    check_train,
    metric_and_mode,
)
from rtnb.driver.tuning._values import (
    config_values,
    jsonable,
    mark_trial_session,
    mean_of_ranks,
    notebook_sessions,
)
from rtnb.errors import (
    ClusterError,
    ConfigError,
    RtnbError,
    one_line,
)
from rtnb.storage._layout import SWEEP_RECORD
from rtnb.storage._rundir import RunDirectory

__all__ = ["RunningTrial", "SweepRunner", "concurrency", "connect_for_trials", "sweep"]


# How long the runner waits for an event before it looks at its slots again.
_TICK_S = 0.5


@dataclass
class RunningTrial:
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
    attempt: int = 0  # the cell's runs after a failure (its handle's recoveries)


# ---- the flow -----------------------------------------------------------------------------
class SweepRunner:
    """Owns one sweep's flow, in a thread of its own (see the module docstring).

    Failures follow Tune's ``FailureConfig``: each trial is a session whose
    controller asks a ``FailurePolicy(max_failures, retry_errors=True)`` — the same
    policy a notebook's session asks, with a failed cell's error retried as Tune
    does — so a trial whose cell fails (its code raised, a rank died) runs again on
    a rebuilt group, the journal replayed up to it and ``get_checkpoint()`` its latest
    checkpoint, ``max_failures`` times (-1: always); then it is marked ``error``.
    ``fail_fast`` ends the sweep at the first error."""

    def __init__(
        self,
        handle: Sweep,
        suggestions: Suggestions,
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
        self.controller = TuneController()
        self.events: queue.Queue = queue.Queue()
        self.running: dict[int, RunningTrial] = {}
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
            self._start_trial(RunningTrial(trial, None, tune_trial))

    def _start_trial(self, running: RunningTrial) -> None:
        from rtnb.driver.session import Session

        trial = running.trial
        config = dataclasses.replace(self.sweep.trial_config, name=trial.run_name)
        connection = self.connection
        session = Session(
            config,
            failure_policy=FailurePolicy(self.max_failures, retry_errors=True),
            group_factory=self.pool.factory,
            connector=lambda *_a, **_k: ClusterConnection(
                address=connection.address, owned=False, client_mode=connection.client_mode
            ),
        )
        running.session = session
        mark_trial_session(session)
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

    def _run_cell(self, running: RunningTrial) -> None:
        code, trial = self.sweep.code, running.trial
        quiet = lambda _rank, _stream, _text: None  # noqa: E731 - in the run's logs/
        if callable(code):
            handle = running.session.run_background(code, config=trial.config, output=quiet)
        else:
            running.session.push(config_values(trial.config))
            handle = running.session.run_background(code, output=quiet, label=trial.trial_id)
        running.handle = handle
        handle.add_done_callback(lambda h: self.events.put(("ended", trial.index, h)))

    def _on_reports(self, running: RunningTrial, rank: int, batch) -> None:
        """A rank's reports (the cell's poll thread): each step becomes one result,
        the mean of every number the ranks reported for it, once every rank is past it
        (its reports arrive in order, so then nothing more of that step will come). A
        metric only some ranks report is the mean over those that did; a rank that
        reports nothing at all holds the results back until the trial ends."""
        world = running.session.world_size
        attempt = running.handle.recoveries if running.handle is not None else 0
        if attempt != running.attempt:
            # The cell runs again after a failure, from its checkpoint's step: what
            # the failed attempt left half-reported is not a result.
            running.attempt = attempt
            running.pending.clear()
            running.progress.clear()
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
            self.events.put(
                ("result", running.trial.index, done, mean_of_ranks(running.pending.pop(done)))
            )

    def _handle(self, event: tuple) -> None:
        kind, index = event[0], event[1]
        running = self.running.get(index)
        if running is None:
            return
        if kind == "result":
            self._result(running, event[2], event[3])
        elif kind == "ended" and event[2] is running.handle:
            self._ended(running)

    def _result(self, running: RunningTrial, step: int, means: dict[str, float]) -> None:
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

    def _ended(self, running: RunningTrial) -> None:
        trial, handle = running.trial, running.handle
        error = handle.error
        trial.failures = running.session.failures
        for step in sorted(running.pending):  # what no rank will report more of
            self._result(running, step, mean_of_ranks(running.pending.pop(step)))
        if error is None or running.at_end:
            state, note = TrialState.TERMINATED, ""
            trial.stopped_at = None
            trial.value = handle.wait(0) if error is None else None
        elif running.stop_reason is not None:
            state, note = TrialState.STOPPED, running.stop_reason
        elif self.sweep.stop_requested:
            state, note = TrialState.STOPPED, self.sweep.stop_reason
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

    def _trial_failed(self, running: RunningTrial, note: str) -> None:
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

    def _tell_tune_it_ended(self, running: RunningTrial) -> None:
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

    def _close_trial(self, running: RunningTrial, state: TrialState, note: str) -> None:
        """The trial's session stops; its group goes back to the pool only after an
        end that leaves it sound (a failed trial's group is shut down)."""
        self.sweep.end_trial(running.trial, state, note)
        self.running.pop(running.trial.index, None)
        if running.unsubscribe is not None:
            running.unsubscribe()
        session = running.session
        if state is TrialState.ERROR and isinstance(session.group, WorkerGroup):
            session.group.retire = True  # never lent to another trial
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
        if self.own_connection and not notebook_sessions():
            with contextlib.suppress(Exception):
                self.connection.shutdown()
        sweep.ended_at = time.time()
        self._write_record()
        sweep.finish()

    def _write_record(self) -> None:
        with contextlib.suppress(Exception):  # the trials' own runs hold what matters
            RunDirectory(self.sweep.storage, self.sweep.name).write_json(
                SWEEP_RECORD, jsonable(self.sweep.record())
            )


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
    code = check_train(train)
    space = check_space(param_space)
    scheduler = check_scheduler(scheduler)
    searcher = check_searcher(search_alg)
    metric, mode = metric_and_mode(metric, mode, scheduler, searcher)
    check_reports(code, metric)
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
            # A trial's session asks FailureConfig's policy (SweepRunner), not this.
            max_failures=0,
            score=metric,
            mode=mode,
            **({"cpus_per_worker": cpus_per_worker} if cpus_per_worker is not None else {}),
        )
    except TypeError as exc:
        raise ConfigError(f"bad sweep option: {exc}") from None
    if trial_config.local or trial_config.elastic:
        raise ConfigError("a sweep's trials run on a fixed number of ranks: workers=N, N ≥ 1")
    suggestions = Suggestions(space, num_samples, searcher)
    if searcher is None:
        try:
            total = suggestions.total
        except Exception as exc:  # noqa: BLE001 - Tune's own words on a bad space
            raise ConfigError(f"param_space is not a Tune search space: {one_line(exc)}") from None
    else:
        total = num_samples
    connection, own = connect_for_trials(trial_config)
    try:
        concurrent = concurrency(trial_config, max_concurrent_trials, total)
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
        if own and not notebook_sessions():
            with contextlib.suppress(Exception):
                connection.shutdown()
        raise
    show_to_viewers(handle)
    SweepRunner(handle, suggestions, scheduler, max_failures, fail_fast, connection, own).start()
    if background:
        return handle
    return handle.wait()


def connect_for_trials(config: SessionConfig) -> tuple[ClusterConnection, bool]:
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


def concurrency(config: SessionConfig, asked: int | None, total: int | None) -> int:
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
