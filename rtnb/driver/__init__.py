"""The notebook's side: Session (a facade over the lifecycle state machine), the
worker group, cell streaming and the stop protocol, recovery and replay, checkpoint
commits, status, and the connection to Ray.
"""

from rtnb.core._startup import defer_unused_imports as _defer_unused_imports

# Before any driver module imports Ray (see rtnb.core._startup for the 2.5 s).
_defer_unused_imports()
