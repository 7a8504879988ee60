"""One cell's way through the ranks: the flow that journals and starts it, the handle that drives it, its outcome, its live changes, checkpoint commits and resume."""

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face

_FACE = {
    "CellFlow": "rtnb.driver.cells._flow",
    "CellHandle": "rtnb.driver.cells._handle",
    "check_syntax": "rtnb.driver.cells._flow",
    "CheckpointCoordinator": "rtnb.driver.cells._commits",
    "ResumeFlow": "rtnb.driver.cells._resume",
    "ResumePlan": "rtnb.driver.cells._resume",
}
__all__ = [
    "CellFlow",
    "CellHandle",
    "check_syntax",
    "CheckpointCoordinator",
    "ResumeFlow",
    "ResumePlan",
]
__getattr__ = lazy_face(globals(), _FACE)

if TYPE_CHECKING:  # what type checkers see
    from rtnb.driver.cells._commits import CheckpointCoordinator
    from rtnb.driver.cells._flow import CellFlow, check_syntax
    from rtnb.driver.cells._handle import CellHandle
    from rtnb.driver.cells._resume import ResumeFlow, ResumePlan
