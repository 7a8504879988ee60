"""A session's ranks: the group interface, its Ray and local groups, the builder that places them, one cell's execution on them, stopping, folder sync and data room."""

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face

_FACE = {
    "check_datasets": "rtnb.driver.ranks._datasets",
    "command_all": "rtnb.driver.ranks._execution",
    "Connector": "rtnb.driver.ranks._builder",
    "DatasetHandOver": "rtnb.driver.ranks._datasets",
    "DatasetRecord": "rtnb.driver.ranks._datasets",
    "DataWatch": "rtnb.driver.ranks._datasets",
    "Execution": "rtnb.driver.ranks._execution",
    "GroupBuilder": "rtnb.driver.ranks._builder",
    "GroupFactory": "rtnb.driver.ranks._builder",
    "HOLD_WAIT_S": "rtnb.driver.ranks._execution",
    "new_group": "rtnb.driver.ranks._builder",
    "RankGroup": "rtnb.driver.ranks._group",
    "RankLost": "rtnb.driver.ranks._execution",
    "ray_lost_line": "rtnb.driver.ranks._builder",
    "release_everywhere": "rtnb.driver.ranks._execution",
    "split_failed": "rtnb.driver.ranks._datasets",
    "StopProtocol": "rtnb.driver.ranks._stopping",
    "WorkerGroup": "rtnb.driver.ranks._group",
}
__all__ = [
    "check_datasets",
    "command_all",
    "Connector",
    "DatasetHandOver",
    "DatasetRecord",
    "DataWatch",
    "Execution",
    "GroupBuilder",
    "GroupFactory",
    "HOLD_WAIT_S",
    "new_group",
    "RankGroup",
    "RankLost",
    "ray_lost_line",
    "release_everywhere",
    "split_failed",
    "StopProtocol",
    "WorkerGroup",
]
__getattr__ = lazy_face(globals(), _FACE)

if TYPE_CHECKING:  # what type checkers see
    from rtnb.driver.ranks._builder import (
        Connector,
        GroupBuilder,
        GroupFactory,
        new_group,
        ray_lost_line,
    )
    from rtnb.driver.ranks._datasets import (
        DatasetHandOver,
        DatasetRecord,
        DataWatch,
        check_datasets,
        split_failed,
    )
    from rtnb.driver.ranks._execution import (
        HOLD_WAIT_S,
        Execution,
        RankLost,
        command_all,
        release_everywhere,
    )
    from rtnb.driver.ranks._group import RankGroup, WorkerGroup
    from rtnb.driver.ranks._stopping import StopProtocol
