"""The hang doctor as a cell observer: a cell whose ranks reported and printed
nothing for ``--hang-after`` seconds (none at a debugger's prompt) has every rank's
stack read and one line saying where each waits (:class:`~rtnb.driver.tools.HangWatch`);
the stacks are kept in the ranks' logs and shown by the live view until the ranks
move again. Not for a replayed cell: nobody watches it."""

from __future__ import annotations

import time

from rtnb.core._messages import CellState, RankUpdate
from rtnb.core._stacks import GroupStacks
from rtnb.driver.cells._observers import CellObserver, CellView, ObserverContext
from rtnb.driver.tools import HangWatch
from rtnb.storage._logs import RankLogs

__all__ = ["HangDoctor", "observe"]


class HangDoctor(CellObserver):
    def __init__(self, cell: CellView, context: ObserverContext) -> None:
        self.watch = HangWatch(
            context.hang_after_s,
            lambda: cell.name,
            lambda quiet: context.stacks(cell.unfinished(), stalled_s=quiet),
            cell.note,
            cell.done,
            lambda stacks: _keep_stacks(context.logs, cell.name, stacks),
        )
        self._steps: dict[int, int] = {}
        self._at_prompt: set[int] = set()  # ranks waiting at a debugger's prompt

    @property
    def stacks(self) -> GroupStacks | None:
        """Every rank's stack, once read (until the ranks move)."""
        return self.watch.stacks

    def update(self, cell: CellView, update: RankUpdate) -> None:
        rank = update.rank
        if _moved(update, self._steps.get(rank, -1)):
            self.watch.moved()
        self._steps[rank] = update.step
        if update.debugging is not None and update.state is CellState.RUNNING:
            self._at_prompt.add(rank)
        else:
            self._at_prompt.discard(rank)

    def tick(self, cell: CellView) -> None:
        if cell.stopping:
            return
        if self._at_prompt:
            self.watch.moved()  # a rank at a pdb prompt is not hung
        else:
            self.watch.check()

    def restart(self, cell: CellView) -> None:
        # The new ranks start again from the checkpoint's step, below the old ones'.
        self._steps.clear()
        self._at_prompt.clear()


def observe(cell: CellView, context: ObserverContext) -> HangDoctor | None:
    return None if cell.replay else HangDoctor(cell, context)


def _moved(update: RankUpdate, step_before: int) -> bool:
    """Whether the rank shows life (a rank whose checkpoints are still uploading at
    the cell's end is waiting on storage, not hung)."""
    return bool(update.output or update.reports or update.uploading) or update.step != step_before


def _keep_stacks(logs: RankLogs | None, name: str, stacks: GroupStacks) -> str:
    """The hang doctor's full stacks, appended to each rank's log; where rank
    ``min``'s went (for the note), "" when the run keeps no logs."""
    if logs is None or not stacks.stacks:
        return ""
    text = f"[rtnb] hang doctor, {time.strftime('%H:%M:%S')}, {name}:\n{stacks.text()}\n"
    for rank in stacks.stacks:
        logs.add(rank, text)
    logs.flush()
    first = min(stacks.stacks)
    more = " and the other ranks' logs" if len(stacks.stacks) > 1 else ""
    return f"{logs.where(first)}{more}"
