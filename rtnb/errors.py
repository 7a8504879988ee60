"""Every error rtnb raises on purpose.

All of them derive from :class:`RtnbError`, so ``except rtnb.RtnbError`` catches
what the kit means to tell the user and nothing else::

    RtnbError
    ├── ConfigError              bad option or argument (flag value, --ranks, address)
    ├── ClusterError             Ray could not be reached or cannot fit the group
    ├── SessionError             wrong lifecycle step (no group started, started twice)
    │   └── WaitTimeout          a wait ran out of time (also a TimeoutError)
    ├── CellError                a cell failed on one or more ranks (remote traceback kept)
    ├── CellInterrupted          the user interrupted a cell; says what was kept or lost
    │   └── StorageError         a storage write failed: the cell stopped at one step
    ├── WorkerGroupError         a rank died or the group had to be rebuilt
    └── CheckpointError          a checkpoint is unknown, incomplete or untrusted

Errors that cross a Ray actor boundary keep their fields (``__reduce__``), and
each renders as a short message in IPython (``_render_traceback_``) instead of a
traceback through rtnb's internals.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = [
    "CellError",
    "CellInterrupted",
    "CheckpointError",
    "ClusterError",
    "ConfigError",
    "RtnbError",
    "SessionError",
    "StorageError",
    "WaitTimeout",
    "WorkerGroupError",
    "one_line",
]


class RtnbError(Exception):
    """Root of rtnb's errors; its message is written for the notebook user."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):
        return (self.__class__, (self.message,))

    def __str__(self) -> str:
        return self.message

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing our internal stack.
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self.message}"]


class ConfigError(RtnbError):
    """An option or argument has a value rtnb cannot use."""


class ClusterError(RtnbError):
    """Ray is unreachable or cannot place the requested worker group."""


class SessionError(RtnbError):
    """The worker group is not in a state that allows this call."""


class WaitTimeout(SessionError, TimeoutError):
    """Waiting for a cell ran past its timeout; the cell goes on."""


class WorkerGroupError(RtnbError):
    """A rank died, or the group had to be rebuilt and its namespaces were lost."""


class CheckpointError(RtnbError):
    """A checkpoint is unknown, incomplete, or fails its integrity check."""


class CellInterrupted(RtnbError):
    """A cell was stopped because the user interrupted it.

    ``kept`` is True when every rank stopped cleanly and the namespaces are intact;
    ``step`` is the report step the ranks stopped at, when they stopped at one.
    """

    def __init__(self, message: str, kept: bool = True, step: int | None = None) -> None:
        super().__init__(message)
        self.kept = kept
        self.step = step

    def __reduce__(self):
        return (self.__class__, (self.message, self.kept, self.step))


class StorageError(CellInterrupted):
    """A write to the run's storage failed (a full disk, a read-only folder, an
    object-store error) during a cell: every rank was stopped at one step, as an
    interrupt stops them, and the message says what could not be written where,
    the last committed checkpoint and what to do. ``kept`` and ``step`` as for
    :class:`CellInterrupted`."""


class CellError(RtnbError):
    """A cell raised on one or more ranks.

    ``failures`` maps each failed rank to its remote traceback (user code only);
    ``exc_type`` is the exception's class name on the first failed rank.
    """

    def __init__(
        self,
        message: str,
        failures: Mapping[int, str] | None = None,
        exc_type: str = "",
        hint: str = "",
        aftermath: str = "",
    ) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
        self.exc_type = exc_type
        # What to do, when the notebook side can tell (a NameError for one of its own
        # variables: push it); shown under the message.
        self.hint = hint
        # What the failure cost the worker group, when more than the cell (the other
        # ranks could not be stopped and the group was rebuilt): the last line shown.
        self.aftermath = aftermath

    def __reduce__(self):
        return (
            self.__class__,
            (self.message, self.failures, self.exc_type, self.hint, self.aftermath),
        )

    @property
    def missing_name(self) -> str | None:
        """The name a ``NameError`` on the ranks says is not defined, else None."""
        match = re.search(
            r"NameError: name '([A-Za-z_][A-Za-z0-9_]*)' is not defined", self.message
        )
        return match.group(1) if match else None

    @property
    def ranks(self) -> list[int]:
        return sorted(self.failures)

    @classmethod
    def from_failures(cls, failures: Mapping[int, tuple[str, str]]) -> CellError:
        """Build from ``{rank: (exc_summary, traceback_text)}``."""
        ranks = sorted(failures)
        first = failures[ranks[0]][0]
        summary = f"cell failed on rank{'s' if len(ranks) > 1 else ''} {_join(ranks)}: {first}"
        return cls(
            summary,
            {r: failures[r][1] for r in ranks},
            first.split(":", 1)[0],
        )

    def _render_traceback_(self) -> list[str]:
        # As Python and IPython show an error: the frames first (each failed rank's,
        # in the cell's code), then what failed, then what it cost the group.
        lines: list[str] = []
        # Ranks usually fail identically: print each distinct traceback once.
        seen: dict[str, list[int]] = {}
        for rank in self.ranks:
            seen.setdefault(self.failures[rank], []).append(rank)
        for text, ranks in seen.items():
            lines.append(f"--- rank{'s' if len(ranks) > 1 else ''} {_join(ranks)} ---")
            lines.extend(text.rstrip("\n").splitlines())
            lines.append("")
        lines.append(f"\x1b[0;31mCellError\x1b[0m: {self.message}")
        if self.hint:
            lines.append(self.hint)
        if self.aftermath:
            lines.append(self.aftermath)
        return lines


def one_line(exc: BaseException, limit: int = 300) -> str:
    """Any exception (ours, a library's, a rank's) as one line for a message of ours.

    A Ray task error carries the remote exception as ``cause``; its own text is a
    whole remote traceback, so the cause is what gets described.
    """
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        return one_line(cause, limit)
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return text[0][:limit] if text else type(exc).__name__


def _join(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
