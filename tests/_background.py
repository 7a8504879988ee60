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

With the suite's two test processes (pytest-xdist) each process has a lane, and the
lanes share one folder of the run (``SHARED_ENV``): a scenario is claimed by the first
lane to reach it (a file made exclusively), run while that lane holds the machine's
lane lock (so still one scenario at a time on the machine), and its outcome pickled
there, where the test that asks for it reads it, in whichever process it runs.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests import _margins

# Nice value of the lane's thread, so of every process a scenario starts: at 10 a
# scenario gets about a tenth of a core the suite's own test wants, and any idle one.
# (At 5 the suite's first tests, beside the lane, took 150 s longer: a third of what
# the lane saved.)
LANE_NICE = 10

# The run's folder that every test process of one run shares (made by the first
# process, the one that starts the others, and inherited by them).
SHARED_ENV = "RTNB_SUITE_SHARED"

_registered: dict[str, Callable[[Path], Any]] = {}


def shared_folder() -> Path:
    """This run's folder shared by its test processes."""
    return Path(os.environ[SHARED_ENV])


def scenario(key: str) -> Callable[[Callable[[Path], Any]], Callable[[Path], Any]]:
    """Register ``run(folder)`` under ``key``; it gets an empty folder of its own
    (removed at the end of the run) and returns what its test asserts on."""

    def register(run: Callable[[Path], Any]) -> Callable[[Path], Any]:
        if key in _registered and _registered[key] is not run:
            raise ValueError(f"two background scenarios named {key!r}")
        _registered[key] = run
        return run

    return register


@dataclass
class _Outcome:
    """What one scenario ended with, as pickled for the test that asks for it."""

    value: Any = None
    error: str | None = None  # the scenario's traceback
    took_s: float = 0.0


class Lane:
    """Runs the asked-for scenarios in order in one thread (see the module's
    docstring)."""

    def __init__(self) -> None:
        self._keys: list[str] = []
        self._mine: dict[str, float] = {}  # scenarios this process ran: seconds each
        self._folders: list[str] = []
        self._thread: threading.Thread | None = None

    def start(self, keys: list[str]) -> None:
        unknown = [k for k in keys if k not in _registered]
        if unknown:
            raise ValueError(f"no background scenario registered as {unknown}")
        self._keys = list(dict.fromkeys(keys))
        if self._keys:
            self._thread = threading.Thread(
                target=self._run, args=(self._keys,), name="rtnb-suite-background", daemon=True
            )
            self._thread.start()

    def result(self, key: str, timeout_s: float) -> Any:
        """What the scenario returned (its exception raised here, with its traceback
        in the message), waiting up to ``timeout_s`` for a lane to get to it."""
        if key not in self._keys:
            raise RuntimeError(
                f"background scenario {key!r} was not asked for: mark the test "
                f"pytest.mark.background({key!r})"
            )
        path = _result_path(key)
        # Another process's lane may be the one running it: its outcome is a file.
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"background scenario {key!r} did not end within {timeout_s} s")
            time.sleep(0.25)
        outcome: _Outcome = pickle.loads(path.read_bytes())
        if outcome.error is not None:
            raise RuntimeError(f"background scenario {key!r} failed:\n{outcome.error}")
        return outcome.value

    def took(self) -> dict[str, float]:
        """Seconds each scenario this process ran took, by key."""
        return dict(self._mine)

    def close(self, interrupted: bool) -> None:
        """At the run's end. A scenario still running waits to end (another test
        process may be waiting for it), unless the run was interrupted or stopped at
        a first failure: then its processes are killed: every descendant of this
        process at the lane's nice or above (Ray's workers add to it). The suite's
        own tests run at 0; what of theirs runs niced (Ray's agents and idle
        workers) belongs to Rays their fixtures have ended by now."""
        if self._thread is not None and self._thread.is_alive():
            if not interrupted:
                self._thread.join(timeout=_WAIT_AT_END_S)
            if self._thread.is_alive():
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
            if not _claim(key):
                continue  # another test process's lane runs it
            with _machine_lane():
                folder = tempfile.mkdtemp(prefix=f"rtnb-bg-{key}-")
                self._folders.append(folder)
                began = time.monotonic()
                _margins.begin_thread_test(f"background scenario {key}")
                outcome = _Outcome()
                try:
                    outcome.value = _registered[key](Path(folder))
                except BaseException:  # handed to the test that asks
                    outcome.error = traceback.format_exc()
                outcome.took_s = self._mine[key] = time.monotonic() - began
                _publish(key, outcome)


# How long a lane's last scenario may still run after its own process's tests ended.
_WAIT_AT_END_S = 900.0


def _result_path(key: str) -> Path:
    return shared_folder() / f"background-{key}.result"


def _claim(key: str) -> bool:
    """True for the one lane of the run that is first to ask for ``key``."""
    try:
        os.close(os.open(shared_folder() / f"background-{key}.claim", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


class _machine_lane:
    """One scenario at a time across the run's test processes (two at once made a
    Ray of one time out starting)."""

    def __enter__(self) -> None:
        self._file = open(shared_folder() / "background.lock", "w")
        fcntl.flock(self._file, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def _publish(key: str, outcome: _Outcome) -> None:
    try:
        data = pickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - a value that cannot cross: say so to its test
        data = pickle.dumps(
            _Outcome(error=f"its result could not be pickled:\n{traceback.format_exc()}")
        )
    path = _result_path(key)
    part = path.with_suffix(".part")
    part.write_bytes(data)
    part.rename(path)  # whole or not there for the reader
