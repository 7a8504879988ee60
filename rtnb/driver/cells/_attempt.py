"""One run of a cell on one group: what it knows of each rank. A cell that runs again
on a rebuilt group (a recovery) starts a new :class:`Attempt`: the new ranks start
again from a checkpoint's step, below what the dead ones reached, and a stale step
left over would let a checkpoint commit before every new rank offered its shard.
"""

from __future__ import annotations

from typing import Any

from rtnb.core._messages import CellState, RankUpdate
from rtnb.driver.ranks import Execution

__all__ = ["Attempt"]


class Attempt:
    """Each rank's step, state, loaded checkpoint, line and data waits, as its
    updates arrive; ``execution`` is the ranks' calls and answers."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self.steps: dict[int, int] = {r: -1 for r in ranks}  # -1: not heard from yet
        self.states: dict[int, str] = {r: "running" for r in ranks}
        self.loaded: dict[int, str | None] = {}  # what each get_checkpoint() handed out
        self.lines: dict[int, int] = {}  # each rank's line of training (see _commits)
        self.data_waits: dict[int, dict[str, float]] = {}  # RankUpdate.data_waits
        self.execution: Execution | None = None

    @property
    def finished(self) -> dict[int, RankUpdate]:
        return self.execution.finished if self.execution is not None else {}

    def unfinished(self) -> list[int]:
        """The ranks whose cell has not ended."""
        execution = self.execution
        return execution.unfinished() if execution is not None else list(self.ranks)

    def took(self, update: RankUpdate) -> None:
        rank = update.rank
        self.steps[rank] = update.step
        self.lines[rank] = update.line
        self.states[rank] = "paused" if update.paused_at is not None else str(update.state)
        self.data_waits[rank] = update.data_waits if update.state is CellState.RUNNING else {}
        if update.loaded_checkpoint is not None and rank not in self.loaded:
            self.loaded[rank] = update.loaded_checkpoint

    def resumed_from(self, checkpoint: Any) -> str | None:
        """The checkpoint the ranks went on from when it moved their step count back
        (a resume), with the branch it started, if any."""
        if getattr(checkpoint, "resume", None) is None or not self.loaded:
            return None
        line = max(self.lines.values(), default=0)
        return str(checkpoint.id) + (f" (branch {line})" if line else "")

    def ended(self) -> None:
        for rank in self.ranks:
            if self.states.get(rank) in ("running", "paused"):
                self.states[rank] = "stopped"
