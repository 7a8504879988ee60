"""Groups that outlive their kernel: the host process and the notebook's client."""

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face

_FACE = {
    "attach": "rtnb.driver.detached._client",
    "detached_groups": "rtnb.driver.detached._client",
    "DetachedGroup": "rtnb.driver.detached._host",
    "DetachedSession": "rtnb.driver.detached._client",
    "start_detached": "rtnb.driver.detached._client",
    "stop_detached": "rtnb.driver.detached._client",
}
__all__ = [
    "attach",
    "detached_groups",
    "DetachedGroup",
    "DetachedSession",
    "start_detached",
    "stop_detached",
]
__getattr__ = lazy_face(globals(), _FACE)

if TYPE_CHECKING:  # what type checkers see
    from rtnb.driver.detached._client import (
        DetachedSession,
        attach,
        detached_groups,
        start_detached,
        stop_detached,
    )
    from rtnb.driver.detached._host import DetachedGroup
