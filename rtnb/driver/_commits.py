"""Which checkpoint the ranks get, and committing what they offer.

The checkpoint *in force* is what ``rtnb.get_checkpoint()`` returns in the next
cell: a checkpoint chosen with load / resume / the browser, until a newer
checkpoint is committed; otherwise the run's latest committed checkpoint (as Ray
Train hands a restarted ``train_loop_per_worker`` its latest checkpoint). Replayed
cells always get the latest. The checkpoint travels with each cell, so a cell sees
one checkpoint from start to end.
"""

from __future__ import annotations

import threading

from rtnb.errors import CheckpointError
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import CheckpointInfo, CheckpointStore

__all__ = ["CheckpointCoordinator"]


class CheckpointCoordinator:
    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._chosen: Checkpoint | None = None
        self._latest: Checkpoint | None = None
        self._latest_known = False

    def latest(self) -> Checkpoint | None:
        """The run's latest committed checkpoint (read from storage once, then kept
        current by the commits of this session)."""
        with self._lock:
            if not self._latest_known:
                info = self.store.latest()
                self._latest = self.store.get(info.id) if info is not None else None
                self._latest_known = True
            return self._latest

    def forget_latest(self) -> None:
        """Read the latest from storage again (after a delete, or another writer)."""
        with self._lock:
            self._latest_known = False

    def choose(self, checkpoint: Checkpoint) -> None:
        with self._lock:
            self._chosen = checkpoint

    @property
    def chosen(self) -> Checkpoint | None:
        return self._chosen

    def in_force(self) -> Checkpoint | None:
        """What the next cell's ``get_checkpoint()`` returns."""
        return self._chosen if self._chosen is not None else self.latest()

    def commit_ready(self, steps: dict[int, int], ranks: set[int]) -> list[CheckpointInfo]:
        """Commit what every rank has passed; a failure raises one CheckpointError
        line naming the checkpoint."""
        committed = self.store.commit_ready(steps, ranks)
        if committed:
            newest = max(committed, key=lambda c: c.step)
            with self._lock:
                current = self._latest
                if current is None or newest.step >= _step_of(current):
                    self._latest = self.store.get(newest.id)
                    self._latest_known = True
                # A newer checkpoint supersedes the one the user chose.
                self._chosen = None
        return committed


def _step_of(checkpoint: Checkpoint) -> int:
    manifest = checkpoint.manifest or {}
    try:
        return int(manifest.get("step", -1))
    except (TypeError, ValueError):
        raise CheckpointError(f"checkpoint {checkpoint.id} has a damaged manifest") from None
