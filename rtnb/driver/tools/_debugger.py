"""The notebook's side of a debugger on a rank (``breakpoint()`` in a cell,
``%rtnb debug RANK``): show what pdb prints, ask the user at each prompt, send the
line. The rank side is ``rtnb.worker._debug``.

:func:`attach` is the one loop both uses run: a foreground cell's driver calls it
when a rank stops at a breakpoint (the prompt is the running cell's input box), and
``%rtnb debug`` calls it for a background cell's breakpoint or a post-mortem. A
prompt nobody can answer (a batch run: no stdin) is answered ``skip``: that rank
goes on and passes over the cell's later breakpoints, with one line saying so.
Ctrl-C (or the kernel's interrupt) at the prompt leaves the debugger and stops
the cell: the rank gets ``quit`` first, then the interrupt goes on to the caller.
"""

from __future__ import annotations

from collections.abc import Callable

from rtnb.driver.ranks import RankGroup, RankLost
from rtnb.errors import ConfigError, SessionError, one_line
from rtnb.worker._commands import DebugInput, DebugPoll, PostMortem
from rtnb.worker._debug import QUIT, SKIP

__all__ = ["Breakpoints", "attach", "post_mortem"]

_POLL_S = 0.25


def attach(
    group: RankGroup,
    rank: int,
    ask: Callable[[str], str],
    show: Callable[[str], None],
    note: Callable[[str], None],
) -> bool:
    """Talk to ``rank``'s debugger until it closes (continue, quit, the cell's end);
    False when nobody could answer its prompt and it was told to go on."""
    try:
        return _converse(group, rank, ask, show, note)
    except KeyboardInterrupt:
        # Wherever the interrupt landed (the prompt, a poll): the rank leaves pdb.
        _send(group, rank, QUIT)
        raise


def _converse(
    group: RankGroup,
    rank: int,
    ask: Callable[[str], str],
    show: Callable[[str], None],
    note: Callable[[str], None],
) -> bool:
    while True:
        try:
            (state,) = group.gather([group.command(rank, DebugPoll(_POLL_S))], 30.0)
        except (TimeoutError, RankLost) as exc:
            note(f"[rtnb] rank {rank}'s debugger is gone ({exc})\n")
            return True
        if state.output:
            show(state.output)
        if not state.active:
            return True
        if state.prompt is None:
            continue
        try:
            line = ask(state.prompt)
        except KeyboardInterrupt:
            raise
        except Exception:  # noqa: BLE001 - no stdin here (a batch run): never wait
            _send(group, rank, SKIP)
            where = f" at {state.where}" if state.where else ""
            note(
                f"[rtnb] rank {rank}: breakpoint(){where} skipped, and the rest of this "
                "cell's: nobody can answer a debugger prompt in this run\n"
            )
            return False
        if not _send(group, rank, line):
            note(f"[rtnb] rank {rank}'s debugger is gone\n")
            return True


def _send(group: RankGroup, rank: int, line: str) -> bool:
    """A line to the rank's debugger; False when the rank is gone (its poll says so)."""
    try:
        group.gather([group.command(rank, DebugInput(line))], 10.0)
    except (TimeoutError, RankLost):
        return False
    return True


class Breakpoints:
    """A running cell's ranks stopped at a breakpoint: a foreground cell's user
    answers each in the cell's input box; a background (or replayed) cell says once
    how to attach (``%rtnb debug RANK``), and :attr:`noted` keeps those ranks."""

    def __init__(self, in_foreground: bool, note: Callable[[str], None]) -> None:
        self.in_foreground = in_foreground
        self.waiting: dict[int, str] = {}  # rank -> where it stopped, not yet served
        self.noted: set[int] = set()
        self._note = note

    @property
    def any(self) -> bool:
        """A rank waits at a prompt (then it is not hung)."""
        return bool(self.waiting or self.noted)

    def took(self, rank: int, where: str | None, running: bool) -> None:
        if where is not None and running:
            self.waiting[rank] = where
        else:
            self.noted.discard(rank)

    def serve(self, stopping: bool, answer: Callable[[int], None]) -> None:
        waiting, self.waiting = self.waiting, {}
        for rank, where in sorted(waiting.items()):
            if stopping:
                continue  # the stop reaches the rank at its prompt: it leaves pdb
            if self.in_foreground:
                answer(rank)
            elif rank not in self.noted:
                self.noted.add(rank)
                self._note(
                    f"[rtnb] rank {rank} stopped at a breakpoint ({where}): run "
                    f"`%rtnb debug {rank}` in another cell to step through it\n"
                )


def post_mortem(
    group: RankGroup,
    rank: int | None,
    ask: Callable[[str], str],
    show: Callable[[str], None],
) -> None:
    """``%rtnb debug [RANK]`` after a cell failed: pdb in the failed cell's frames on
    ``rank`` (the first rank it failed on when None)."""
    candidates = [rank] if rank is not None else list(range(group.world_size))
    for candidate in candidates:
        if not 0 <= candidate < group.world_size:
            raise ConfigError(f"rank {candidate} is not in this group of {group.world_size}")
        try:
            (where,) = group.gather([group.command(candidate, PostMortem())], 30.0)
        except (RankLost, TimeoutError) as exc:
            raise SessionError(f"rank {candidate}: {one_line(exc)}") from None
        if where is None:
            if rank is not None:
                raise SessionError(
                    f"rank {candidate} has no failed cell to debug (its last cell ended "
                    "well, or none has run)"
                )
            continue
        show(f"[rtnb] post-mortem of rank {candidate}{' at ' + where if where else ''}\n")
        attach(group, candidate, ask, show, show)
        return
    raise SessionError(
        "no rank has a failed cell to debug: %rtnb debug opens the last failed cell's "
        "traceback on a rank (or a breakpoint a background cell stopped at)"
    )
