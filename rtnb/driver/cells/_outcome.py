"""What a cell comes to: its value or one error, and its callers waiting for it.

The handle (``cells/_handle.py``) gathers each rank's last update; :func:`judge` words the
outcome — the value per rank, the first failure as a :class:`CellError` (with the
cell's own frames in local mode), an interrupt that every rank obeyed — and
:func:`storage_stopped` the error of a cell stopped because storage failed.
:class:`Completion` is the end as callers see it: ``wait``, done-callbacks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rtnb.core._messages import CellState, RankUpdate, StopPhase
from rtnb.core._values import PerRank, from_portable
from rtnb.driver.lifecycle import GroupState
from rtnb.driver.ranks import StopProtocol
from rtnb.errors import (
    CellError,
    CellInterrupted,
    ClusterError,
    RtnbError,
    SessionError,
    StorageError,
    WaitTimeout,
)

__all__ = [
    "Completion",
    "Outcome",
    "WatchedGroup",
    "failed_rank_first",
    "first_cause",
    "judge",
    "ray_lost_ending",
    "storage_stopped",
]

# What gloo and NCCL raise in a rank whose peer process went away.
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "NCCL communicator was aborted",
)

# How long wait() gives the cell's views to finish at its end (see Completion.wait).
_SETTLE_S = 30.0
# A group in these states is gone: a cell waited on there will not end by itself.
_GONE = (GroupState.STOPPED, GroupState.FAILED, GroupState.NEW)


class WatchedGroup(Protocol):
    """What a waiter reads of the group a cell runs on."""

    @property
    def state(self) -> GroupState: ...

    @property
    def stop_grace_s(self) -> float: ...

    @property
    def ray_lost(self) -> str | None: ...


def ray_lost_ending(name: str, lost: str) -> str:
    """How a cell whose Ray went away ends (``lost``: the session's line)."""
    return f"{name} ended: {lost}"


@dataclass(frozen=True)
class Outcome:
    value: PerRank | None = None
    error: BaseException | None = None
    note: str | None = None  # a line for the cell's viewers before it ends


def failed_rank_first(
    error: BaseException, finished: dict[int, RankUpdate], stopped_for_failure: bool
) -> BaseException:
    """The error of a cell stopped because a rank's code raised, whose other ranks
    had to be rebuilt (``error`` says so): the rank's own error, its traceback in
    the cell's code (in a saved batch notebook too), with ``error``'s line last."""
    failures = _failures(finished)
    if not (stopped_for_failure and failures and isinstance(error, RtnbError)):
        return error
    failed = CellError.from_failures(failures)
    failed.aftermath = f"[rtnb] {error.message}"
    return failed


def _failures(finished: dict[int, RankUpdate]) -> dict[int, Any]:
    """{rank: (summary, traceback)} of the ranks whose cell raised."""
    return {r: u.error for r, u in finished.items() if u.state is CellState.ERROR}


def first_cause(finished: dict[int, RankUpdate]) -> tuple[int, str] | None:
    """(rank, summary) of the first rank whose cell raised on its own, or None. A
    collective that lost its peer is the symptom of a rank that died: its death (a
    recovery) is what to wait for, not a stop."""
    for rank in sorted(finished):
        error = finished[rank].error
        summary = error[0] if error else ""
        if error is not None and not any(s in summary for s in _PEER_LOST):
            return rank, summary
    return None


def judge(
    name: str,
    finished: dict[int, RankUpdate],
    stopping: StopProtocol,
    stopped_for_failure: bool,
) -> Outcome:
    """The outcome of a cell ``name`` whose ranks all ended with ``finished``;
    ``stopped_for_failure``: the stop was asked because a rank's cell raised."""
    interrupted = [u for u in finished.values() if u.state is CellState.INTERRUPTED]
    failures = _failures(finished)
    if stopping.requested and interrupted and not (failures and stopped_for_failure):
        steps = {u.step for u in interrupted}
        at = f" at step {steps.pop()}" if len(steps) == 1 and stopping.target is not None else ""
        how = (
            "at a report() boundary"
            if stopping.phase is StopPhase.COOPERATIVE
            else "inside the cell code"
        )
        return Outcome(
            error=CellInterrupted(
                f"{name} {stopping.reason}: every rank stopped{at} ({how}); "
                "the worker group and its variables are intact",
                kept=True,
                step=max(u.step for u in finished.values()),
            )
        )
    if failures:
        note = None
        if interrupted:
            stopped = ", ".join(
                str(r) for r in sorted(r for r, u in finished.items() if u in interrupted)
            )
            note = f"[rtnb] {name}: rank(s) {stopped} stopped after the failure below\n"
        error = CellError.from_failures(failures)
        here = next((u.exception for u in finished.values() if u.exception is not None), None)
        if here is not None:
            # A rank in this process (local mode): the error carries the cell's own
            # frames, so %debug opens where the cell raised.
            error = error.with_traceback(here.__traceback__)
        return Outcome(error=error, note=note)
    return Outcome(PerRank({r: from_portable(finished[r].value) for r in sorted(finished)}))


def storage_stopped(
    name: str,
    what: str,
    finished: dict[int, RankUpdate],
    latest: str | None,
    run_name: str,
    stopped_at: int | None = None,
) -> StorageError:
    """The error of a cell stopped at one step because a write to storage failed
    (``what``); ``latest``: the run's last committed checkpoint; ``stopped_at``: the
    stop's common step. (The ranks' published steps stay below files still uploading
    or never written, so they do not say where the ranks stopped.)"""
    steps = {stopped_at} if stopped_at is not None else {u.step for u in finished.values()}
    stopped = (
        f"every rank stopped at step {steps.pop()}" if len(steps) == 1 else "every rank stopped"
    )
    kept = (
        f"the last committed checkpoint is {latest}"
        if latest
        else "no checkpoint of this run was committed"
    )
    return StorageError(
        f"{name} stopped: {what}; {stopped}, the worker group and its variables are intact "
        f"and {kept}. Free space there (or fix its permissions) and run the next cell, or "
        f"`%rtnb start --storage ELSEWHERE --name {run_name} --replay`",
        kept=True,
        step=stopped_at
        if stopped_at is not None
        else max((u.step for u in finished.values()), default=None),
    )


class Completion:
    """A cell's end as its callers see it: the value or the error, the callbacks its
    views added (run once, in the ending thread), and waiting for both."""

    def __init__(self) -> None:
        self.value: PerRank | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._settled = threading.Event()  # the done-callbacks have run
        self._callbacks: list[Callable[[Any], None]] = []
        self._lock = threading.Lock()
        self._ending_thread: threading.Thread | None = None
        self._last_words: list[Callable[[], None]] = []

    def before_end(self, last_words: Callable[[], None]) -> None:
        self._last_words.append(last_words)

    def last_words(self) -> None:
        """What was to be said as the cell ends (a pipeline's summary)."""
        for said in self._last_words:
            try:
                said()
            except Exception:  # noqa: BLE001 - a summary must never change the outcome
                pass

    def done(self) -> bool:
        return self._done.is_set()

    def wait_done(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def add_callback(self, callback: Callable[[Any], None], handle: Any) -> None:
        # Checked and kept under the lock the end takes its list with: a cell ending
        # between the two would otherwise never call it back.
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(handle)

    def begin(self) -> None:
        """The cell starts ending in this thread (a wait there does not wait for
        the callbacks it is about to run)."""
        self._ending_thread = threading.current_thread()

    def ending(self, value: PerRank | None, error: BaseException | None) -> None:
        """The outcome, before the views hear of it."""
        self.value, self.error = value, error

    def ended(self, handle: Any) -> None:
        with self._lock:
            self._done.set()
            callbacks = list(self._callbacks)
        try:
            for callback in callbacks:
                try:
                    callback(handle)
                except Exception:  # noqa: BLE001 - a broken view must not break the end
                    pass
        finally:
            self._settled.set()

    def wait(
        self,
        timeout: float | None,
        name: str,
        group: WatchedGroup,
    ) -> PerRank:
        """Block until the cell ends; its value, or its error raised. Never hangs on
        a group that is gone: one that has not ended the stop grace + 1 s after its
        group went away raises one SessionError line; when the Ray under it went,
        after 1 s the ClusterError the cell itself ends with (a cell thread held in
        a call to the dying Ray must not decide what the user is told, nor when)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        gone_since: float | None = None
        while not self._done.wait(0.2):
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise WaitTimeout(
                    f"{name} is still running after {timeout:g} s; wait again, "
                    "or stop it (`handle.stop()`, or interrupt the kernel)"
                )
            state = group.state
            if state in _GONE:
                gone_since = gone_since or now
                lost = group.ray_lost
                if lost is not None and now - gone_since > 1.0:
                    raise ClusterError(ray_lost_ending(name, lost))
                if now - gone_since > group.stop_grace_s + 1.0:
                    raise SessionError(
                        f"{name} lost its worker group (the group is {state}); nothing is "
                        "left to wait for"
                    )
        if threading.current_thread() is not self._ending_thread:
            # What the cell's views do at its end (a live view leaves its lasting
            # figure) is done when wait returns: once `%rtnb wait` returned, a frontend
            # such as nbclient no longer takes output meant for the waiting cell, and
            # the widget would stay in the saved notebook. Under load that figure took
            # over 5 s (CI); bounded all the same, so a broken view cannot hang it.
            self._settled.wait(_SETTLE_S)
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value
