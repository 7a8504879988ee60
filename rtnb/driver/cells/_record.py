"""What a cell is, as its readers see it: :class:`CellRecord`.

The session's status, the live view, the detached host and a user's own code read a
cell (its ranks' steps, its output, where it went on from, whether it ended) and
wait for it; only the :class:`~rtnb.driver.cells._handle.CellHandle`, which extends
this record, drives it. Keeping the two apart keeps the handle to dispatch, drive,
stop escalation, recovery and finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rtnb.core._output import CellOutput, OutputSink
from rtnb.core._stacks import GroupStacks
from rtnb.core._values import PerRank
from rtnb.driver.cells._attempt import Attempt
from rtnb.driver.cells._cell_stop import CellStop
from rtnb.driver.cells._outcome import Completion, WatchedGroup
from rtnb.driver.cells._watch_breakpoints import BreakpointWatch
from rtnb.driver.cells._watch_hang import HangDoctor
from rtnb.driver.cells._watch_restart import RestartOrigin

if TYPE_CHECKING:
    from rtnb.driver.cells._observers import CellObservers

__all__ = ["CellRecord"]


class CellRecord:
    """A cell running (or finished) on the ranks of a session.

    ``wait()`` returns its :class:`PerRank` value or raises its error; ``stop()``
    stops it on every rank; ``log`` keeps the recent output for late viewers.
    ``loaded`` maps each rank to the checkpoint its ``get_checkpoint()`` handed
    out; after a recovery ``restarted_from`` is what the ranks really loaded.
    """

    observers: CellObservers  # the features that follow the cell (the handle's)

    def __init__(
        self,
        waited: WatchedGroup,
        kept_where: Callable[[int], str],
        cell_id: int,
        code: str,
        ranks: list[int],
        label: str | None,
        timeout_s: float | None,
        background: bool,
        replay: bool,
    ) -> None:
        self._waited = waited
        self.cell_id = cell_id
        self.label = label  # Jupyter's "[4]" for the header and errors, else rtnb's number
        self.code = code
        self.timeout_s = timeout_s
        self.background = background
        self.replay = replay  # rebuilding state after a failure: nothing is published
        self.started_at = time.time()
        self.ended_at: float | None = None
        self._output = CellOutput(kept_where)  # where a rank's whole output is kept
        self.reported, self.recoveries = False, 0
        self.recovering = False  # the group is being rebuilt for this cell right now
        self._end = Completion()
        self._checkpoint: Any = None  # the checkpoint this cell's dispatch carries
        self.attempt = Attempt(ranks)  # this run of the cell on its group
        self._stopping = CellStop(waited.stop_grace_s)

    @property
    def name(self) -> str:
        """What messages call this cell: ``cell [4]`` (the notebook's execution
        count) when it came from a notebook cell, else ``cell 3`` (rtnb's number)."""
        return f"cell {self.label or self.cell_id}"

    @property
    def ranks(self) -> list[int]:
        """The ranks the cell runs on (after a recovery that shrank the group, those
        that remain)."""
        return self.attempt.ranks

    @property
    def steps(self) -> dict[int, int]:
        """Each rank's latest step (-1: not heard from yet)."""
        return self.attempt.steps

    @property
    def loaded(self) -> dict[int, str | None]:
        return self.attempt.loaded

    def unfinished(self) -> list[int]:
        """The ranks whose cell has not ended."""
        return self.attempt.unfinished()

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint this cell's ranks went on from, when it moved their step
        count back (a resume); with the branch it started, if any."""
        return None if self.replay else self.attempt.resumed_from(self._checkpoint)

    @property
    def restarted_from(self) -> str | None:
        """What the ranks loaded when the cell ran again after a recovery."""
        origin = self.observers.find(RestartOrigin)
        return origin.origin if origin is not None else None

    @property
    def hang(self) -> GroupStacks | None:
        """Every rank's stack, once the hang doctor read them (until they move)."""
        doctor = self.observers.find(HangDoctor)
        return doctor.stacks if doctor is not None else None

    @property
    def debugging(self) -> list[int]:
        """Ranks a background cell left at a breakpoint (``%rtnb debug`` attaches)."""
        return self.observers.find(BreakpointWatch).debugging

    @property
    def stopping(self) -> bool:
        """A stop of this cell is under way."""
        return self._stopping.requested

    def add_sink(self, sink: OutputSink, replay: bool = True) -> None:
        """Send this cell's output to ``sink(rank, stream, text)`` (past output first)."""
        self._output.add_sink(sink, replay)

    @property
    def log(self) -> list[tuple[int, str, str]]:
        """The recent output, (rank, stream, text), for views opened late."""
        return self._output.log

    def note(self, text: str) -> None:
        """A line from rtnb itself to this cell's viewers (rank -1 for the sinks)."""
        self._output.note(text)

    def show(self, rank: int, text: str) -> None:
        """``text`` as rank ``rank``'s own output (a debugger's lines)."""
        self._output.send(rank, "stdout", text)

    # ---- its end -------------------------------------------------------------------------
    def before_end(self, last_words: Callable[[], None]) -> None:
        """Call ``last_words()`` as the cell ends, before its output is flushed, so
        what it notes (a pipeline's summary) is still the cell's."""
        self._end.before_end(last_words)

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._end.add_callback(callback, self)

    def done(self) -> bool:
        return self._end.done()

    def wait(self, timeout: float | None = None) -> PerRank:
        """Block until the cell ends; its value per rank, or its error raised.

        Never hangs on a group that is gone: a cell whose group was stopped and that
        has not ended within the stop grace raises one SessionError line; one whose
        Ray went away, the cell's own ClusterError line within a second."""
        return self._end.wait(timeout, self.name, self._waited)

    result = wait

    def wait_left(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the cell to end; True when every rank left it
        by itself (dead or stuck ranks never do)."""
        self._end.wait_done(timeout)
        return self.done() and len(self.attempt.finished) == len(self.ranks)

    @property
    def error(self) -> BaseException | None:
        return self._end.error

    @property
    def elapsed_s(self) -> float:
        return (self.ended_at or time.time()) - self.started_at

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<rtnb cell {self.cell_id} on ranks {self.ranks}: {state}, {self.elapsed_s:.1f} s>"
