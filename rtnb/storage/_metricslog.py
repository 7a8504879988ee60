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
import time
from typing import Any

from rtnb.core._text import to_number
from rtnb.storage._rundir import RunDirectory

__all__ = ["MetricsLog", "read_metrics"]

_FLUSH_EVERY_S = 1.0
_FLUSH_EVERY_RECORDS = 20_000




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
        self.run_dir = run_dir
        self._local = run_dir.is_local
        self._buffers: dict[int, list[str]] = {}
        self._chunks: dict[int, int] = {}
        self._buffered = 0
        self._last_flush = time.monotonic()
        self.dir = posixpath.join(run_dir.path, "metrics")
        run_dir.fs.create_dir(self.dir, recursive=True)

    def add(self, rank: int, records: list[tuple[int, float, dict]]) -> None:
        lines = self._buffers.setdefault(rank, [])
        for step, timestamp, metrics in records:
            row = {k: _jsonable(v) for k, v in metrics.items()}
            row.update(rank=rank, step=step, timestamp=timestamp)
            lines.append(json.dumps(row))
        self._buffered += len(records)
        if (
            self._buffered >= _FLUSH_EVERY_RECORDS
            or time.monotonic() - self._last_flush >= _FLUSH_EVERY_S
        ):
            self.flush()

    def flush(self) -> None:
        for rank, lines in self._buffers.items():
            if not lines:
                continue
            data = ("\n".join(lines) + "\n").encode()
            if self._local:
                with open(posixpath.join(self.dir, f"rank-{rank}.jsonl"), "ab") as out:
                    out.write(data)
            else:
                seq = self._chunks.get(rank, 0)
                self._chunks[rank] = seq + 1
                folder = posixpath.join(self.dir, f"rank-{rank}")
                self.run_dir.fs.create_dir(folder, recursive=True)
                with self.run_dir.fs.open_output_stream(
                    posixpath.join(folder, f"{seq:08d}.jsonl")
                ) as out:
                    out.write(data)
            lines.clear()
        self._buffered = 0
        self._last_flush = time.monotonic()


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
