"""Where a cell's output goes: sinks, and the ``[rank N]`` printer (the driver's
and the notebook front end's: plain Python, no Ray)."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["OutputSink", "print_sink"]

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
