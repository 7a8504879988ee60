"""Output that reads well in a saved notebook: a few progress lines, then a static figure.

Used when no live frontend renders widgets (papermill, nbclient, scripts). The
figure is plain ``application/vnd.plotly.v1+json``: no widget state, no plotly.js
bundle, and at most ``max_points`` points per trace however long the run.
"""

from __future__ import annotations

import json
import sys
import time

from rtnb.widgets._live import format_header
from rtnb.widgets._plot import build_figure, trace_keys

__all__ = ["ProgressLines", "static_figure_bundle"]

_MAX_LINES = 10


class ProgressLines:
    """Prints at most ~10 progress lines per cell: at each tenth of ``total_steps``
    when known, else at growing intervals."""

    def __init__(self, store, handle, out=None) -> None:
        self.store = store
        self.handle = handle
        self.out = out or sys.stdout
        self.lines = 0
        self._next_step = None
        self._next_time = time.monotonic() + 5.0
        self._interval = 5.0
        self._unsubscribe = store.subscribe(self._on_reports)

    def _on_reports(self, _rank, _batch) -> None:
        if self.lines >= _MAX_LINES:
            return
        progress = self.store.progress()
        total = progress.total_steps
        if total:
            self._next_step = self._next_step or max(1, total // 10)
            if progress.step < self._next_step:
                return
            self._next_step = (progress.step // max(1, total // 10) + 1) * max(1, total // 10)
        else:
            if time.monotonic() < self._next_time:
                return
            self._interval *= 2
            self._next_time = time.monotonic() + self._interval
        self._print(progress)

    def _print(self, progress) -> None:
        import re

        handle = self.handle
        header = re.sub(
            r"<[^>]+>",
            "",
            format_header(
                progress, "running", handle.cell_id, handle.recoveries, handle.restarted_from
            ),
        )
        last = self.store.last
        metrics = ""
        if last:
            names = self.store.metric_names()[:4]
            vals = []
            for name in names:
                nums = [
                    rep.metrics[name]
                    for rep in last.values()
                    if isinstance(rep.metrics.get(name), (int, float))
                ]
                if nums:
                    vals.append(f"{name}={sum(nums) / len(nums):.4g}")
            metrics = " | " + " ".join(vals) if vals else ""
        self.out.write(f"rtnb: {header}{metrics}\n")
        self.out.flush()
        self.lines += 1

    def close(self) -> None:
        self._unsubscribe()


def static_figure_bundle(store, title: str = "", max_points: int = 500) -> dict | None:
    """A display bundle with the final figure as plotly JSON, or None if nothing was reported."""
    keys = trace_keys(store)
    if not keys:
        return None
    fig = build_figure(store, keys, widget=False, max_points=max_points)
    if title:
        fig.update_layout(title={"text": title, "x": 0.01, "font": {"size": 13}}, margin={"t": 50})
    progress = store.progress()
    summary = f"rtnb metrics: {', '.join(store.metric_names())} for ranks {store.ranks()} up to step {max(progress.steps.values(), default=0)}"
    return {"application/vnd.plotly.v1+json": json.loads(fig.to_json()), "text/plain": summary}
