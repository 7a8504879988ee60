"""The detached session's surface against the session's (driver/detached)."""

from __future__ import annotations

import pytest

from rtnb.errors import ConfigError


def test_a_detached_session_refuses_what_it_cannot_be_in_one_line():
    """Checked before anything starts: no Ray is joined for a refused option."""
    import rtnb

    with pytest.raises(rtnb.ConfigError, match="local mode"):
        rtnb.Session(detached=True, workers=0)
    with pytest.raises(rtnb.ConfigError, match="--idle-timeout must be positive"):
        rtnb.Session(detached=True, idle_timeout_s=0)
    with pytest.raises(rtnb.ConfigError, match="name it with --name"):
        rtnb.Session(detached=True, replay=True)
    pending = rtnb.Session(detached=True, name="later")
    assert pending.detached and not pending.started and pending.run_name == "later"
    with pytest.raises(rtnb.SessionError, match="not started yet"):
        pending.status()


def test_a_detached_session_and_a_session_answer_the_same_calls_with_the_same_signatures():
    """The magics call one protocol; a detached group implements each call itself
    (no forwarding by name), with the parameters the kernel's session takes, and a
    cell's keywords are the one CellOptions type."""
    import inspect
    import typing

    from rtnb.driver.detached import DetachedSession
    from rtnb.driver.lifecycle import CellOptions, NotebookSession
    from rtnb.driver.session import Session

    assert "__getattr__" not in vars(DetachedSession)
    cell_calls = {"run", "begin_cell", "run_background"}
    calls = [
        name
        for name, value in vars(NotebookSession).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    ]
    assert len(calls) > 25
    for name in calls:
        ours, theirs = (
            inspect.getattr_static(Session, name),
            inspect.getattr_static(DetachedSession, name),
        )
        if isinstance(ours, property):
            assert isinstance(theirs, property), name
            continue
        if name in cell_calls:
            continue

        def shape(function):
            return [
                (p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()
            ]

        assert shape(ours) == shape(theirs), name
    options = set(typing.get_type_hints(CellOptions))
    for name in cell_calls:
        keywords = {
            p.name
            for p in inspect.signature(getattr(Session, name)).parameters.values()
            if p.kind is p.KEYWORD_ONLY
        }
        assert keywords == options - ({"config"} if name == "begin_cell" else set()), name
        detached = inspect.signature(getattr(DetachedSession, name)).parameters["options"]
        assert detached.kind is detached.VAR_KEYWORD, name


def test_a_detached_session_before_its_start_checks_its_options_and_says_it_is_not_started():
    import rtnb
    from rtnb.errors import SessionError

    with pytest.raises(ConfigError, match="local mode"):
        rtnb.Session(detached=True, workers=0)
    session = rtnb.Session(detached=True, workers=2, name="later")
    assert session.detached and not session.started and session.run_name == "later"
    with pytest.raises(SessionError, match="not started yet: call start"):
        session.status()
    with pytest.raises(SessionError, match="debug is not available on a detached group"):
        session.debug(1)
