"""What happens after a rank dies: the failure, the policy's decision, the outcome.

A cell that loses a rank (or cannot be stopped in place) hands a :class:`Failure`
to the recovery flow (the controller's ``recover``), which asks the session's
:class:`FailurePolicy` to :meth:`~FailurePolicy.decide`, as Ray Train V2's
controller asks its ``FailurePolicy``:

- :class:`Retry`: rebuild the group, replay the journal up to the cell, run it again;
- :class:`Shrink`: the same on a group of fewer ranks (a policy that prefers going
  on smaller to waiting for capacity; the default never shrinks);
- :class:`Raise`: rebuild the group with fresh ranks and end the cell with the error.

The cell follows the decision's :class:`RecoveryOutcome`; it never rebuilds itself.

The controller asks a :class:`ScalingPolicy` what size an elastic group (``--workers
MIN-MAX``) takes when it is built, after a size did not place, and whether it grows
back at a cell's start, as Ray Train V2's controller asks its ``ScalingPolicy``.
These records, with the words a cell shows for its outcome (so the cell never words
a recovery), are shared by the cell and recovery modules, which never import each
other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rtnb.core._config import SessionConfig
from rtnb.errors import WorkerGroupError

__all__ = [
    "Decision",
    "Failure",
    "FailurePolicy",
    "Raise",
    "RankDied",
    "RecoveryOutcome",
    "ReplayReport",
    "Retry",
    "ScalingPolicy",
    "Shrink",
]

# The key of a death the rank of which is unknown: one during a rebuild or replay.
DURING_REBUILD = -1


@dataclass(frozen=True)
class Failure:
    """A cell that cannot go on with the ranks it has.

    ``dead``: the ranks that died, each with one line (``DURING_REBUILD`` for a death
    while the group was rebuilt); ``stuck``: with no death, the ranks that did not
    stop within the grace of a stop; ``error``: with neither, the cell's code raised
    (its first rank's line; a policy that retries errors runs it again, as a sweep's
    trial); ``stop_reason``: the cell was being stopped when it happened (a stopped
    cell is never run again); ``world_size``: the group's size then."""

    cell: str
    dead: dict[int, str] = field(default_factory=dict)
    stuck: tuple[int, ...] = ()
    error: str | None = None
    stop_reason: str | None = None  # the cell was being stopped, and why
    world_size: int = 0  # ranks in the group when it happened

    @classmethod
    def of_ranks(
        cls,
        cell: str,
        dead: dict[int, str],
        unfinished: list[int],
        stop_reason: str | None,
        stopped_for_failure: bool,
    ) -> Failure:
        """Ranks that died, else the ``unfinished`` ones that did not stop within the
        stop's grace. A rank that died while the others were being stopped after a
        failed rank is a failure to recover from (its peers' errors were the
        symptom), not a stop the user asked for."""
        return cls(
            cell,
            dead=dict(dead),
            stuck=tuple(unfinished) if not dead else (),
            stop_reason=None if dead and stopped_for_failure else stop_reason,
        )

    @property
    def stopping(self) -> bool:
        return self.stop_reason is not None

    @property
    def summary(self) -> str:
        """One line: who died during which cell, and the first cause."""
        if not self.dead and self.error is not None:
            return f"{self.cell} failed ({self.error})"
        ranks = sorted(self.dead)
        if ranks == [DURING_REBUILD]:
            return (
                f"a rank died while the group was rebuilt during {self.cell} "
                f"({self.dead[DURING_REBUILD]})"
            )
        ranks = [r for r in ranks if r >= 0]
        return (
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} died during "
            f"{self.cell} ({self.dead[ranks[0]]})"
        )


@dataclass(frozen=True)
class Retry:
    attempt: str  # "recovery 1 of 3"


@dataclass(frozen=True)
class Shrink:
    attempt: str
    workers: int  # the ranks of the rebuilt group


@dataclass(frozen=True)
class Raise:
    why: str = ""  # appended to the failure's summary, e.g. " after 3 recoveries (...)"


Decision = Retry | Shrink | Raise


class FailurePolicy:
    """Retry while ``max_failures`` allows (-1: always), then raise (``Shrink`` is for
    a subclass: the default keeps the group's size, as Ray Train does). A rank's
    death is retried; a cell whose code raised only with ``retry_errors`` (a sweep's
    trials, as Tune's ``FailureConfig``: a notebook cell's error is the user's to
    read, not to run again)."""

    def __init__(self, max_failures: int, retry_errors: bool = False) -> None:
        self.max_failures = max_failures
        self.retry_errors = retry_errors
        self.failures = 0

    def decide(self, failure: Failure) -> Decision:
        retryable = failure.dead or (failure.error is not None and self.retry_errors)
        if failure.stopping or not retryable:
            return Raise()  # a stop that went wrong is not retried
        if 0 <= self.max_failures <= self.failures:
            why = (
                f" after {self.failures} recoveries (--max-failures {self.max_failures})"
                if self.max_failures
                else ""
            )
            return Raise(why)
        self.failures += 1
        return Retry(self.describe())

    def can_recover(self) -> bool:
        return self.max_failures < 0 or self.failures < self.max_failures

    def describe(self) -> str:
        if self.max_failures < 0:
            return f"recovery {self.failures}"
        return f"recovery {self.failures} of {self.max_failures}"

    def reset(self) -> None:
        self.failures = 0


class ScalingPolicy:
    """An elastic group's sizes: as large as the cluster places now, up to MAX, at
    least MIN; a size that does not place gives way to one less; it grows back to
    what the cluster has room for, never in a cell. A fixed-size group has its size.

    ``settle_s``: how long the view of free resources may settle (the last group's
    coming free) before a group starts with what fits; ``grow_settle_s``: the same
    when growing back to a size already seen free; ``try_s``: how long a size above
    MIN may take to be placed before one less is tried."""

    def __init__(
        self, settle_s: float = 1.5, grow_settle_s: float = 10.0, try_s: float = 3.0
    ) -> None:
        self.settle_s = settle_s
        self.grow_settle_s = grow_settle_s
        self.try_s = try_s

    def size_now(
        self, config: SessionConfig, room: int, waited_s: float, expect: int | None
    ) -> int | None:
        """The size to place with ``room`` ranks free after ``waited_s``; None: let
        the view settle (``expect``: the size a growth saw room for)."""
        low, high = config.min_workers or 1, config.workers
        settle = self.settle_s if expect is None else self.grow_settle_s
        if room >= min(high, expect or high) or (room >= low and waited_s >= settle):
            return min(room, high)
        return None

    def placement_timeout_s(self, config: SessionConfig, size: int) -> float:
        """A stale view (a lost node still counted) must not hold a size above MIN."""
        low = config.min_workers or 1
        return (
            config.placement_timeout_s
            if size <= low
            else min(config.placement_timeout_s, self.try_s)
        )

    def next_smaller(self, config: SessionConfig, size: int, without: int | None) -> int | None:
        """The size to try after ``size`` did not place (``without``: the last group's
        size less the ranks a failure took); None at MIN."""
        low = config.min_workers or 1
        if size <= low:
            return None
        return max(low, min(size - 1, without or size))

    def grow_to(self, config: SessionConfig, size: int, room: int) -> int | None:
        """The size an elastic group of ``size`` ranks grows to with ``room`` for
        ranks (its own counted); None: it stays."""
        if not config.elastic or size >= config.workers or room <= size:
            return None
        return min(room, config.workers)


@dataclass
class ReplayReport:
    cells: int = 0
    pushes: int = 0
    duration_s: float = 0.0
    skipped: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        parts = [f"{self.cells} cell{'s' if self.cells != 1 else ''}"]
        if self.pushes:
            parts.append(f"{self.pushes} push{'es' if self.pushes != 1 else ''}")
        text = f"{' and '.join(parts)} replayed in {self.duration_s:.2f} s"
        if self.skipped:
            text += f" (not replayed: {'; '.join(self.skipped)})"
        return text


@dataclass
class RecoveryOutcome:
    """What the cell does next: run again on the rebuilt group (``error`` None), or
    end with ``error``; ``ray_lost``: the Ray under the group is gone."""

    decision: Decision
    replay: ReplayReport = field(default_factory=ReplayReport)
    error: BaseException | None = None
    ray_lost: bool = False
    # A failed cell the policy does not run again: it ends with its own error.
    keep_error: bool = False
    failure_summary: str = ""  # of the failure this outcome recovered from
    world_size: int = 0  # ranks in the rebuilt group
    resized: str | None = None  # an elastic group rebuilt smaller: its size and why

    @property
    def attempt(self) -> str:
        return getattr(self.decision, "attempt", "")

    def ranks_kept(self, ranks: list[int]) -> list[int]:
        """Those of a cell's ``ranks`` that the rebuilt group has (a policy that
        shrank it left the others out)."""
        return [r for r in ranks if r < self.world_size]

    def restart_note(self, cell: str) -> str:
        """The line a cell that runs again on the rebuilt group shows its viewers."""
        size = f" with {self.resized}" if self.resized else ""
        return (
            f"[rtnb] {self.failure_summary}; worker group rebuilt{size} ({self.attempt}), "
            f"{self.replay}; {cell} restarted\n"
        )

    def ranks_left_out(self, cell: str, ranks: list[int]) -> WorkerGroupError:
        """The error of a cell none of whose ``ranks`` is in the rebuilt group."""
        world = self.world_size
        return WorkerGroupError(
            f"{self.failure_summary}; the group was rebuilt with {world} "
            f"rank{'s' if world > 1 else ''} ({self.attempt}), without {cell}'s "
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}; "
            "run it on the ranks there are"
        )


class RankDied(Exception):
    """A rank died while a replayed cell ran (the replay is another failure)."""
