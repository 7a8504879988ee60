"""The public Session and its parts: live views, run records, status, tracking, and one run as the views see it."""

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face

_FACE = {
    "GroupStatus": "rtnb.driver.session._status",
    "open_run": "rtnb.driver.session._run_access",
    "RunAccess": "rtnb.driver.session._run_access",
    "Session": "rtnb.driver.session._session",
    "started_sessions": "rtnb.driver.session._session",
}
__all__ = ["GroupStatus", "open_run", "RunAccess", "Session", "started_sessions"]
__getattr__ = lazy_face(globals(), _FACE)

if TYPE_CHECKING:  # what type checkers see
    from rtnb.driver.session._run_access import RunAccess, open_run
    from rtnb.driver.session._session import Session, started_sessions
    from rtnb.driver.session._status import GroupStatus
