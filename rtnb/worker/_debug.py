"""A debugger on a rank, answered from the notebook.

``breakpoint()`` in a cell on a Ray rank (or ``rtnb.breakpoint(rank=1)``) opens
Python's pdb on that rank with a :class:`DebugChannel` as its stdin and stdout:
what pdb prints is kept for the driver, its prompt is published, and the line the
notebook's user types comes back through the channel. The driver takes the
channel's state with the rank's long-poll (``RankUpdate.debugging``) and then
talks to it with ``debug_poll``/``debug_input`` on the rank's control threads. A
failed cell's traceback is kept so ``%rtnb debug RANK`` opens a post-mortem on it
(in a thread of its own; the cell thread is free).

A stop reaches a rank waiting at the prompt (the cell leaves the debugger and
stops at once); a driver that cannot ask (a batch run) answers ``skip``: the
prompt continues and the cell's later breakpoints are passed over.
"""

from __future__ import annotations

import os
import pdb
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DebugChannel", "DebugState", "DebugStopped", "RankDebugger", "RankPdb"]

# What the driver sends instead of a line: leave the debugger (a stop, Ctrl-C at
# the prompt) or continue and pass over this cell's later breakpoints (no stdin).
QUIT = "\x00quit"
SKIP = "\x00skip"


class DebugStopped(KeyboardInterrupt):
    """Leaves the debugger and the cell: a stop, or Ctrl-C at the prompt. A
    KeyboardInterrupt, as the cell's own stop is, so ``except Exception`` in user
    code does not swallow it."""


@dataclass
class DebugState:
    """What the driver gets from a rank's debugger: pdb's output since the last
    poll, its prompt when it waits for a line, whether a debugger is open."""

    output: str
    prompt: str | None
    active: bool
    where: str = ""  # "cell [5] line 3": where it stopped


class DebugChannel:
    """pdb's stdin and stdout on a rank, answered by the driver."""

    def __init__(self, rank: int, cond: threading.Condition, stopping: Callable[[], bool]) -> None:
        self.rank = rank
        self._cond = cond  # the runtime's: its long-poll wakes when a prompt appears
        self._stopping = stopping
        self._output: list[str] = []
        self._lines: list[str] = []
        self.prompt: str | None = None
        self.active = False
        self.where = ""
        self.skip = False  # this cell's breakpoints are passed over (nobody can answer)
        self.reported = False  # the long-poll said a debugger opened

    # pdb's side (the thread being debugged)
    def open(self, where: str) -> None:
        with self._cond:
            self.active, self.where, self.reported = True, where, False
            self._lines.clear()
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.active, self.prompt = False, None
            self._cond.notify_all()

    def write(self, text: str) -> int:
        with self._cond:
            self._output.append(text)
            self._cond.notify_all()
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        with self._cond:
            self.prompt = f"(Pdb rank {self.rank}) "
            self._cond.notify_all()
            try:
                while not self._lines:
                    if self._stopping():
                        raise DebugStopped("stopped in the debugger")
                    self._cond.wait(0.1)
                line = self._lines.pop(0)
            finally:
                self.prompt = None
        if line == QUIT:
            raise DebugStopped("stopped in the debugger")
        if line == SKIP:
            self.skip = True
            return "continue\n"
        return line if line.endswith("\n") else line + "\n"

    # the driver's side (control threads)
    def give(self, line: str) -> None:
        with self._cond:
            self._lines.append(line)
            # This prompt is answered now, not when pdb's thread wakes to read the
            # line: a poll in between would otherwise ask the user a second time.
            self.prompt = None
            self._cond.notify_all()

    def poll(self, wait_s: float) -> DebugState:
        with self._cond:
            self._cond.wait_for(lambda: self._output or self.prompt or not self.active, wait_s)
            output, self._output = "".join(self._output), []
            return DebugState(output, self.prompt, self.active, self.where)


class RankPdb(pdb.Pdb):
    """Python's pdb reading and writing through a :class:`DebugChannel`: the prompt
    travels as the channel's, not as output."""

    def __init__(self, channel: DebugChannel) -> None:
        super().__init__(stdin=channel, stdout=channel, nosigint=True)
        self.use_rawinput = False
        self.prompt = ""
        self.channel = channel


def where_in_cell(frame) -> str:
    from rtnb.core._stacks import cell_name

    while frame is not None:
        cell = cell_name(frame.f_code.co_filename)
        if cell is not None:
            return f"{cell} line {frame.f_lineno}"
        frame = frame.f_back
    return ""


def stdlib_set_trace(channel: DebugChannel, frame) -> None:
    """Stop in ``frame`` with pdb on ``channel``; closes the channel when pdb is done."""
    channel.open(where_in_cell(frame))
    debugger = RankPdb(channel)
    # set_trace returns at once; the debugger runs on the trace hook, closing the
    # channel when the user continues (or the cell leaves it).
    original = debugger.set_continue

    def set_continue() -> None:
        original()
        channel.close()

    debugger.set_continue = set_continue  # type: ignore[method-assign]
    debugger.set_trace(frame)


def post_mortem(channel: DebugChannel, traceback) -> None:
    """pdb on ``traceback`` (the channel opened by the caller); closes it at the end."""
    try:
        debugger = RankPdb(channel)
        debugger.reset()
        debugger.interaction(None, traceback)
    except BaseException:  # noqa: BLE001 - a quit or a stop ends the post-mortem
        pass
    finally:
        channel.close()


def where_in_traceback(tb) -> str:
    where = ""
    while tb is not None:
        found = where_in_cell(tb.tb_frame) if tb.tb_frame else ""
        where = found or where
        tb = tb.tb_next
    return where


class RankDebugger:
    """A rank's debugger, a part of its runtime: the channel the driver talks to, the
    breakpoints a cell may stop at, and the last failed cell's traceback for a
    post-mortem. Handed the runtime's condition and three questions about the cell
    (stopping, its thread, a replay); it reaches no other part's fields."""

    def __init__(
        self,
        rank: int,
        cond: threading.Condition,
        stopping: Callable[[], bool],
        cell_thread: Callable[[], int | None],
        replaying: Callable[[], bool],
    ) -> None:
        self.channel = DebugChannel(rank, cond, stopping)
        self._cell_thread = cell_thread
        self._replaying = replaying
        self.failed_traceback = None

    def cell_starts(self) -> None:
        self.channel.skip = False
        self.failed_traceback = None

    def cell_failed(self, traceback_) -> None:
        self.failed_traceback = traceback_

    def cell_ends(self) -> None:
        """A debugger stepped past the cell's end goes with it."""
        if self.channel.active:
            sys.settrace(None)
            self.channel.close()

    @property
    def waiting_unreported(self) -> bool:
        """A debugger opened that the long-poll has not told the driver of yet."""
        return self.channel.active and not self.channel.reported

    def where_reported_locked(self) -> str | None:
        """Where the open debugger stopped, now told to the driver (None: none open)."""
        if not self.channel.active:
            return None
        self.channel.reported = True
        return self.channel.where or "a breakpoint"

    def breakpoint(self, *_args, **_kwargs) -> None:
        """``sys.breakpointhook`` on a rank: pdb in the caller's frame, answered from
        the notebook; only in the cell thread, never in a replay or once the driver
        said nobody can answer (a batch run)."""
        self.breakpoint_at(sys._getframe(1))

    def breakpoint_at(self, frame) -> None:
        if (
            threading.get_ident() != self._cell_thread()
            or self._replaying()
            or self.channel.skip
            or os.environ.get("PYTHONBREAKPOINT") == "0"
        ):
            return
        stdlib_set_trace(self.channel, frame)

    def poll(self, wait_s: float) -> DebugState:
        return self.channel.poll(wait_s)

    def give(self, line: str) -> None:
        self.channel.give(line)

    def post_mortem(self) -> str | None:
        """Open pdb on the last failed cell's traceback (in a thread of its own);
        where it stopped, or None when no cell failed here since."""
        traceback_ = self.failed_traceback
        if traceback_ is None:
            return None
        if self.channel.active:
            return self.channel.where
        self.channel.open(where_in_traceback(traceback_))
        threading.Thread(
            target=post_mortem,
            args=(self.channel, traceback_),
            name="rtnb-post-mortem",
            daemon=True,
        ).start()
        return self.channel.where
