"""The full-resolution record of every report, in ``{run}/metrics/``.

One JSON line per batch a rank sent (a poll's worth of reports, as columns):
``{"rank": 0, "step": C, "timestamp": C, "metrics": {"loss": C, ...}}`` where a
column ``C`` is either ``{"float64"|"int64": base64 of little-endian values}`` (every
report had a finite number) or a plain list (``null`` where a report lacked the
metric, non-finite numbers as "nan"/"inf", other values as text).
Lines with one report as an object (``rank``, ``step``, ``timestamp`` and the
metrics), as rtnb wrote before, are read too. On a local path each rank appends
to ``rank-N.jsonl``; on object stores, which cannot append, each flush writes a
new numbered chunk under ``rank-N/``. :func:`read_metrics` gives one row per report.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from rtnb.core._reports import ReportBatch, unpack_column
from rtnb.storage._appendlog import RankAppendLog
from rtnb.storage._layout import METRICS, SYSTEM_METRICS
from rtnb.storage._rundir import RunDirectory

__all__ = ["MetricsLog", "read_metrics"]


class MetricsLog:
    def __init__(self, run_dir: RunDirectory, folder: str = METRICS) -> None:
        """``folder``: ``SYSTEM_METRICS`` for the ranks' resource samples."""
        self._log = RankAppendLog(run_dir, folder, ".jsonl")
        self.dir = self._log.dir

    def add(self, rank: int, batch: ReportBatch) -> None:
        self._log.add(rank, batch.json_line(rank))

    def flush(self) -> None:
        self._log.flush()

    @property
    def failure(self) -> str | None:
        """What the last write could not do (kept for the next flush), if anything."""
        return self._log.failure


def _rows(line: dict[str, Any]) -> list[dict[str, Any]]:
    if "metrics" not in line:
        return [line]  # one report per line
    rank = line["rank"]
    steps, times = unpack_column(line["step"]), unpack_column(line["timestamp"])
    metrics = {name: unpack_column(column) for name, column in line["metrics"].items()}
    rows = []
    for i, (step, when) in enumerate(zip(steps, times)):
        row = {name: column[i] for name, column in metrics.items() if column[i] is not None}
        row.update(rank=rank, step=step, timestamp=when)
        rows.append(row)
    return rows


def read_metrics(run_dir: RunDirectory, system: bool = False) -> list[dict]:
    """Every report in the run directory, rank by rank, in the order reported;
    ``system``: the ranks' resource samples instead (``sys/cpu``, ``sys/rss_mb``, ...)."""
    from pyarrow import fs as pafs

    base = posixpath.join(run_dir.path, SYSTEM_METRICS if system else METRICS)
    infos = run_dir.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    inner = posixpath.relpath(SYSTEM_METRICS, METRICS) + "/"
    files = sorted(
        i.path
        for i in infos
        if i.type == pafs.FileType.File
        and i.path.endswith(".jsonl")
        and (system or not posixpath.relpath(i.path, base).startswith(inner))
    )

    def order(path: str) -> tuple[int, str]:
        rel = posixpath.relpath(path, base)
        rank = int(rel.split("/")[0].split(".")[0].split("-")[1])
        return rank, rel

    rows: list[dict] = []
    for path in sorted(files, key=order):
        with run_dir.fs.open_input_stream(path) as src:
            text = src.read().decode()
        for line in text.splitlines():
            if line.strip():
                rows.extend(_rows(json.loads(line)))
    return rows
