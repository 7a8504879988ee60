"""The full-resolution record of every report, in ``{run}/metrics/``.

One JSON object per report and line (``rank``, ``step``, ``timestamp`` and the
metrics). On a local path each rank appends to ``rank-N.jsonl``; on object stores,
which cannot append, each flush writes a new numbered chunk under ``rank-N/``.
Readers take both.
"""

from __future__ import annotations

import json
import math
import posixpath
from typing import Any

from rtnb.core._text import to_number
from rtnb.storage._appendlog import RankAppendLog
from rtnb.storage._rundir import RunDirectory

__all__ = ["MetricsLog", "read_metrics"]





def _jsonable(value: Any) -> Any:
    number = to_number(value)
    if number is not None:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return number if math.isfinite(number) else str(number)
    if isinstance(value, (str, type(None))):
        return value
    return repr(value)


class MetricsLog:
    def __init__(self, run_dir: RunDirectory) -> None:
        self._log = RankAppendLog(run_dir, "metrics", ".jsonl")
        self.dir = self._log.dir

    def add(self, rank: int, records: list[tuple[int, float, dict]]) -> None:
        lines = []
        for step, timestamp, metrics in records:
            row = {k: _jsonable(v) for k, v in metrics.items()}
            row.update(rank=rank, step=step, timestamp=timestamp)
            lines.append(json.dumps(row))
        self._log.add(rank, ("\n".join(lines) + "\n").encode())

    def flush(self) -> None:
        self._log.flush()


def read_metrics(run_dir: RunDirectory) -> list[dict]:
    """Every report in the run directory, rank by rank, in the order reported."""
    from pyarrow import fs as pafs

    base = posixpath.join(run_dir.path, "metrics")
    infos = run_dir.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    files = sorted(
        i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".jsonl")
    )

    def order(path: str) -> tuple[int, str]:
        rel = posixpath.relpath(path, base)
        rank = int(rel.split("/")[0].split(".")[0].split("-")[1])
        return rank, rel

    rows: list[dict] = []
    for path in sorted(files, key=order):
        with run_dir.fs.open_input_stream(path) as src:
            text = src.read().decode()
        rows.extend(json.loads(line) for line in text.splitlines() if line.strip())
    return rows
