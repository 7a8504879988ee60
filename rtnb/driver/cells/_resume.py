"""Resume: a checkpoint chosen (this run's or another run's in the same storage) and
the training cell that runs from it.

:class:`ResumeFlow` is the one owner of loading a checkpoint for the ranks (the
browser's Load and Resume, ``%rtnb load``/``resume``, ``Session.resume``): it checks
the checkpoint, journals the choice before it takes effect, hands it to the commit
coordinator, and says which cell Resume runs (a :class:`ResumePlan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rtnb.core._config import SessionConfig
from rtnb.driver.cells._commits import CheckpointCoordinator
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import CheckpointStore

__all__ = ["ResumeFlow", "ResumePlan"]


@dataclass(frozen=True)
class ResumePlan:
    """A checkpoint loaded for Resume, and the training cell to run from it (None:
    no cell reported yet; the next one starts from the checkpoint)."""

    checkpoint: Checkpoint
    code: str | None
    label: str | None


class _TrainingCells(Protocol):
    # (code, its name in the notebook) of the last cell that reported, if any
    last_training: tuple[str, str | None] | None

    def record_load(self, checkpoint_id: str, run: str | None) -> None: ...


class ResumeFlow:
    def __init__(
        self,
        config: SessionConfig,
        run_name: str,
        checkpoints: CheckpointStore,
        commits: CheckpointCoordinator,
        cells: _TrainingCells,
    ) -> None:
        self._config = config
        self._run_name = run_name
        self._checkpoints = checkpoints
        self._commits = commits
        self._cells = cells

    def store(self, run: str | None = None) -> CheckpointStore:
        """This run's checkpoints, or those of another run in the same storage."""
        if run is None or run == self._run_name:
            return self._checkpoints
        return CheckpointStore.of_run(self._config.storage_path, run)

    def load(self, checkpoint_id: str, run: str | None) -> Checkpoint:
        checkpoint = self.store(run).get(checkpoint_id)
        checkpoint.verify()
        self._cells.record_load(checkpoint.id, run)  # journaled before it takes effect
        self._commits.choose(checkpoint)
        return checkpoint

    def plan(self, checkpoint_id: str, run: str | None) -> ResumePlan:
        checkpoint = self.load(checkpoint_id, run)
        code, label = self._cells.last_training or (None, None)
        return ResumePlan(checkpoint, code, label)
