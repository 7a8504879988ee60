"""A cell's outcome and its waiters (driver/cells/_outcome)."""

from __future__ import annotations

import threading
import time
import types

import pytest

from rtnb.driver.lifecycle._states import GroupState


@pytest.mark.parametrize("ray_lost", [None, "the warm Ray is gone: the ranks went with it"])
def test_a_wait_on_a_cell_whose_group_went_away_ends_in_one_line_saying_why(ray_lost):
    """A cell thread held in a call to a dying Ray never ends by itself: its waiter
    ends anyway, with the Ray's line as the cell's own ClusterError when the Ray
    went (at once: a second), else that the group is gone (after the stop grace)."""
    from rtnb.driver.cells._outcome import Completion
    from rtnb.errors import ClusterError, SessionError

    group = types.SimpleNamespace(state=GroupState.RUNNING, stop_grace_s=2.0, ray_lost=None)

    def ray_goes() -> None:
        group.state, group.ray_lost = GroupState.FAILED, ray_lost

    end = Completion()
    threading.Timer(0.3, ray_goes).start()
    started = time.monotonic()
    expected = ClusterError if ray_lost else SessionError
    with pytest.raises(expected) as raised:
        end.wait(60, "cell [4]", group)
    waited = time.monotonic() - started
    if ray_lost:
        assert str(raised.value) == f"cell [4] ended: {ray_lost}" and waited < 2.5
    else:
        assert "cell [4] lost its worker group (the group is failed)" in str(raised.value)
        assert waited >= 3.3
