"""A rank's side of ``%rtnb profile``: torch.profiler over N steps of the cell.

Started and stopped by internal triggers in the report of a step (so every rank
profiles the same steps), it writes the rank's Chrome trace to the run directory
(``profiles/{id}/rank-N.json``, its timestamps in microseconds since the epoch, so
the driver can lay the ranks side by side) and returns the rank's breakdown
(:func:`rtnb.core._profile.breakdown`). Nothing of this runs unless armed.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from rtnb.core._profile import PROFILE_START, PROFILE_STOP, RankProfile, breakdown

__all__ = ["RankProfiling", "StepProfiler"]


class StepProfiler:
    def __init__(self, rank: int, first_step: int, steps: int, cell_thread: int | None) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.rank = rank
        self.first_step = first_step
        self.steps = steps
        self._cell_thread = cell_thread
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities)
        self._record_function = torch.profiler.record_function
        self._started = 0.0
        self._wall_s = 0.0

    def start(self) -> None:
        self._profile.__enter__()
        self._started = time.perf_counter()

    def record(self, name: str):
        return self._record_function(name)

    def end(self) -> None:
        """The window ends here (in the cell thread, at a step's report)."""
        self._wall_s = time.perf_counter() - self._started
        self._profile.__exit__(None, None, None)

    def write(self, run_dir: Any, profile_id: str) -> RankProfile:
        """The trace into the run directory and the window's parts (any thread)."""
        from rtnb.storage._layout import profile_rank_trace

        wall_s = self._wall_s
        events = self._profile.events()
        # The cell thread as the profiler numbers it: where rtnb.report ran, else
        # the thread with the most top-level time.
        cell = next((e.thread for e in events if e.name == "rtnb.report"), None)
        if cell is None:
            spent: dict[int, float] = {}
            for e in events:
                if e.cpu_parent is None:
                    spent[e.thread] = spent.get(e.thread, 0.0) + e.time_range.elapsed_us()
            cell = max(spent, key=spent.get) if spent else None
        top = [
            (e.name, e.time_range.start, e.time_range.end, e.thread == cell)
            for e in events
            if e.cpu_parent is None
        ]
        parts = breakdown(top, wall_s * 1e6)
        name = profile_rank_trace(profile_id, self.rank)
        fd, local = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            self._profile.export_chrome_trace(local)
            with open(local, encoding="utf-8") as src:
                trace = json.load(src)
            trace["rtnbRank"] = self.rank
            run_dir.write_bytes(name, json.dumps(trace).encode())
        finally:
            with contextlib.suppress(OSError):
                os.unlink(local)
        return RankProfile(self.rank, self.first_step, self.steps, wall_s, parts, name)


# How long a cell's end waits for its profile's trace to be written, so the cell's
# last update carries it.
_WRITE_WAIT_S = 10.0


class RankProfiling:
    """A rank's ``%rtnb profile``, a part of its runtime: the window the triggers open
    and close, its trace written in a thread (training goes on at once), and the
    result the next poll carries. Handed the runtime's condition and what it needs
    to ask: the cell thread, the run directory, and a stop trigger scheduled at a
    step (the runtime's triggers)."""

    def __init__(
        self,
        rank: int,
        cond: Any,
        cell_thread: Callable[[], int | None],
        run_directory: Callable[[], Any],
        stop_at: Callable[[int], None],
    ) -> None:
        self._rank = rank
        self._cond = cond
        self._cell_thread = cell_thread
        self._run_directory = run_directory
        self._stop_at = stop_at
        self.recording: StepProfiler | None = None
        self._result: RankProfile | None = None
        self._pending: Any = None

    @property
    def has_result(self) -> bool:
        return self._result is not None

    def take_result_locked(self) -> RankProfile | None:
        result, self._result = self._result, None
        return result

    def trigger(self, name: str, step: int) -> None:
        """The profile trigger due in the report of ``step``: start N steps, or stop."""
        if name == PROFILE_STOP:
            self.stop()
            return
        if self.recording is not None:
            return  # one profile at a time
        steps = int(name[len(PROFILE_START) :])
        try:
            profiler = StepProfiler(self._rank, step + 1, steps, self._cell_thread())
            profiler.start()
        except Exception as exc:  # noqa: BLE001 - a profile that cannot start is said, not raised
            self._publish(RankProfile(self._rank, step + 1, steps, 0.0, {}, error=str(exc)))
            return
        self.recording = profiler
        self._stop_at(step + steps)

    def stop(self, cut_at: int | None = None) -> None:
        """End the profiled window here; the trace is written and the window sorted
        into its parts in a thread, so training goes on at once."""
        profiler, self.recording = self.recording, None
        if profiler is None:
            return
        if cut_at is not None:  # the cell ended first: the steps it ran
            profiler.steps = max(1, cut_at - profiler.first_step + 1)
        try:
            profiler.end()
        except Exception as exc:  # noqa: BLE001
            self._publish(self._failed(profiler, exc))
            return

        def finish() -> None:
            try:
                result = profiler.write(self._run_directory(), f"step-{profiler.first_step:09d}")
            except Exception as exc:  # noqa: BLE001
                result = self._failed(profiler, exc)
            self._publish(result)

        with self._cond:
            self._pending = threading.Thread(target=finish, name="rtnb-profile", daemon=True)
            self._pending.start()

    def cell_ends(self, step: int, stopping: bool) -> None:
        """A profile still recording ends with the cell; its trace is awaited briefly
        so the cell's last update carries it, unless a stop is under way (the stop's
        grace is for the ranks to leave)."""
        if self.recording is not None:
            self.stop(cut_at=step)
        pending = self._pending
        if pending is not None and not stopping:
            pending.join(_WRITE_WAIT_S)

    def _failed(self, profiler: StepProfiler, exc: BaseException) -> RankProfile:
        return RankProfile(self._rank, profiler.first_step, profiler.steps, 0.0, {}, error=str(exc))

    def _publish(self, result: RankProfile) -> None:
        with self._cond:
            self._result = result
            self._pending = None
            self._cond.notify_all()
