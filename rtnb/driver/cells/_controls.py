"""One cell's live changes: ``%rtnb set``, triggers, save-now and profiles.

:class:`CellControls` keeps a cell's schedule of changes as (name, value, from_step)
and (step, trigger) — sent with the cell again when it runs again after a recovery
— what its ranks declared (``rtnb.control(name, default)``) and reported applying,
and the changes asked for from any thread. The cell's driving thread makes those
between two ticks (:meth:`CellControls.make_asked`), through its
:class:`~rtnb.driver.ranks._execution.Execution`, which holds and releases the ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rtnb.core._changes import CellChanges, change_text
from rtnb.core._messages import RankUpdate
from rtnb.core._profile import PROFILE_START
from rtnb.driver.ranks import HOLD_WAIT_S, Execution
from rtnb.errors import SessionError, WaitTimeout

__all__ = ["CellControls"]

# Writes a change ahead to the journal: (values, step, triggers).
WriteAhead = Callable[[dict[str, Any], int, tuple[str, ...]], None]


@dataclass
class _Asked:
    values: dict[str, Any]
    triggers: tuple[str, ...] = ()
    done: threading.Event = field(default_factory=threading.Event)
    step: int | None = None
    error: BaseException | None = None


class CellControls:
    """The live changes of one cell; see the module docstring.

    ``saved``: the changes this cell received when the notebook last ran (``rtnb
    run`` of the saved notebook), scheduled from the start; the ``%rtnb set`` cells
    that made them, run again, claim theirs instead of changing again."""

    def __init__(
        self,
        cell_name: Callable[[], str],
        code: str,
        replay: bool,
        controls: tuple[tuple[str, Any, int], ...] = (),
        triggers: tuple[tuple[int, str], ...] = (),
        saved: CellChanges | None = None,
    ) -> None:
        self._cell_name = cell_name
        self._code = code
        self._replay = replay
        self.schedule: list[tuple[str, Any, int]] = list(controls)
        self.triggers: list[tuple[int, str]] = list(triggers)
        self._unclaimed: list[tuple[int, dict[str, Any], list[str]]] = []
        if saved is not None:
            self.schedule += saved.controls
            self.triggers += saved.triggers
            self._unclaimed = saved.by_step()
        self.declared: dict[str, Any] = {}  # name -> default, as the ranks declared
        self.applied: dict[int, list[tuple[str, Any, int]]] = {}
        self._asked: list[_Asked] = []
        self._lock = threading.Lock()
        self._closed = False

    def saved_markers(self) -> list[tuple[int, str]]:
        """(step, text) of the saved notebook's changes, for the live plot."""
        return [(step, change_text(values, fired)) for step, values, fired in self._unclaimed]

    def took(self, update: RankUpdate) -> list[tuple[str, Any, int]]:
        """Keep what a rank's update declared and applied; the applied changes to
        record (none for a replayed cell)."""
        for name, default in (update.controls_declared or {}).items():
            self.declared.setdefault(name, default)
        if not update.controls_applied or self._replay:
            return []
        self.applied.setdefault(update.rank, []).extend(update.controls_applied)
        return update.controls_applied

    # ---- asked from any thread ---------------------------------------------------------
    def ask(
        self, values: dict[str, Any], triggers: tuple[str, ...] = (), timeout_s: float = 30.0
    ) -> int | None:
        """Apply ``values`` and fire ``triggers`` on every rank at one step (the
        driving thread makes it): that step, or None when the cell ended first."""
        asked = _Asked(dict(values), tuple(triggers))
        with self._lock:
            if self._closed:
                return None
            self._asked.append(asked)
        if not asked.done.wait(timeout_s):
            with self._lock:
                taken = asked not in self._asked
                if not taken:
                    self._asked.remove(asked)  # never made later
            if not taken or not asked.done.wait(HOLD_WAIT_S * 2):
                raise WaitTimeout(
                    f"{self._cell_name()} did not take the change within {timeout_s:g} s; "
                    "nothing was changed"
                )
        if asked.error is not None:
            raise asked.error
        return asked.step

    def claim_saved(self, values: dict[str, Any], triggers: tuple[str, ...]) -> int | None:
        """The step of the saved notebook's change equal to this one, scheduled since
        the cell began (it is not made twice), or None."""
        with self._lock:
            for i, (step, saved_values, fired) in enumerate(self._unclaimed):
                if saved_values == values and tuple(fired) == tuple(triggers):
                    del self._unclaimed[i]
                    return step
        return None

    def record(self) -> dict[str, Any] | None:
        """What a saved notebook keeps of this cell's live changes (``rtnb run``
        makes them again), or None when it had none."""
        # A profile is this session's look, not a change to the training.
        triggers = [t for t in self.triggers if not t[1].startswith(PROFILE_START)]
        if self._replay or not (self.schedule or triggers):
            return None
        return CellChanges(self._code, list(self.schedule), triggers).to_json()

    # ---- made by the driving thread ---------------------------------------------------
    def make_asked(
        self,
        execution: Execution,
        stopping: bool,
        steps: Mapping[int, int],
        write_ahead: WriteAhead,
        done: Callable[[], bool],
    ) -> list[tuple[int, str]]:
        """Make the changes asked since the last tick; (step, text) of those made."""
        with self._lock:
            asked, self._asked = self._asked, []
        made = []
        for one in asked:
            try:
                one.step = self._make(execution, one, stopping, steps, write_ahead, done)
                if one.step is not None:
                    made.append((one.step, change_text(one.values, one.triggers)))
            except Exception as exc:  # noqa: BLE001 - said to the caller, never ends the cell
                one.error = exc
            one.done.set()
        return made

    def _make(
        self,
        execution: Execution,
        asked: _Asked,
        stopping: bool,
        steps: Mapping[int, int],
        write_ahead: WriteAhead,
        done: Callable[[], bool],
    ) -> int | None:
        """Every running rank takes the change at one step no rank has begun; it is
        written ahead to the journal, so a recovery or replay of the cell applies it
        there."""
        if stopping or not execution.unfinished():
            return None
        values, triggers = asked.values, asked.triggers

        def schedule(step: int) -> None:
            write_ahead(values, step, triggers)
            self.schedule.extend((n, v, step) for n, v in values.items())
            self.triggers.extend((step, name) for name in triggers)

        step, silent = execution.change(values, triggers, steps, schedule)
        if step is None and silent and not done():
            raise SessionError(
                f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not "
                f"answer within {HOLD_WAIT_S:g} s (busy in native code?): nothing was "
                "changed; `%rtnb stacks` shows where they are"
            )
        return step

    def close(self) -> None:
        """The cell ended: changes asked too late get None."""
        with self._lock:
            self._closed = True
            unmade, self._asked = self._asked, []
        for asked in unmade:
            asked.done.set()
