"""The kernel's one session, held for both magics classes (%rtnb and %%rtrain)."""

from __future__ import annotations

from IPython.core.error import UsageError
from rtnb.widgets import NotebookOutput

from rtnb.driver import Session, Sweep

__all__ = ["NotebookSlot"]


class NotebookSlot:
    """What the kernel holds between cells: its session (one at a time), the output
    adapter that decides live widget or lasting output, and the latest view and
    sweep (for inspection, and for the tests)."""

    def __init__(self) -> None:
        self.session: Session | None = None
        self.output = NotebookOutput()
        self.last_view = None
        self.last_sweep: Sweep | None = None

    def require(self) -> Session:
        if self.session is None:
            raise UsageError("no worker group yet: run `%rtnb start` first")
        return self.session

    def let_go_of_a_lost_detached(self) -> None:
        """A detached group taken over by another kernel (or freed) leaves this
        kernel's slot free for a start or an attach."""
        session = self.session
        if session is not None and session.detached and not session.started:
            session.release()
            self.session = None
