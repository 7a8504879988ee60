"""The notebook's side: Session, the public face of one Controller (the state
machine that owns the group, its size and its cells), the worker group and a cell's
Execution on it, the stop protocol, failure and scaling policies, replay, checkpoint
commits, status, sweeps, and the connection to Ray.

Its face (what the magics may use) loads each name on first use: importing one
driver module (the server extension's ``_warm``) loads no session, sweep or Tune.
"""

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face
from rtnb.core._startup import defer_unused_imports as _defer_unused_imports

# Before any driver module imports Ray (see rtnb.core._startup for the 2.5 s).
_defer_unused_imports()

_FACE = {
    "RunAccess": "rtnb.driver.session._run_access",
    "Session": "rtnb.driver.session._session",
    "Sweep": "rtnb.driver.tuning._sweep",
    "attach": "rtnb.driver.detached._client",
    "open_run": "rtnb.driver.session._run_access",
    "stop_warm_ray": "rtnb.driver.cluster._warm_commands",
    "sweep": "rtnb.driver.tuning._runner",
    "warm_ray_status": "rtnb.driver.cluster._warm_commands",
}
__all__ = [
    "RunAccess",
    "Session",
    "Sweep",
    "attach",
    "open_run",
    "stop_warm_ray",
    "sweep",
    "warm_ray_status",
]
__getattr__ = lazy_face(globals(), _FACE)

if TYPE_CHECKING:  # what type checkers see
    from rtnb.driver.cluster._warm_commands import stop_warm_ray, warm_ray_status
    from rtnb.driver.detached._client import attach
    from rtnb.driver.session._run_access import RunAccess, open_run
    from rtnb.driver.session._session import Session
    from rtnb.driver.tuning._runner import sweep
    from rtnb.driver.tuning._sweep import Sweep
