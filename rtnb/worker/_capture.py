"""Output capture on a rank: sys.stdout/sys.stderr feed the rank's buffer."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["CaptureStream", "flush_std", "install_capture"]


class CaptureStream:
    """Replaces sys.stdout/sys.stderr in a rank process; every write goes to ``sink``."""

    def __init__(self, sink: Callable[[str, str], None], name: str, original) -> None:
        self._sink = sink
        self.name = name
        self._original = original
        self.encoding = getattr(original, "encoding", "utf-8")

    def write(self, text: str) -> int:
        if text:
            self._sink(self.name, text)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._original.fileno()


def install_capture(sink: Callable[[str, str], None]) -> None:
    # Done per cell, not once: a test harness or the user's code may have swapped
    # sys.stdout since.
    if not isinstance(sys.stdout, CaptureStream):
        sys.stdout = CaptureStream(sink, "stdout", sys.__stdout__)
    if not isinstance(sys.stderr, CaptureStream):
        sys.stderr = CaptureStream(sink, "stderr", sys.__stderr__)


def flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
