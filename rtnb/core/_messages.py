"""The typed messages between a rank and the driver (see docs/architecture.md).

The driver starts a cell with one :class:`CellRequest` (the same on every rank; a
relaying rank 0 forwards it as it is). A rank answers every long-poll with one :class:`RankUpdate`: what it printed,
reported and checkpointed since the last poll, where its cell stands, and, once
the cell ended, its value or error. Reports travel as one
:class:`~rtnb.core._reports.ReportBatch` of columns per poll: at 10 kHz per rank
anything per report would cost more than the report itself.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from rtnb.core._folder import FolderChanges
from rtnb.core._reports import ReportBatch

__all__ = [
    "RankPlace",
    "CellRequest",
    "CellState",
    "CheckpointOffer",
    "Portable",
    "RankUpdate",
    "StopPhase",
    "from_wire",
    "to_wire",
]

# A value sent back from a rank: (pickled bytes or None when unpicklable, repr).
Portable = tuple[bytes | None, str]


class CellState(str, enum.Enum):
    """Where a rank's cell stands."""

    IDLE = "idle"
    RUNNING = "running"
    DONE = "done"
    ERROR = "error"
    INTERRUPTED = "interrupted"

    def __str__(self) -> str:
        return self.value

    @property
    def ended(self) -> bool:
        return self not in (CellState.IDLE, CellState.RUNNING)


class StopPhase(str, enum.Enum):
    """The driver's stop protocol for one cell (the stop contract of the team design document)."""

    NONE = ""
    REQUESTED = "requested"  # asked for; the ranks are told at the next tick
    COOPERATIVE = "cooperative"  # ranks pause at report() and leave at a common step
    RAISE = "raise"  # CellStopped is raised inside each rank's cell thread
    RESTART = "restart"  # the group is rebuilt (ranks stuck in native code)

    def __str__(self) -> str:
        return self.value


# The trigger ``%rtnb save-now`` fires on every rank; ``rtnb.on_save(fn)`` handles it.
SAVE_TRIGGER = "__save__"


@dataclass(frozen=True)
class RankPlace:
    """Where a rank's process runs, as it says itself (``describe()``)."""

    pid: int
    hostname: str
    node_ip: str
    node_id: str
    gpu_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class CellRequest:
    """A cell to start on a rank.

    ``checkpoint`` is what ``get_checkpoint()`` returns during it; a ``replay``
    rebuilds state after a failure (its reports are not published, its checkpoints
    not saved: they were, the first time); a dispatch ``token`` starts it at most
    once per rank however many ways it arrives (the relay, a direct call); ``label``
    is the notebook's name for the cell (Jupyter's ``[4]``), which tracebacks use."""

    cell_id: int
    code: str
    checkpoint: Any = None
    replay: bool = False
    token: int | None = None
    label: str | None = None
    # Live controls changed during this cell, as (name, value, from_step): given
    # again when the cell runs again (a replay, a recovery), so it runs the same.
    controls: tuple[tuple[str, Any, int], ...] = ()
    # Triggers (``%rtnb trigger``, ``%rtnb save-now``) fired during it, as (step, name).
    triggers: tuple[tuple[int, str], ...] = ()
    # The notebook's files changed since the target ranks' copies (driver/_folder_sync).
    files: FolderChanges | None = None

    @property
    def filename(self) -> str:
        """The name a traceback gives the cell's code: ``In[4]`` as Jupyter's own
        tracebacks say ("Cell In[4], line 3"), else rtnb's cell number."""
        if self.label:
            return f"<rtrain In{self.label}>" if self.label.startswith("[") else f"<{self.label}>"
        return cell_filename(self.cell_id)


def cell_filename(cell_id: int) -> str:
    return f"<rtrain-cell-{cell_id}>"


@dataclass(frozen=True)
class ValidationRequest:
    """What ``report(..., validation=...)`` asked for: ``fn(checkpoint, **kwargs)``
    (cloudpickled on the rank) run as its own Ray task once the checkpoint is
    committed, its metrics kept with the checkpoint; ``timeout_s`` as Ray Train's
    ``ValidationTaskConfig``; ``remote`` are ``ray.remote`` options for the task."""

    fn: bytes
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    remote: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointOffer:
    """A rank's files for the checkpoint at ``step`` of ``line`` are in storage."""

    step: int
    time: float
    metrics: dict[str, Any]
    files: list[dict[str, Any]]
    line: int = 0
    validation: ValidationRequest | None = None


@dataclass
class RankUpdate:
    """One long-poll answer of a rank.

    ``step`` is the last step whose checkpoint files (if any) have landed and been
    offered: the driver commits a checkpoint once every rank has passed its step.
    ``loaded_checkpoint`` is the id of the checkpoint ``get_checkpoint()`` handed
    out in this cell, so messages name what the ranks really loaded. ``line`` is
    the line of training the rank's steps belong to (0, or the branch a resume
    from an earlier checkpoint started). ``storage_error``: this rank could not
    write its checkpoint files; it pauses at its next report for the common stop.
    """

    rank: int
    cell: int | None
    state: CellState
    step: int
    paused_at: int | None = None
    output: list[tuple[str, str]] = field(default_factory=list)
    reports: ReportBatch | None = None
    checkpoints: list[CheckpointOffer] = field(default_factory=list)
    value: Portable | None = None
    error: tuple[str, str] | None = None  # (one-line summary, user traceback)
    loaded_checkpoint: str | None = None
    line: int = 0
    # A checkpoint write that failed (full disk, read-only, an object-store error):
    # the rank stopped writing and asks for the cell to stop at a common step.
    storage_error: str | None = None
    # Steps whose checkpoint files are still uploading beside the loop (oldest
    # first), and the seconds report() has waited for room among them in all.
    uploading: tuple[int, ...] = ()
    upload_waited_s: float = 0.0
    # What the rank's process used since the last poll (ResourceSample, ≤ 1 a second).
    resources: list[Any] = field(default_factory=list)
    # Live controls the cell declared since the last poll (name -> default), and the
    # changes it read, as (name, value, step): the step the new value was first used.
    controls_declared: dict[str, Any] = field(default_factory=dict)
    controls_applied: list[tuple[str, Any, int]] = field(default_factory=list)
    # Where the rank stopped at a breakpoint ("cell [5] line 3"): a debugger waits
    # on it for the notebook (``debug_poll``/``debug_input``).
    debugging: str | None = None
    # This rank's profile of the armed steps (a core._profile.RankProfile), once taken.
    profile: Any = None
    # The datasets whose shard this rank waits on right now (inside its next()), and
    # for how many seconds: a split one no other rank reads never answers.
    data_waits: dict[str, float] = field(default_factory=dict)
    # The cell's exception itself, with its frames, from a rank in the kernel's own
    # process (local mode) only, for %debug; it never crosses a process.
    exception: BaseException | None = field(default=None, repr=False, compare=False)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled as its four head fields and only the others that are not empty:
        # most answers carry one or two of them, and a cell's every rank's every
        # answer is unpickled by the kernel (half the time of pickling the whole
        # object's dict, 22 fields, with its state enum called by value).
        held = self.__dict__
        extras = {name: held[name] for name, empty in _EMPTY_UPDATE.items() if held[name] != empty}
        return _rank_update, (self.rank, self.cell, self.state.value, self.step, extras)


_EMPTY_UPDATE: dict[str, Any] = {
    f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    for f in fields(RankUpdate)[4:]
}


class _NoItems(list):  # type: ignore[type-arg]
    """An empty list that stays empty (it equals ``[]``): what an unpickled update's
    empty list fields share."""

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("an update received from a rank is read-only")

    append = extend = insert = remove = pop = clear = sort = reverse = _read_only  # type: ignore[assignment]
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only  # type: ignore[assignment]


class _NoEntries(dict):  # type: ignore[type-arg]
    """An empty dict that stays empty (it equals ``{}``), as :class:`_NoItems`."""

    _read_only = _NoItems._read_only
    update = setdefault = pop = popitem = clear = _read_only  # type: ignore[assignment]
    __setitem__ = __delitem__ = __ior__ = _read_only  # type: ignore[assignment]


# An unpickled update is read, never changed: its empty list and dict fields share
# one :class:`_NoItems` and one :class:`_NoEntries`. A fresh list per field per rank
# per answer was most of what a 32-rank cell allocated in the kernel, and the
# garbage collections those allocations set off cost it more than reading the
# answers.
_SHARED_EMPTY = {list: _NoItems(), dict: _NoEntries()}
_UNPICKLED_EMPTY: dict[str, Any] = {
    name: _SHARED_EMPTY.get(type(empty), empty) for name, empty in _EMPTY_UPDATE.items()
}
_STATES = {state.value: state for state in CellState}


def _rank_update(
    rank: int, cell: int | None, state: str, step: int, extras: dict[str, Any]
) -> RankUpdate:
    update = object.__new__(RankUpdate)
    held = update.__dict__
    held.update(_UNPICKLED_EMPTY)
    held.update(rank=rank, cell=cell, state=_STATES[state], step=step)
    held.update(extras)
    return update


def to_wire(message: CellRequest | RankUpdate) -> bytes:
    """``message`` as it crosses Ray between the kernel and a rank: pickled by us.

    Ray passes bytes through as they are, while a dataclass argument or result goes
    through its own serializer (cloudpickle, with a Python hook per object): on the
    2-core development VM that was ~0.1 ms of a trivial cell's ~1.5 ms per rank.
    Both ends import these classes, so plain pickle is enough; a request's
    checkpoint is an rtnb class too."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def from_wire(data: Any) -> Any:
    """A message :func:`to_wire` made (anything else is passed through as it is)."""
    return pickle.loads(data) if isinstance(data, bytes) else data
