"""How close the suite's waits come to their bounds, so a bound that a slow day will
cross is seen on a normal day: every wait helper of the tests (a kernel's cell, a
condition polled until a deadline, the free CPUs) reports what it took against what it
allowed, and the run ends with each one that used more than half of its bound, and each
test that took more than half of its pytest timeout.

A test's own waits report through ``waited``; ``until`` is the polling loop for a
condition, with the report built in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# More than this share of a bound used is reported: a machine half as fast fails it.
CLOSE = 0.5


@dataclass(frozen=True)
class Wait:
    test: str
    what: str
    took_s: float
    bound_s: float

    @property
    def used(self) -> float:
        return self.took_s / self.bound_s if self.bound_s else 0.0


_current_test = ""
_close: list[Wait] = []
# A thread that runs beside the tests (tests/_background.py) names its own waits.
_thread_test = threading.local()


def begin_test(nodeid: str) -> None:
    global _current_test
    _current_test = nodeid


def begin_thread_test(name: str) -> None:
    """The waits of this thread belong to ``name``, whatever test runs meanwhile."""
    _thread_test.name = name


def waited(what: str, took_s: float, bound_s: float) -> None:
    """A wait of the running test ended after ``took_s`` of the ``bound_s`` it allowed
    (one that timed out reports its whole bound)."""
    if bound_s > 0 and took_s > CLOSE * bound_s:
        test = getattr(_thread_test, "name", None) or _current_test
        _close.append(Wait(test, what, took_s, bound_s))


def close_waits() -> list[Wait]:
    return list(_close)


def until(what: str, check: Callable[[], T], timeout_s: float, poll_s: float = 0.2) -> T:
    """``check()``'s first truthy value, polled every ``poll_s``; AssertionError naming
    ``what`` after ``timeout_s``."""
    began = time.monotonic()
    deadline = began + timeout_s
    while True:
        value = check()
        if value:
            waited(what, time.monotonic() - began, timeout_s)
            return value
        if time.monotonic() > deadline:
            waited(what, timeout_s, timeout_s)
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(poll_s)
