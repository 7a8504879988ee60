"""Which checkpoint the ranks get, and committing what they offer.

The checkpoint *in force* is what ``rtnb.get_checkpoint()`` returns in the next
cell: a checkpoint chosen with load / resume / the browser, until a newer
checkpoint is committed; otherwise the run's latest committed checkpoint (as Ray
Train hands a restarted ``train_loop_per_worker`` its latest checkpoint). Replayed
cells always get the latest. The checkpoint travels with each cell, so a cell sees
one checkpoint from start to end.

It also keeps the ranks' *position*: the line of training and its last step.
Handing out a checkpoint moves the ranks' step count to the checkpoint's step
(training goes on from its state). When later checkpoints of the current line
exist, that resume starts a *branch*: a new line number whose checkpoint ids
(``step-000000120-b1``) cannot collide with the original's, so a committed id is
never rewritten and the original stays loadable.
"""

from __future__ import annotations

import threading

from rtnb.errors import CheckpointError
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import CheckpointInfo, CheckpointStore, parse_checkpoint_id
from rtnb.storage._layout import RunRecord

__all__ = ["CheckpointCoordinator"]


class CheckpointCoordinator:
    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._chosen: Checkpoint | None = None
        self._latest: Checkpoint | None = None
        self._latest_known = False
        # Where the ranks' steps are: the line of training and its last step (-1:
        # nothing reported yet), and where each branch started (line -> checkpoint id).
        self.line = 0
        self.step = -1
        self.branched_from: dict[int, str] = {}
        self._offered: dict[int, str] = {}

    # ---- position ----------------------------------------------------------------------
    def restore(self, record: RunRecord | None) -> None:
        """Take the position a run record kept (a run carried on by a new session);
        without one (or one written before lines were recorded), the latest
        checkpoint's."""
        with self._lock:
            branches = record.branches if record is not None else {}
            self.branched_from = {int(k): v for k, v in branches.items()}
            if record is not None and record.line is not None:
                self.line, self.step = record.line, record.last_step
            else:
                info = self.store.latest()
                last = record.last_step if record is not None else -1
                self.step = max(last, info.step if info else -1)
                self.line = info.line if info else 0
            self._latest_known = False
            self._protect_locked()

    def record(self) -> dict:
        """What the run record keeps of the position (RunRecord's fields)."""
        return {
            "line": self.line,
            "last_step": self.step,
            "branches": {str(k): v for k, v in sorted(self.branched_from.items())},
        }

    def track(self, lines: dict[int, int], steps: dict[int, int]) -> None:
        """Follow the ranks of a running cell (their line and last step)."""
        if not lines:
            return
        line = max(lines.values())
        reached = max(
            (steps[r] for r, at in lines.items() if at == line and r in steps), default=None
        )
        if reached is None:
            return
        with self._lock:
            if line != self.line:
                self.line = line
                if line in self._offered:
                    self.branched_from[line] = self._offered[line]
                self._latest_known = False
                # (and after each commit: not on every poll, it lists storage)
                self._protect_locked()
            self.step = reached

    def _protect_locked(self) -> None:
        # A branch with nothing committed yet restarts from the checkpoint it began at.
        parent = self.branched_from.get(self.line)
        own = self.store.latest(self.line) if parent is not None else None
        self.store.protected = {parent} if parent is not None and own is None else set()

    # ---- which checkpoint --------------------------------------------------------------
    def latest(self) -> Checkpoint | None:
        """The latest committed checkpoint of the current line, where a recovery
        restarts from: a branch with nothing committed yet has its starting
        checkpoint (read from storage once, then kept current by the commits)."""
        with self._lock:
            if not self._latest_known:
                self._latest = self._get_or_none(self._latest_id_locked())
                self._latest_known = True
            return self._latest

    def latest_id(self) -> str | None:
        """The id :meth:`latest` names, read from the store's list (current even
        while a commit is still being announced to subscribers)."""
        with self._lock:
            return self._latest_id_locked()

    def _latest_id_locked(self) -> str | None:
        info = self.store.latest(self.line)
        if info is not None:
            return info.id
        if self.line == 0 and not self.branched_from:
            info = self.store.latest()  # a run directory written before lines
            return info.id if info is not None else None
        return self.branched_from.get(self.line)

    def _get_or_none(self, cid: str | None) -> Checkpoint | None:
        if cid is None:
            return None
        try:
            return self.store.get(cid)
        except CheckpointError:
            return None  # deleted by hand meanwhile

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

    def for_cell(self, replay: bool) -> Checkpoint | None:
        """The checkpoint a cell's ``get_checkpoint()`` hands out, carrying where the
        ranks' step count goes from there: (its step, the line to train on)."""
        checkpoint = self.latest() if replay else self.in_force()
        if checkpoint is None:
            return None
        step = _step_of(checkpoint)
        with self._lock:
            line = self.line
            ours = checkpoint.path.startswith(self.store.base.rstrip("/") + "/")
            own_line = parse_checkpoint_id(checkpoint.id) if ours else None
            # A checkpoint of another line branches, unless it is where the current
            # line began and that line has none of its own yet (its cell failed and
            # runs again: the same branch goes on).
            other_line = (
                own_line is not None
                and own_line[1] != line
                and not (
                    self.branched_from.get(line) == checkpoint.id
                    and self.store.latest(line) is None
                )
            )
            if other_line or (step < self.step and self._later_on_line(step, line)):
                line = max(self.store.lines() | set(self.branched_from) | {line}) + 1
                self._offered[line] = checkpoint.id if ours else checkpoint.uri
        sent = Checkpoint(checkpoint.path, checkpoint.filesystem, checkpoint.manifest)
        sent.resume = (step, line)
        return sent

    def _later_on_line(self, step: int, line: int) -> bool:
        """Whether the line has checkpoints (committed or being written) past ``step``:
        training on from ``step`` on that line would reuse their ids."""
        return any(
            info.line == line and info.step > step
            for info in self.store.list(include_incomplete=True)
        )

    def commit_ready(self, steps: dict[int, int], ranks: set[int]) -> list[CheckpointInfo]:
        """Commit what every rank has passed; a failure raises one CheckpointError
        line naming the checkpoint."""
        committed = self.store.commit_ready(steps, ranks)
        if committed:
            newest = max(committed, key=lambda c: (c.time, c.step))
            with self._lock:
                if newest.line == self.line:
                    self._latest = self.store.get(newest.id)
                    self._latest_known = True
                else:
                    self._latest_known = False
                # A newer checkpoint supersedes the one the user chose.
                self._chosen = None
                self._protect_locked()
        return committed


def _step_of(checkpoint: Checkpoint) -> int:
    manifest = checkpoint.manifest or {}
    try:
        return int(manifest.get("step", -1))
    except (TypeError, ValueError):
        raise CheckpointError(f"checkpoint {checkpoint.id} has a damaged manifest") from None
