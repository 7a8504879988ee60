"""Per-rank append-only files in the run directory, for any storage.

A local path appends to ``{folder}/rank-N{suffix}``; object stores cannot
append, so each flush writes the next numbered chunk under ``{folder}/rank-N/``.
Writes are buffered and flushed at most once a second (or when the buffer is big).

A flush that fails (a full disk, a read-only folder, an object-store error) raises
nothing: what it could not write stays buffered for the next flush, a local file
is cut back to its last whole line, and :attr:`RankAppendLog.failure` says what
failed until a flush succeeds again; the owner decides what to stop.
"""

from __future__ import annotations

import posixpath
import threading
import time

from rtnb.errors import one_line
from rtnb.storage._layout import rank_file, rank_folder
from rtnb.storage._rundir import RunDirectory

__all__ = ["RankAppendLog"]

_FLUSH_EVERY_S = 1.0
_FLUSH_EVERY_BYTES = 4 * 1024 * 1024


class RankAppendLog:
    def __init__(self, run_dir: RunDirectory, folder: str, suffix: str) -> None:
        self.run_dir = run_dir
        self.dir = posixpath.join(run_dir.path, folder)
        self.suffix = suffix
        self._local = run_dir.is_local
        self._buffers: dict[int, list[bytes]] = {}
        self._chunks: dict[int, int] = {}
        # Chunk names start with this session's start time, so a run carried on by
        # a later session (a new kernel, --replay) adds chunks after the old ones
        # instead of overwriting them.
        self._epoch = f"{time.time_ns() // 1_000_000:013d}"
        self._buffered = 0
        self._last_flush = time.monotonic()
        # What the last flush could not write, and where; None once one succeeds.
        self.failure: str | None = None
        # The driver's loop adds the ranks' output; the hang doctor's thread adds
        # their stacks: one flush at a time, so no part is written twice or lost.
        self._lock = threading.RLock()
        run_dir.fs.create_dir(self.dir, recursive=True)

    def where(self, rank: int) -> str:
        folder = posixpath.basename(self.dir)
        name = rank_file(rank, self.suffix) if self._local else rank_folder(rank) + "/"
        return self.run_dir.shown(f"{folder}/{name}")

    def add(self, rank: int, data: bytes) -> None:
        with self._lock:
            self._buffers.setdefault(rank, []).append(data)
            self._buffered += len(data)
            if (
                self._buffered >= _FLUSH_EVERY_BYTES
                or time.monotonic() - self._last_flush >= _FLUSH_EVERY_S
            ):
                self.flush()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        try:
            for rank, parts in self._buffers.items():
                if parts:
                    self._write(rank, b"".join(parts))
                    parts.clear()
        except Exception as exc:  # noqa: BLE001 - any storage error; kept for the retry
            self.failure = f"writing {self.where(rank)} failed: {one_line(exc)}"
            return
        self.failure = None
        self._buffered = 0
        self._last_flush = time.monotonic()

    def _write(self, rank: int, data: bytes) -> None:
        if self._local:
            path = posixpath.join(self.dir, rank_file(rank, self.suffix))
            with open(path, "ab") as out:
                start = out.tell()
                try:
                    out.write(data)
                    out.flush()
                except OSError:
                    # No half line is left for a reader to trip on: the retry writes it all.
                    out.truncate(start)
                    raise
            return
        seq = self._chunks.get(rank, 0)
        folder = posixpath.join(self.dir, rank_folder(rank))
        self.run_dir.fs.create_dir(folder, recursive=True)
        with self.run_dir.fs.open_output_stream(
            posixpath.join(folder, f"{self._epoch}-{seq:08d}{self.suffix}")
        ) as out:
            out.write(data)
        self._chunks[rank] = seq + 1
