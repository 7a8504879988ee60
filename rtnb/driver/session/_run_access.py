"""One run of a storage as the notebook's views see it: its metrics, its checkpoints,
and what can be done with them from this kernel.

A run is this kernel's own (the session's run), another run in the session's storage
(its checkpoints can be loaded into the session's group, or resumed there), or a run
in storage this kernel's session does not use (read only). The magics and the
checkpoint browser ask this module which, instead of deciding it themselves.

    In [1]: access = open_run("/data/runs", "mnist", session)
    In [2]: access.metrics().metric_names(), access.can_act
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rtnb.core._redact import redact_uri
from rtnb.driver.scripts import ExportedScript, export_run
from rtnb.errors import SessionError
from rtnb.metrics._store import MetricsStore
from rtnb.storage._checkpoint import Checkpoint
from rtnb.storage._checkpoints import CheckpointStore
from rtnb.storage._result import read_run_metrics

if TYPE_CHECKING:
    from rtnb.driver.cells import CellHandle
    from rtnb.driver.session._session import Session

__all__ = ["RunAccess", "open_run"]


class RunAccess:
    """Run ``run`` of ``storage``, seen from a kernel whose session is ``session``."""

    def __init__(self, storage: str, run: str, session: Session | None) -> None:
        self.storage = storage
        self.run = run
        # Load and Resume act on the session's group, which reads checkpoints from the
        # session's storage only.
        self._session = (
            session if session is not None and session.config.storage_path == storage else None
        )

    @property
    def can_act(self) -> bool:
        """Its checkpoints can be loaded into, and resumed on, this kernel's group."""
        return self._session is not None

    @property
    def own(self) -> bool:
        """It is the session's own run (whose metrics the kernel holds, newest first)."""
        return self._session is not None and self._session.run_name == self.run

    def _other(self) -> str | None:
        """How the session names this run: None for its own."""
        return None if self.own else self.run

    def metrics(self) -> MetricsStore:
        """Its metrics: the session's own store for its run, else read from the record."""
        if self.own:
            assert self._session is not None
            return self._session.metrics
        return MetricsStore.from_rows(read_run_metrics(self.storage, self.run))

    def checkpoints(self) -> CheckpointStore:
        if self._session is not None:
            return self._session.checkpoint_store(self._other())
        return CheckpointStore.of_run(self.storage, self.run)

    def latest_checkpoint_id(self) -> str | None:
        """What a recovery of the session's own run restarts from; None for any other."""
        return self._session.latest_checkpoint_id() if self.own and self._session else None

    def load(self, checkpoint_id: str) -> Checkpoint:
        """Make ``rtnb.get_checkpoint()`` return it on every rank of the session."""
        return self._acting().load(checkpoint_id, run=self._other())

    def resume(self, checkpoint_id: str) -> CellHandle | None:
        """The session's last training cell again from it, in the background (None:
        no training cell ran yet; the next one starts from it)."""
        return self._acting().resume(checkpoint_id, run=self._other(), background=True)

    def export(self, path: str, force: bool = False) -> ExportedScript:
        """Write its training as a Ray Train script at ``path`` (see ``_export``)."""
        return export_run(self.storage, self.run, path, force, self._session if self.own else None)

    def _acting(self) -> Session:
        if self._session is None:
            raise SessionError(
                f"run {self.run!r} is in {redact_uri(self.storage)}, not in this session's "
                "storage: start a session with --storage there to load or resume it"
            )
        return self._session


def open_run(storage: str, run: str, session: Session | None) -> RunAccess:
    """Run ``run`` of ``storage`` as seen from a kernel whose session is ``session``."""
    return RunAccess(storage, run, session)
