"""What features see of a running cell: one hook interface and its manager.

A feature that follows a cell (keeping its updates, breakpoints, the hang doctor, profiles, the uploads'
notes, a re-run cell's note, where a restarted cell went on from) is a :class:`CellObserver` in a module of its own, made for each
cell by a factory listed in :data:`FEATURES`. The handle calls its :class:`CellObservers` at five points and
knows nothing of the features; adding one is a module and a line in
:data:`FEATURES`. An observer sees the cell through :class:`CellView`, never the
handle's own fields, and an observer that raises is noted once and then left out:
a feature never ends a cell, save an essential one (keeping the updates).

The hooks, in a cell's order:

- ``update(cell, update)``: a rank's :class:`~rtnb.core._messages.RankUpdate`, once
  the handle applied its steps and state, before its output reaches the cell's
  viewers (what is kept of it is in the stores when they see it);
- ``tick(cell)``: each turn of the driving loop (about every 0.1 s) while the cell
  runs and no stop is under way;
- ``stop_ran_out(cell, last)``: a stop's grace ran out before the ranks stopped;
  ``last`` is each rank's latest update;
- ``restart(cell)``: the cell runs again on a rebuilt group;
- ``end(cell)``: the cell ends, before its output is flushed (what an observer notes
  then is still the cell's).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from rtnb.core._messages import RankUpdate
from rtnb.errors import one_line

if TYPE_CHECKING:
    from rtnb.core._stacks import GroupStacks
    from rtnb.metrics._store import MetricsStore
    from rtnb.storage._checkpoints import CheckpointStore
    from rtnb.storage._logs import RankLogs

__all__ = ["FEATURES", "CellObserver", "CellObservers", "CellView", "ObserverContext"]


class CellView(Protocol):
    """What an observer may read of a cell, and its ways to speak (``note``, ``show``)
    and to stop it (``storage_failed``)."""

    name: str
    replay: bool
    background: bool
    ranks: list[int]
    # The checkpoint each rank said it loaded, in this run of the cell on its group.
    loaded: dict[int, str | None]

    @property
    def stopping(self) -> bool: ...

    def done(self) -> bool: ...

    def unfinished(self) -> list[int]: ...

    def note(self, text: str) -> None: ...

    def show(self, rank: int, text: str) -> None:
        """``text`` as rank ``rank``'s own output (a debugger's lines)."""
        ...

    def storage_failed(self, what: str) -> None:
        """A write to the run's storage failed: the cell stops at one step and ends
        with ``what``."""
        ...


class ObserverContext(Protocol):
    """What observers need of the session's flows (the cell's context has it)."""

    metrics: MetricsStore
    checkpoints: CheckpointStore

    @property
    def logs(self) -> RankLogs | None: ...

    @property
    def hang_after_s(self) -> float: ...

    def stacks(
        self, ranks: list[int] | None = None, stalled_s: float | None = None
    ) -> GroupStacks: ...

    def profile_taken(self, handle: Any, profiles: dict[int, Any]) -> None: ...

    def attach_debugger(
        self, rank: int, show: Callable[[str], None], note: Callable[[str], None]
    ) -> bool: ...


class CellObserver:
    """Every hook does nothing unless a feature says otherwise. An ``essential``
    observer's error ends the cell (what it does the cell cannot go on without);
    any other's is noted once and the observer left out."""

    essential = False

    def update(self, cell: CellView, update: RankUpdate) -> None:
        """A rank's update, applied."""

    def tick(self, cell: CellView) -> None:
        """A turn of the driving loop."""

    def stop_ran_out(self, cell: CellView, last: dict[int, RankUpdate]) -> None:
        """A stop's grace ran out."""

    def restart(self, cell: CellView) -> None:
        """The cell runs again on a rebuilt group."""

    def end(self, cell: CellView) -> None:
        """The cell ends."""


_HOOKS = ("update", "tick", "stop_ran_out", "restart", "end")

Factory = Callable[[CellView, ObserverContext], "CellObserver | None"]

# The features that watch every cell: "module:factory", each factory called with
# the cell and its context and returning its observer (None: not for this cell).
FEATURES: tuple[str, ...] = (
    "rtnb.driver.cells._keeping:observe",
    "rtnb.driver.cells._watch_breakpoints:observe",
    "rtnb.driver.cells._watch_hang:observe",
    "rtnb.driver.cells._watch_profiles:observe",
    "rtnb.driver.cells._watch_uploads:observe",
    "rtnb.driver.cells._watch_rerun:observe",
    "rtnb.driver.cells._watch_restart:observe",
)


def _factories() -> list[Factory]:
    found = []
    for entry in FEATURES:
        module, _, name = entry.partition(":")
        found.append(getattr(importlib.import_module(module), name))
    return found


class CellObservers:
    """One cell's observers, each hook called on each in order."""

    def __init__(self, cell: CellView, context: ObserverContext) -> None:
        self._cell = cell
        made = (factory(cell, context) for factory in _factories())
        self.items: list[CellObserver] = [observer for observer in made if observer is not None]
        self._hooked: dict[str, list[CellObserver]] = {}
        self._index()

    def _index(self) -> None:
        # Per hook, the observers that do something in it: a rank's update reaches
        # only those (every rank's every update goes through here).
        self._hooked = {
            hook: [
                o for o in self.items if getattr(type(o), hook) is not getattr(CellObserver, hook)
            ]
            for hook in _HOOKS
        }

    def find(self, kind: type) -> Any:
        """The observer of ``kind`` (what a view reads of a feature), or None."""
        return next((o for o in self.items if isinstance(o, kind)), None)

    def updates(self, updates: list[RankUpdate]) -> None:
        """The updates one turn of the driving loop took, in order, to each observer
        (at 32 ranks a fanned-out cell brings every rank's at once: one dispatch per
        observer, not one per rank and observer)."""
        cell = self._cell
        for observer in self._hooked["update"]:
            take = observer.update
            try:
                for update in updates:
                    take(cell, update)
            except Exception as exc:  # noqa: BLE001 - a feature never ends a cell
                self._failed(observer, exc)

    def tick(self) -> None:
        self._each("tick")

    def stop_ran_out(self, last: dict[int, RankUpdate]) -> None:
        self._each("stop_ran_out", last)

    def restart(self) -> None:
        self._each("restart")

    def end(self) -> None:
        self._each("end")

    def _each(self, hook: str, *args: Any) -> None:
        for observer in self._hooked[hook]:
            try:
                getattr(observer, hook)(self._cell, *args)
            except Exception as exc:  # noqa: BLE001 - a feature never ends a cell
                self._failed(observer, exc)

    def _failed(self, observer: CellObserver, exc: Exception) -> None:
        """An essential observer's error ends the cell; any other observer leaves it."""
        if observer.essential:
            raise exc
        self.items.remove(observer)
        self._index()
        self._cell.note(
            f"[rtnb] {type(observer).__name__} left {self._cell.name} after an "
            f"error: {one_line(exc)}\n"
        )
