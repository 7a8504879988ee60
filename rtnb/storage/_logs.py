"""Every rank's output, at full resolution, in ``{run}/logs/``.

The driver keeps only a bounded tail of a cell's output (and the widgets less);
the whole of it goes here, as metrics go to ``metrics/``: ``rank-N.log`` appended
on a local path, numbered chunks under ``rank-N/`` on object storage.
"""

from __future__ import annotations

from rtnb.storage._appendlog import RankAppendLog
from rtnb.storage._layout import LOGS
from rtnb.storage._rundir import RunDirectory

__all__ = ["RankLogs"]


class RankLogs:
    def __init__(self, run_dir: RunDirectory) -> None:
        self._log = RankAppendLog(run_dir, LOGS, ".log")

    def where(self, rank: int) -> str:
        """Where rank ``rank``'s output is kept (for "the rest is in ..." notes)."""
        return self._log.where(rank)

    def add(self, rank: int, text: str) -> None:
        self._log.add(rank, text.encode("utf-8", "replace"))

    def flush(self) -> None:
        self._log.flush()

    @property
    def failure(self) -> str | None:
        """What the last write could not do (kept for the next flush), if anything."""
        return self._log.failure
