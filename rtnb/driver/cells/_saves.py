"""A cell's commits and writes to the run's storage. The first that fails stops the
cell on every rank at one step (cooperatively, as an interrupt does), and the cell
ends with one line saying what failed: a checkpoint that cannot be committed fails
its cell, never a silently lost save."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

from rtnb.core._messages import RankUpdate
from rtnb.driver.cells._outcome import storage_stopped
from rtnb.errors import CheckpointError
from rtnb.storage._checkpoints import CheckpointStore

__all__ = ["CellSaves"]


class Committer(Protocol):
    """What the saves need of the cell's context."""

    run_name: str
    checkpoints: CheckpointStore

    def commit(self, handle: Any) -> None: ...

    def latest_checkpoint_id(self) -> str | None: ...


class CellSaves:
    """One cell's commits; ``stop(reason)`` stops the cell on every rank."""

    def __init__(self, context: Committer, stop: Callable[[str], None]) -> None:
        self._context = context
        self._stop = stop
        self.commit_error: CheckpointError | None = None
        # The first storage write that failed (checkpoint files, metrics record, logs,
        # a commit).
        self.storage_failure: str | None = None

    @property
    def failed(self) -> bool:
        return self.commit_error is not None or self.storage_failure is not None

    def commit(self, handle: Any) -> None:
        """Commit what every rank of ``handle`` offered (none for a replay)."""
        if handle.replay or self.commit_error is not None:
            return
        try:
            self._context.commit(handle)
        except CheckpointError as exc:
            # The cell fails with this line; its ranks stop at a common step first.
            self.commit_error = exc
            self._stop(f"stopped: {exc}")
        except OSError as exc:  # the manifest could not be written
            self.storage_failed(str(exc))

    def storage_failed(self, what: str) -> None:
        if self.storage_failure is None:
            self.storage_failure = what
            self._stop("stopped because storage failed")

    def last_commit(
        self, handle: Any, value: Any, error: BaseException | None
    ) -> tuple[Any, BaseException | None]:
        """The cell's end commits what is left; a failure there is the cell's error."""
        if not handle.replay and self.commit_error is None:
            try:
                self._context.commit(handle)
            except CheckpointError as exc:
                if error is None:
                    value, error = None, exc
        return value, error

    def ending_error(
        self, name: str, finished: dict[int, RankUpdate], at: int | None
    ) -> BaseException | None:
        """The error a cell that a failed save stopped ends with (None: none failed);
        ``at`` is the ranks' common stop step."""
        if self.commit_error is not None:
            return self.commit_error
        if self.storage_failure is None:
            return None
        self._context.checkpoints.drop_pending()  # lacks files some rank could not write
        latest = None
        with contextlib.suppress(Exception):
            latest = self._context.latest_checkpoint_id()
        return storage_stopped(
            name, self.storage_failure, finished, latest, self._context.run_name, at
        )
