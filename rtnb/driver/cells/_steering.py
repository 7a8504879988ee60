"""What the notebook asks of the running cell, or arms for the next one: live
controls (``%rtnb set``), triggers and save-now (``%rtnb fire``), a profile
(``%rtnb profile``), the debugger (``%rtnb debug``).

:class:`Steering` is a part of the cell flow: a change inside a running cell goes
through that cell's ``CellControls`` (held at one common step on every rank); one
made between cells is journaled (by the flow) and sent to every rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rtnb.core._messages import SAVE_TRIGGER
from rtnb.core._profile import ProfileReport, profile_trigger
from rtnb.driver.cells._rank_values import RankValues
from rtnb.driver.ranks import RankGroup
from rtnb.driver.tools import attach, merge_profile, post_mortem
from rtnb.errors import ConfigError, SessionError, one_line
from rtnb.storage._journal import EntryKind
from rtnb.storage._rundir import RunDirectory

if TYPE_CHECKING:
    from rtnb.driver.cells._handle import CellHandle

__all__ = ["Steering"]


class Steering:
    """Live controls, triggers, profiles and the debugger; see the module docstring.
    ``active`` is the running cell, if any; ``write`` journals an entry (the flow's);
    ``lock`` is the flow's, held while a change between cells is journaled and sent."""

    def __init__(
        self,
        require_group: Callable[[], RankGroup],
        active: Callable[[], CellHandle | None],
        values: RankValues,
        write: Callable[..., Any],
        lock: threading.RLock,
        run_dir: Callable[[], RunDirectory],
    ) -> None:
        self._require_group = require_group
        self._active = active
        self._values = values
        self._write = write
        self._lock = lock
        self._run_dir = run_dir
        # %rtnb profile: steps armed for the next cell, and the last profile taken.
        self._armed_profile: int | None = None
        self.last_profile: ProfileReport | None = None

    def _running(self) -> CellHandle | None:
        active = self._active()
        return active if active is not None and not active.done() else None

    def set_controls(self, values: dict[str, Any]) -> int | None:
        """Change live controls (``rtnb.control``): in the running cell at one step
        on every rank (that step), else from the next cell on (None)."""
        checked = _check_controls(values)
        active = self._running()
        if active is not None:
            step = active.controls.claim_saved(checked, ())
            if step is None:
                step = active.controls.ask(checked)
            if step is not None:
                return step
            if not active.done():
                raise SessionError(
                    f"{active.name} is stopping: the change was not made; set it again "
                    "for the next cell once it has ended"
                )
        with self._lock:
            self._write(EntryKind.CONTROL, controls=checked)
            self._values.send_controls(checked)
        return None

    def fire(self, name: str) -> int:
        """Fire trigger ``name`` (``SAVE_TRIGGER``: save now) on every rank of the
        running cell at one step; that step."""
        if not (isinstance(name, str) and (name.isidentifier() or name == SAVE_TRIGGER)):
            raise ConfigError(f"a trigger's name is a Python identifier, got {name!r}")
        active = self._running()
        what = "save-now" if name == SAVE_TRIGGER else f"trigger {name!r}"
        if active is None:
            raise SessionError(
                f"{what} acts inside a running cell and none is running: run the training "
                "cell with --background, then fire it from another cell"
            )
        step = active.controls.claim_saved({}, (name,))
        if step is None:
            step = active.controls.ask({}, (name,))
        if step is None:
            raise SessionError(f"{what}: the cell ended (or is stopping) before it could fire")
        return step

    # ---- profiles ----------------------------------------------------------------------
    def profile(self, steps: int) -> int | None:
        """Profile ``steps`` steps on every rank: of the running cell from a common
        step (that step), else of the next cell from its first report (None)."""
        if not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"--steps must be a whole number ≥ 1, got {steps!r}")
        active = self._running()
        if active is not None:
            step = active.controls.ask({}, (profile_trigger(steps),))
            if step is not None:
                return step + 1
        self._armed_profile = steps
        return None

    def take_armed(self) -> tuple[tuple[int, str], ...]:
        """The next cell's triggers for a profile armed for it (then disarmed)."""
        armed, self._armed_profile = self._armed_profile, None
        return ((-1, profile_trigger(armed)),) if armed else ()

    def profile_taken(self, handle: CellHandle, profiles: dict[int, Any]) -> None:
        try:
            report = merge_profile(self._run_dir(), profiles)
        except Exception as exc:  # noqa: BLE001 - the cell goes on; the line says why
            handle.note(f"[rtnb] the profile could not be merged: {one_line(exc)}\n")
            return
        self.last_profile = report
        handle.note(f"[rtnb] {report.summary()}\n")

    # ---- the debugger ------------------------------------------------------------------
    def debug(
        self,
        rank: int | None,
        ask: Callable[[str], str],
        show: Callable[[str], None],
    ) -> None:
        """``%rtnb debug [RANK]``: attach to a rank the running (background) cell left
        at a breakpoint, else open a post-mortem of the last failed cell on ``rank``
        (the first rank it failed on when None)."""
        group = self._require_group()
        active = self._active()
        if active is not None and active.debugging:
            chosen = rank if rank is not None else active.debugging[0]
            if chosen not in active.debugging:
                raise SessionError(
                    f"rank {chosen} is not at a breakpoint; ranks at one: "
                    + ", ".join(map(str, active.debugging))
                )
            attach(group, chosen, ask, show, show)
            return
        if active is not None:
            raise SessionError(
                f"{active.name} is running and no rank is at a breakpoint: put breakpoint() "
                "(or rtnb.breakpoint(rank=N)) in the cell, or debug after it fails"
            )
        post_mortem(group, rank, ask, show)


def _check_controls(values: dict[str, Any]) -> dict[str, Any]:
    """Names are identifiers and values JSON scalars (the journal keeps them)."""
    if not isinstance(values, dict) or not values:
        raise ConfigError("give controls as NAME=VALUE, e.g. `%rtnb set lr=3e-4`")
    for name, value in values.items():
        if not (isinstance(name, str) and name.isidentifier()):
            raise ConfigError(f"a control's name is a Python identifier, got {name!r}")
        if not isinstance(value, (int, float, str, bool)) and value is not None:
            raise ConfigError(
                f"control {name!r} takes a number, a string, a bool or None, got "
                f"{type(value).__name__} (push other values with `%rtnb push`)"
            )
    return dict(values)
