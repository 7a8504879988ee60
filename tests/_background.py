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
head that never comes up). So a scenario that failed beside the suite (raised, or
returned a value its ``failed_because`` names a failure) runs once more when its
test asks for it, alone and at the suite's priority (the suite waits on it
meanwhile), and the test asserts on that run; the run's summary names every scenario
run again, with why the first try failed. A scenario that fails alone fails its test as before.
"""

from __future__ import annotations

import os
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
    # Why the try beside the suite failed, when the scenario was run again alone.
    ran_again_after: str = ""

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
        self._thread: threading.Thread | None = None
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
            self._thread = threading.Thread(
                target=self._run, args=(order,), name="rtnb-suite-background", daemon=True
            )
            self._thread.start()

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
        if why and not outcome.ran_again_after:
            # This thread is the suite's, at its priority, and the suite waits here.
            self._attempt(key, outcome)
            outcome.ran_again_after = why
        if outcome.error is not None:
            raise outcome.error
        return outcome.value

    def took(self) -> dict[str, float]:
        """Seconds each ended scenario took, by key (its run alone, if it had one)."""
        return {k: o.took_s for k, o in self._outcomes.items() if o.done.is_set()}

    def ran_again(self) -> dict[str, str]:
        """The scenarios run again alone, each with why its try beside the suite failed."""
        return {k: o.ran_again_after for k, o in self._outcomes.items() if o.ran_again_after}

    def close(self) -> None:
        """At the run's end. A scenario still running (the run was interrupted or
        stopped at a first failure) has its processes killed: every descendant of
        this process at the lane's nice or above (Ray's workers add to it). The
        suite's own tests run at 0; what of theirs runs niced (Ray's agents and idle
        workers) belongs to Rays their fixtures have ended by now."""
        if self._thread is not None and self._thread.is_alive():
            import psutil

            for proc in psutil.Process().children(recursive=True):
                try:
                    if proc.nice() >= LANE_NICE:
                        proc.kill()
                except psutil.Error:
                    pass
            self._thread.join(timeout=30)
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)

    def _run(self, order: list[str]) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LANE_NICE)
        for key in order:
            outcome = self._outcomes[key]
            _margins.begin_thread_test(f"background scenario {key}")
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
