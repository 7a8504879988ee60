"""Per-rank append-only files in the run directory, for any storage.

A local path appends to ``{folder}/rank-N{suffix}``; object stores cannot
append, so each flush writes the next numbered chunk under ``{folder}/rank-N/``.
Writes are buffered and flushed at most once a second (or when the buffer is big).
"""

from __future__ import annotations

import posixpath
import time

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
        run_dir.fs.create_dir(self.dir, recursive=True)

    def where(self, rank: int) -> str:
        folder = posixpath.basename(self.dir)
        name = f"rank-{rank}{self.suffix}" if self._local else f"rank-{rank}/"
        return self.run_dir.shown(f"{folder}/{name}")

    def add(self, rank: int, data: bytes) -> None:
        self._buffers.setdefault(rank, []).append(data)
        self._buffered += len(data)
        if (
            self._buffered >= _FLUSH_EVERY_BYTES
            or time.monotonic() - self._last_flush >= _FLUSH_EVERY_S
        ):
            self.flush()

    def flush(self) -> None:
        for rank, parts in self._buffers.items():
            if not parts:
                continue
            data = b"".join(parts)
            if self._local:
                with open(posixpath.join(self.dir, f"rank-{rank}{self.suffix}"), "ab") as out:
                    out.write(data)
            else:
                seq = self._chunks.get(rank, 0)
                self._chunks[rank] = seq + 1
                folder = posixpath.join(self.dir, f"rank-{rank}")
                self.run_dir.fs.create_dir(folder, recursive=True)
                with self.run_dir.fs.open_output_stream(
                    posixpath.join(folder, f"{self._epoch}-{seq:08d}{self.suffix}")
                ) as out:
                    out.write(data)
            parts.clear()
        self._buffered = 0
        self._last_flush = time.monotonic()
