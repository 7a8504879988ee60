"""Scenarios that mostly wait, run beside the rest of the suite.

A few tests prove what happens over Ray's own timeouts or in a machine of their own:
a Ray killed under a kernel that must outlive Ray's "GCS gone, exit" rule, the
user's own Ray tools in a PID namespace of their own. Each starts its own Ray (never
the session's cluster) and spends most of its minute waiting, which on 2 cores left
a core idle for minutes. So such a scenario is registered by its module at import
(:func:`scenario`), asked for by a test with ``pytest.mark.background(key)``, and
run in one lane beside the suite from the start of the run: one scenario at a time
(two of them together once made a Ray of one time out starting), at a lower CPU
priority than the suite's own tests (inherited by every process the scenario
starts), so the suite's tests keep their pace and the scenario takes the idle
core. The test then asserts on what its scenario returned, or on its exception.

A test run alone (``pytest tests/test_ray_lost.py::...``) still waits only for its
own scenario: the lane runs just what the selected tests ask for.

On a slow day the suite keeps both cores busy and a scenario at the lane's priority
starves: a Ray it starts misses Ray's own fixed bounds (a raylet's 30 s to register, a
head that never comes up). So a scenario that failed (raised, or returned a value its
``failed_because`` names a failure) runs once more at once, still beside the suite
but at nearly the suite's priority, in a second thread; its test gets that run. Only
when that too failed does the test that asks run it a last time, alone (the suite
waits on it meanwhile). Running the second try alone, as before, made a slow day's
suite wait out four scenarios in turn (~13 minutes of a run that must end within
CI's 90). The run's summary names every scenario run again, with why each try failed.
A scenario that fails alone fails its test as before.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import _margins

# Nice value of the lane's thread, so of every process a scenario starts: at 10 a
# scenario gets about a tenth of a core the suite's own test wants, and any idle one.
# (At 5 the suite's first tests, beside the lane, took 150 s longer: a third of what
# the lane saved.)
LANE_NICE = 10
# The second try's: one above the suite's own, so that the run's end can tell its
# processes from the suite's.
AGAIN_NICE = 1


@dataclass(frozen=True)
class _Scenario:
    run: Callable[[Path], Any]
    failed_because: Callable[[Any], str]  # why a returned value is a failure; "" if not


_registered: dict[str, _Scenario] = {}


def scenario(
    key: str, failed_because: Callable[[Any], str] = lambda value: ""
) -> Callable[[Callable[[Path], Any]], Callable[[Path], Any]]:
    """Register ``run(folder)`` under ``key``; it gets an empty folder of its own
    (removed at the end of the run) and returns what its test asserts on.
    ``failed_because(value)``: for a scenario that records failures in what it returns, why
    that value failed ("" when it did not), so that it is run again alone."""

    def register(run: Callable[[Path], Any]) -> Callable[[Path], Any]:
        known = _registered.get(key)
        if known is not None and known.run is not run:
            raise ValueError(f"two background scenarios named {key!r}")
        _registered[key] = _Scenario(run, failed_because)
        return run

    return register


@dataclass
class _Outcome:
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None
    took_s: float = 0.0
    # Why each earlier try failed, when the scenario was run again.
    failed_tries: list[str] = field(default_factory=list)

    def failure(self, failed_because: Callable[[Any], str]) -> str:
        if self.error is not None:
            lines = str(self.error).strip().splitlines()
            return lines[-1] if lines else type(self.error).__name__
        return failed_because(self.value)


class Lane:
    """Runs the asked-for scenarios in order in one thread (see the module's
    docstring)."""

    def __init__(self) -> None:
        self._outcomes: dict[str, _Outcome] = {}
        self._folders: list[str] = []
        self._threads: list[threading.Thread] = []
        self._again: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        # Held while a scenario runs: never two at once (two Rays starting together on
        # 2 cores once timed one of them out), a run again alone included.
        self._one_at_a_time = threading.Lock()

    def start(self, keys: list[str]) -> None:
        unknown = [k for k in keys if k not in _registered]
        if unknown:
            raise ValueError(f"no background scenario registered as {unknown}")
        order = list(dict.fromkeys(keys))
        self._outcomes = {key: _Outcome() for key in order}
        if order:
            self._threads = [
                threading.Thread(
                    target=self._run, args=(order,), name="rtnb-suite-background", daemon=True
                ),
                threading.Thread(
                    target=self._run_again, name="rtnb-suite-background-again", daemon=True
                ),
            ]
            for thread in self._threads:
                thread.start()

    def result(self, key: str, timeout_s: float) -> Any:
        """What the scenario returned (its exception raised here, with its traceback
        in the message), waiting up to ``timeout_s`` for the lane to get to it."""
        outcome = self._outcomes.get(key)
        if outcome is None:
            raise RuntimeError(
                f"background scenario {key!r} was not asked for: mark the test "
                f"pytest.mark.background({key!r})"
            )
        if not outcome.done.wait(timeout_s):
            raise TimeoutError(f"background scenario {key!r} did not end within {timeout_s} s")
        why = outcome.failure(_registered[key].failed_because)
        if why and len(outcome.failed_tries) < 2:
            # Its second try failed too: the last, alone. This thread is the suite's,
            # at its priority, and the suite waits here.
            outcome.failed_tries.append(why)
            self._attempt(key, outcome)
        if outcome.error is not None:
            raise outcome.error
        return outcome.value

    def took(self) -> dict[str, float]:
        """Seconds each ended scenario took, by key (its run alone, if it had one)."""
        return {k: o.took_s for k, o in self._outcomes.items() if o.done.is_set()}

    def ran_again(self) -> dict[str, list[str]]:
        """The scenarios run again, each with why its earlier tries failed (two: its
        last try ran alone)."""
        return {k: o.failed_tries for k, o in self._outcomes.items() if o.failed_tries}

    def close(self) -> None:
        """At the run's end. A scenario still running (the run was interrupted or
        stopped at a first failure) has its processes killed: every descendant of
        this process at the second try's nice or above (Ray's workers add to it).
        The suite's own tests run at 0; what of theirs runs niced (Ray's agents and
        idle workers) belongs to Rays their fixtures have ended by now."""
        self._again.put(None)
        if any(thread.is_alive() for thread in self._threads):
            import psutil

            for proc in psutil.Process().children(recursive=True):
                try:
                    if proc.nice() >= AGAIN_NICE:
                        proc.kill()
                except psutil.Error:
                    pass
        for thread in self._threads:
            thread.join(timeout=30)
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)

    def _run(self, order: list[str]) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LANE_NICE)
        try:
            for key in order:
                outcome = self._outcomes[key]
                _margins.begin_thread_test(f"background scenario {key}")
                why = ""
                try:
                    self._attempt(key, outcome)
                    why = outcome.failure(_registered[key].failed_because)
                finally:
                    if why:
                        outcome.failed_tries.append(why)
                        self._again.put(key)
                    else:
                        outcome.done.set()
        finally:
            self._again.put(None)

    def _run_again(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), AGAIN_NICE)
        while (key := self._again.get()) is not None:
            outcome = self._outcomes[key]
            _margins.begin_thread_test(f"background scenario {key}, second try")
            try:
                self._attempt(key, outcome)
            finally:
                outcome.done.set()

    def _attempt(self, key: str, outcome: _Outcome) -> None:
        with self._one_at_a_time:
            folder = tempfile.mkdtemp(prefix=f"rtnb-bg-{key}-")
            self._folders.append(folder)
            outcome.value, outcome.error = None, None
            began = time.monotonic()
            try:
                outcome.value = _registered[key].run(Path(folder))
            except BaseException as exc:  # handed to the test that asks
                outcome.error = RuntimeError(
                    f"background scenario {key!r} failed:\n{traceback.format_exc()}"
                )
                outcome.error.__cause__ = exc
            finally:
                outcome.took_s = time.monotonic() - began
