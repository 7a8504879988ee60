"""The notebook's side: Session, the public face of one Controller (the state
machine that owns the group, its size and its cells), the worker group and a cell's
Execution on it, the stop protocol, failure and scaling policies, replay, checkpoint
commits, status, sweeps, and the connection to Ray.
"""

from rtnb.core._startup import defer_unused_imports as _defer_unused_imports

# Before any driver module imports Ray (see rtnb.core._startup for the 2.5 s).
_defer_unused_imports()
