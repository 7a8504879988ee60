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
import time
from typing import Any

from rtnb.core._profile import RankProfile, breakdown

__all__ = ["StepProfiler"]


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
