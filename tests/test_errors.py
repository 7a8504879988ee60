"""rtnb's errors across actors and the values ranks return (errors, core/_values)."""

from __future__ import annotations

import pickle

from rtnb.core._values import PerRank, RemoteRepr, from_portable
from rtnb.errors import CellError, CellInterrupted


def test_errors_keep_their_fields_across_pickling():
    err = CellError.from_failures(
        {1: ("ValueError: bad", "Traceback...\nValueError: bad\n"), 0: ("ValueError: bad", "tb0")}
    )
    back = pickle.loads(pickle.dumps(err))
    assert back.ranks == [0, 1] and back.exc_type == "ValueError" and back.failures[0] == "tb0"
    assert "ranks 0, 1" in str(back)
    stop = pickle.loads(pickle.dumps(CellInterrupted("x", kept=False, step=7)))
    assert (stop.kept, stop.step) == (False, 7)


def test_perrank_values_fall_back_to_repr_when_unpicklable():
    assert from_portable((pickle.dumps([1, 2]), "[1, 2]")) == [1, 2]
    fallback = from_portable((None, "<lock>"))
    assert isinstance(fallback, RemoteRepr) and repr(fallback) == "<lock>"
    assert repr(PerRank({1: "b", 0: "a"})) == "[rank 0] 'a'\n[rank 1] 'b'"
