"""What a start is doing, as it goes, and where its seconds went.

``%rtnb start`` can take from one second (a cluster already up) to tens of seconds
(an embedded Ray on a cold machine); the user sees each phase as it begins and,
at the end, one line with the cost of each (also kept as ``Session.last_start``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = ["StartProgress", "StartReport"]


@dataclass
class StartReport:
    """Seconds per phase of the last start, in the order they ran."""

    phases: list[tuple[str, float]] = field(default_factory=list)
    # Lines the user should read once the group runs (what was left out of the files).
    notes: list[str] = field(default_factory=list)
    # How a machine that is not a node of the cluster joined it.
    joined: str | None = None

    @property
    def total_s(self) -> float:
        return sum(seconds for _, seconds in self.phases)

    def seconds(self, phase: str) -> float:
        return sum(s for name, s in self.phases if name == phase)

    def __str__(self) -> str:
        parts = " · ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)
        line = f"ready in {self.total_s:.1f} s ({parts})"
        return f"{line}, joined {self.joined}" if self.joined else line


class StartProgress:
    """Calls ``notify`` with a short line as each phase begins."""

    def __init__(self, notify: Callable[[str], None] | None = None) -> None:
        self._notify = notify
        self.report = StartReport()

    def say(self, text: str) -> None:
        if self._notify is not None:
            try:
                self._notify(text)
            except Exception:  # noqa: BLE001 - a display problem must not fail the start
                pass

    @contextlib.contextmanager
    def phase(self, name: str, doing: str) -> Iterator[None]:
        self.say(f"rtnb: {doing}…")
        started = time.perf_counter()
        try:
            yield
        finally:
            self.report.phases.append((name, time.perf_counter() - started))
