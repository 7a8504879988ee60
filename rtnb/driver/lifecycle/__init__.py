"""The vocabulary of a group's life: its states and their transitions, the failure and scaling policies with what they decide, and the calls a notebook makes on a session."""

from typing import TYPE_CHECKING

from rtnb.core._faces import lazy_face

_FACE = {
    "CellOptions": "rtnb.driver.lifecycle._calls",
    "NotebookSession": "rtnb.driver.lifecycle._calls",
    "ACTIVE": "rtnb.driver.lifecycle._states",
    "BUSY": "rtnb.driver.lifecycle._states",
    "Decision": "rtnb.driver.lifecycle._policies",
    "DURING_REBUILD": "rtnb.driver.lifecycle._policies",
    "Failure": "rtnb.driver.lifecycle._policies",
    "FailurePolicy": "rtnb.driver.lifecycle._policies",
    "GroupState": "rtnb.driver.lifecycle._states",
    "Raise": "rtnb.driver.lifecycle._policies",
    "RankDied": "rtnb.driver.lifecycle._policies",
    "RecoveryOutcome": "rtnb.driver.lifecycle._policies",
    "ReplayReport": "rtnb.driver.lifecycle._policies",
    "Retry": "rtnb.driver.lifecycle._policies",
    "ScalingPolicy": "rtnb.driver.lifecycle._policies",
    "Shrink": "rtnb.driver.lifecycle._policies",
    "StateChange": "rtnb.driver.lifecycle._states",
    "StateMachine": "rtnb.driver.lifecycle._states",
}
__all__ = [
    "CellOptions",
    "NotebookSession",
    "ACTIVE",
    "BUSY",
    "Decision",
    "DURING_REBUILD",
    "Failure",
    "FailurePolicy",
    "GroupState",
    "Raise",
    "RankDied",
    "RecoveryOutcome",
    "ReplayReport",
    "Retry",
    "ScalingPolicy",
    "Shrink",
    "StateChange",
    "StateMachine",
]
__getattr__ = lazy_face(globals(), _FACE)

if TYPE_CHECKING:  # what type checkers see
    from rtnb.driver.lifecycle._calls import CellOptions, NotebookSession
    from rtnb.driver.lifecycle._policies import (
        DURING_REBUILD,
        Decision,
        Failure,
        FailurePolicy,
        Raise,
        RankDied,
        RecoveryOutcome,
        ReplayReport,
        Retry,
        ScalingPolicy,
        Shrink,
    )
    from rtnb.driver.lifecycle._states import ACTIVE, BUSY, GroupState, StateChange, StateMachine
