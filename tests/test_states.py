"""The group's lifecycle states (driver/lifecycle/_states)."""

from __future__ import annotations

import pytest

from rtnb.driver.lifecycle._states import GroupState, StateMachine


def test_state_machine_notifies_subscribers_and_refuses_illegal_moves():
    machine = StateMachine()
    seen = []
    unsubscribe = machine.subscribe(lambda change: seen.append((change.old, change.new)))
    machine.to(GroupState.STARTING)
    machine.to(GroupState.READY)
    with pytest.raises(RuntimeError, match="illegal"):
        machine.to(GroupState.STARTING)
    unsubscribe()
    machine.to(GroupState.RUNNING)
    assert seen == [(GroupState.NEW, GroupState.STARTING), (GroupState.STARTING, GroupState.READY)]
