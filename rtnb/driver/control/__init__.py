"""The controller, the one owner of the group, its size and its cells, and the journal's replay."""

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face

_FACE = {
    "Controller": "rtnb.driver.control._controller",
}
__all__ = ["Controller"]
__getattr__ = lazy_face(globals(), _FACE)

if TYPE_CHECKING:  # what type checkers see
    from rtnb.driver.control._controller import Controller
