"""Where a cell's output goes: sinks, and the ``[rank N]`` printer (the driver's
and the notebook front end's: plain Python, no Ray)."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["CellOutput", "OutputSink", "print_sink"]

# sink(rank, stream, text); rank -1 is a note from rtnb itself.
OutputSink = Callable[[int, str, str], None]


class _LinePrefixer:
    """Writes rank output line by line with a ``[rank N]`` tag."""

    def __init__(self) -> None:
        self._partial: dict[tuple[int, str], str] = {}

    def __call__(self, rank: int, stream: str, text: str) -> None:
        if rank < 0:  # a note from rtnb itself, not a rank
            (sys.stderr if stream == "stderr" else sys.stdout).write(text)
            return
        key = (rank, stream)
        text = self._partial.pop(key, "") + text
        lines = text.split("\n")
        self._partial[key] = lines.pop()
        if lines:
            out = sys.stderr if stream == "stderr" else sys.stdout
            out.write("".join(f"[rank {rank}] {line}\n" for line in lines))
            out.flush()

    def flush(self) -> None:
        for (rank, stream), rest in list(self._partial.items()):
            if rest:
                out = sys.stderr if stream == "stderr" else sys.stdout
                out.write(f"[rank {rank}] {rest}\n")
                out.flush()
        self._partial.clear()


def print_sink() -> _LinePrefixer:
    return _LinePrefixer()


class CellOutput:
    """A cell's output on its way to its viewers: each line goes to every sink, and
    the recent output (up to ``limit`` characters) is kept for views opened late;
    ``where(rank)`` says where the rest of a rank's output is kept."""

    def __init__(self, where: Callable[[int], str], limit: int = 2_000_000) -> None:
        self.log: list[tuple[int, str, str]] = []
        self._where = where
        self._limit = limit
        self._kept = 0
        self._sinks: list[OutputSink] = []
        self._said: set[str] = set()

    def add_sink(self, sink: OutputSink, replay: bool = True) -> None:
        """Send the output to ``sink(rank, stream, text)`` (past output first)."""
        if replay:
            for entry in list(self.log):
                sink(*entry)
        self._sinks.append(sink)

    def write(self, rank: int, stream: str, text: str) -> None:
        self._keep(rank, stream, text)
        self.send(rank, stream, text)

    def note(self, text: str) -> None:
        """A line from rtnb itself (rank -1 for the sinks); not kept."""
        self.send(-1, "stderr", text)

    def note_once(self, topic: str, text: str) -> None:
        """A note said once per cell on ``topic`` however often its cause recurs."""
        if topic not in self._said:
            self._said.add(topic)
            self.note(text)

    def flush(self) -> None:
        for sink in self._sinks:
            flush = getattr(sink, "flush", None)
            if flush is not None:
                flush()

    def send(self, rank: int, stream: str, text: str) -> None:
        """To every sink, not kept (a debugger's prompt)."""
        for sink in list(self._sinks):
            try:
                sink(rank, stream, text)
            except Exception:  # noqa: BLE001 - a broken view must not stop the cell
                pass

    def _keep(self, rank: int, stream: str, text: str) -> None:
        if self._kept > self._limit:
            return
        self._kept += len(text)
        self.log.append((rank, stream, text))
        if self._kept > self._limit:
            shown = f"[rtnb: output beyond {self._limit // 1_000_000} MB is kept in "
            self.log.append((-1, "stderr", f"{shown}{self._where(rank)}]\n"))
