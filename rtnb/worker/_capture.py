"""Output capture on a rank: sys.stdout/sys.stderr feed the rank's buffer."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Collection

__all__ = ["CaptureStream", "flush_std", "install_capture", "install_thread_capture"]


# Ray's distributed tqdm (Ray Data's progress bars in a worker process) prints each
# bar's state as one JSON line carrying this token, for the driver's log monitor to
# draw. A rank's output comes to the notebook through rtnb instead, where such a line
# is noise: the cell's data watch says how each pipeline goes.
_RAY_TQDM_TOKEN = "__ray_tqdm_magic_token__"


class CaptureStream:
    """Replaces sys.stdout/sys.stderr in a rank process; every write goes to ``sink``.

    With ``threads`` (a rank inside the kernel's own process: local mode) only what
    those threads write goes to ``sink``; the kernel's own writes go on to
    ``original``, the stream it replaced."""

    def __init__(
        self,
        sink: Callable[[str, str], None],
        name: str,
        original,
        threads: Collection[int] | None = None,
    ) -> None:
        self._sink = sink
        self.name = name
        self._original = original
        self._threads = threads
        self.encoding = getattr(original, "encoding", "utf-8")

    def write(self, text: str) -> int:
        if self._threads is not None and threading.get_ident() not in self._threads:
            return self._original.write(text)
        if text and _RAY_TQDM_TOKEN not in text:
            self._sink(self.name, text)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        # In the kernel (``threads``) its own stream is flushed for any thread: a
        # cell's input() flushes before it asks, and what the kernel printed for the
        # rank must be shown above the prompt.
        if self._threads is not None:
            self._original.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._original.fileno()

    def __getattr__(self, name: str):
        # Whatever else the kernel's own stream offers (ipykernel's OutStream).
        if name == "_original":
            raise AttributeError(name)
        return getattr(self._original, name)


def install_capture(sink: Callable[[str, str], None]) -> None:
    # Done per cell, not once: a test harness or the user's code may have swapped
    # sys.stdout since.
    if not isinstance(sys.stdout, CaptureStream):
        sys.stdout = CaptureStream(sink, "stdout", sys.__stdout__)
    if not isinstance(sys.stderr, CaptureStream):
        sys.stderr = CaptureStream(sink, "stderr", sys.__stderr__)


def release_capture() -> None:
    """Give the process its own streams back (a rank that becomes another run's:
    the next cell captures into the new runtime)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, CaptureStream):
            stream.flush()
            setattr(sys, name, stream._original)


def install_thread_capture(
    sink: Callable[[str, str], None], threads: Collection[int]
) -> Callable[[], None]:
    """Capture what ``threads`` write, in a process whose other threads keep their
    streams (the kernel's); returns the function that puts the streams back."""
    before = sys.stdout, sys.stderr
    out = CaptureStream(sink, "stdout", before[0], threads)
    err = CaptureStream(sink, "stderr", before[1], threads)
    sys.stdout, sys.stderr = out, err

    def uninstall() -> None:
        # Only ours: something installed since (a %%capture) restores its own.
        if sys.stdout is out:
            sys.stdout = before[0]
        if sys.stderr is err:
            sys.stderr = before[1]

    return uninstall


def flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
