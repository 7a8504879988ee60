"""One cell's run on one group: the rank protocol, written once.

A group starts a cell with ``group.execute(request, ranks)`` and gets an
:class:`Execution`, which alone sequences the ranks' calls for it: the start (one
relayed call through rank 0 in a large group, else one per rank, under one token so
no rank runs it twice), a long-poll always in flight for every unfinished rank, the
answers as :class:`~rtnb.core._messages.RankUpdate`\\ s, a rank's death, a live
change (hold every rank at its next report, choose a step none has begun, release
them all) and the calls each phase of a stop sends (decided by the cell's
:class:`~rtnb.driver.ranks._stopping.StopProtocol`). The cell handle (``cells/_handle.py``) is a
view over its executions: it applies their updates and decides nothing about ranks'
calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from rtnb.core._messages import CellRequest, CellState, RankUpdate
from rtnb.driver.ranks._stopping import StopProtocol
from rtnb.errors import one_line
from rtnb.worker._actor import POLL_WAIT_S
from rtnb.worker._commands import Hold, Interrupt, RankCommand, Release, Stop, StopAt

__all__ = ["Execution", "RankCalls", "RankLost", "release_everywhere"]

# How long rank 0 waits for the relayed ranks' answers: a first wait, and slack for
# a busy machine to wake them. A rank that did not answer by then (a longer cell: it
# runs in the listening thread and answers only when it ends) is asked directly.
RELAY_WAIT_S = POLL_WAIT_S + 0.25
# How long the ranks get to answer a hold or a release for a live change.
HOLD_WAIT_S = 10.0
_CHANGE_IDS = itertools.count(1)  # live changes, numbered per kernel


class RankLost(Exception):
    """A rank's process died (or the call to it failed for good)."""


class RankCalls(Protocol):
    """The calls an execution makes on its group's ranks (each returns a pending
    call that ``take_ready``/``gather`` resolve)."""

    @property
    def world_size(self) -> int: ...

    @property
    def relays(self) -> bool: ...

    def next_token(self) -> int | None: ...

    def where(self, rank: int) -> str | None: ...

    def cut_off(self) -> dict[int, str]: ...

    def relay(self, request: CellRequest, ranks: list[int], wait_s: float) -> Any: ...

    def relay_answers(self, result: Any) -> dict[int, RankUpdate | None]: ...

    def run(self, rank: int, request: CellRequest) -> Any: ...

    def poll(self, rank: int) -> Any: ...

    def command(self, rank: int, command: RankCommand, payload: Any = None) -> Any:
        """Every control call (:mod:`rtnb.worker._commands`): ``payload`` is bulk
        data from :meth:`share`, stored once for many ranks."""
        ...

    def gather(self, calls: list[Any], timeout_s: float) -> list[Any]: ...

    def take_ready(self, calls: list[Any], timeout_s: float) -> tuple[list[Any], list[Any]]: ...


class Execution:
    """A cell on ``ranks`` of ``group``: started at once; see the module docstring.

    ``finished``: each rank's last update once its cell ended; ``dead``: ranks that
    died, each with one line; ``last``: each rank's latest update."""

    def __init__(self, group: RankCalls, request: CellRequest, ranks: list[int]) -> None:
        self.group = group
        self.ranks = list(ranks)
        self.finished: dict[int, RankUpdate] = {}
        self.dead: dict[int, str] = {}
        self.last: dict[int, RankUpdate] = {}
        self._pending: dict[Any, int] = {}  # call in flight -> its rank
        self._relay: Any = None  # rank 0's relay call while it is out
        # One token per dispatch: a rank starts the cell at most once under it. In a
        # relaying group every cell goes through rank 0, one on a single rank too:
        # each listening rank runs all its cells in its listening thread.
        self.request = request = dataclasses.replace(request, token=group.next_token())
        if group.relays:
            # One call to rank 0 starts the cell everywhere and brings back the
            # answers of ranks that finished at once; the others are asked directly.
            self._relay = group.relay(request, self.ranks, RELAY_WAIT_S)
        else:
            for rank in self.ranks:
                self._run_on(rank)

    @property
    def over(self) -> bool:
        """Every rank finished or died."""
        return len(self.finished) + len(self.dead) >= len(self.ranks)

    def unfinished(self) -> list[int]:
        return [r for r in self.ranks if r not in self.finished and r not in self.dead]

    def _lose_cut_off(self) -> None:
        """Ranks on a machine that stopped answering are lost now: their calls would
        wait until Ray's health checks give up on the machine (over a minute)."""
        for rank, why in self.group.cut_off().items():
            if rank in self.ranks and rank not in self.finished and rank not in self.dead:
                self.dead[rank] = why
                for call, owner in list(self._pending.items()):
                    if owner == rank:
                        del self._pending[call]

    # ---- answers -----------------------------------------------------------------------
    def take(self, wait_s: float) -> list[RankUpdate]:
        """The updates that arrived within ``wait_s``, in order (a running rank is
        polled again; a rank whose call failed is in :attr:`dead`)."""
        self._lose_cut_off()
        self._ensure_polled()
        calls = list(self._pending)
        if self._relay is not None:
            calls.append(self._relay)
        ready, answers = self.group.take_ready(calls, wait_s)
        updates: list[RankUpdate] = []
        for call, answer in zip(ready, answers):
            if call is self._relay:
                updates += self._take_relayed(answer)
                continue
            rank = self._pending.pop(call)
            if isinstance(answer, BaseException):
                place = self.group.where(rank)
                said = one_line(answer)
                self.dead[rank] = f"on {place}: {said}" if place else said
                continue
            updates.append(self._took(answer))
        return updates

    def _took(self, update: RankUpdate) -> RankUpdate:
        self.last[update.rank] = update
        if update.state is CellState.RUNNING:
            self._pending[self.group.poll(update.rank)] = update.rank
        else:
            self.finished[update.rank] = update
        return update

    def _take_relayed(self, answers: Any) -> list[RankUpdate]:
        """Rank 0's relay came back: the ranks that ended answered with their last
        update; the rest are asked directly (the same token: none starts twice)."""
        self._relay = None
        by_rank = self.group.relay_answers(answers)
        updates = []
        for rank in self.ranks:
            update = by_rank.get(rank)
            if update is not None and update.state is not CellState.RUNNING:
                self.last[rank] = update
                self.finished[rank] = update
                updates.append(update)
            else:
                self._run_on(rank)
        return updates

    def _run_on(self, rank: int) -> None:
        """Start the cell on ``rank`` (unless the relay did, under the same token) and
        keep its first long-poll in flight."""
        self._pending[self.group.run(rank, self.request)] = rank

    def _ensure_polled(self) -> None:
        # A Ctrl-C can land between taking an update and polling again: every
        # unfinished rank always has a call in flight (the relay counts for all).
        if self._relay is not None:
            return
        polled = set(self._pending.values())
        for rank in self.unfinished():
            if rank not in polled:
                self._pending[self.group.poll(rank)] = rank

    # ---- a stop ------------------------------------------------------------------------
    def advance_stop(self, stop: StopProtocol, steps: Mapping[int, int]) -> bool:
        """Send what the stop's phase calls for; True once the group must be rebuilt
        (or, for a final stop, left)."""
        unfinished = self.unfinished()
        action = stop.advance(unfinished, self.last, steps)
        for rank in unfinished:
            if action.pause:
                self.group.command(rank, Stop())
            if action.target is not None:
                self.group.command(rank, StopAt(action.target))
            if action.interrupt:
                self.group.command(rank, Interrupt())
        return action.rebuild

    # ---- a live change -----------------------------------------------------------------
    def change(
        self,
        values: dict[str, Any],
        triggers: tuple[str, ...],
        steps: Mapping[int, int],
        write_ahead: Callable[[int], None],
    ) -> tuple[int | None, list[int]]:
        """Hold every running rank at its next report, take the furthest step any
        reported, and release them with the change holding from two steps past it:
        a step no rank has begun (each is paused at most one step further).
        ``write_ahead(step)`` records it before any rank is released. Returns (the
        step or None, the ranks that did not answer the hold)."""
        ranks = self.unfinished()
        if not ranks:
            return None, []
        group = self.group
        change = next(_CHANGE_IDS)
        calls = {group.command(rank, Hold(change)): rank for rank in ranks}
        step: int | None = None
        silent: list[int] = []
        try:
            held: dict[int, int | None] = {}
            deadline = time.monotonic() + HOLD_WAIT_S
            waiting = list(calls)
            while waiting and time.monotonic() < deadline:
                ready, answers = group.take_ready(waiting, deadline - time.monotonic())
                for call, answer in zip(ready, answers):
                    waiting.remove(call)
                    held[calls[call]] = None if isinstance(answer, BaseException) else answer
            silent = [calls[call] for call in waiting]
            reported = [s for s in held.values() if s is not None]
            if reported:
                # A rank that did not answer (busy in native code holding the GIL) is
                # where its last update left it; its hold is void once released.
                chosen = max(reported + [steps.get(r, -1) for r in silent]) + 2
                write_ahead(chosen)
                step = chosen
        finally:
            # Every held rank is released, whatever failed above (then with nothing).
            if step is None:
                values, triggers = {}, ()
            # Ranks done with this cell (or not in it) get the values too, so every
            # rank starts the next cell with the same ones; triggers are the
            # running ranks'.
            at = step if step is not None else -1
            releases = [
                group.command(rank, Release(values, at, triggers if rank in ranks else (), change))
                for rank in range(group.world_size)
            ]
            with contextlib.suppress(TimeoutError, RankLost):
                group.gather(releases, HOLD_WAIT_S)
        return step, silent


def command_all(
    group: RankCalls, ranks: Iterable[int], command: RankCommand, payload: Any = None
) -> list[Any]:
    """``command`` sent to each of ``ranks``: the pending calls, in rank order."""
    return [group.command(rank, command, payload) for rank in ranks]


def release_everywhere(group: RankCalls, values: dict[str, Any]) -> list[Any]:
    """``values`` in force on every rank from now on, between cells (a replay, or a
    change while no cell runs): the pending calls."""
    return command_all(group, range(group.world_size), Release(values, -1))
