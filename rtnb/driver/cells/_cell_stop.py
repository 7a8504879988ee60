"""A cell's stop: the one a user, a timeout or a storage failure asks, and the one
rtnb asks itself when a rank's cell raised (the others would wait for it in their
next collective). :class:`CellStop` keeps which it is, because the two end
differently: the user's stop ends the cell with CellInterrupted and is never a
failure to recover from; rtnb's ends with the rank's error and hands that error to
the failure policy. The phases themselves are the
:class:`~rtnb.driver.ranks._stopping.StopProtocol`'s.
"""

from __future__ import annotations

from rtnb.core._messages import RankUpdate
from rtnb.driver.cells._outcome import Outcome, first_cause, judge
from rtnb.driver.lifecycle import Failure
from rtnb.driver.ranks import StopProtocol

__all__ = ["CellStop"]


class CellStop:
    """Whether and why a cell is stopping; ``protocol`` moves its phases."""

    def __init__(self, grace_s: float) -> None:
        self._grace_s = grace_s
        self.protocol = StopProtocol(grace_s)
        self.for_failure = False  # asked because a rank's cell raised

    @property
    def requested(self) -> bool:
        return self.protocol.requested

    @property
    def final(self) -> bool:
        return self.protocol.final

    @property
    def reason(self) -> str | None:
        return self.protocol.reason

    def request(self, reason: str, final: bool = False) -> None:
        self.protocol.request(reason, final)

    def check(
        self,
        finished: dict[int, RankUpdate],
        unfinished: list[int],
        elapsed_s: float,
        timeout_s: float | None,
    ) -> None:
        """Ask the stop a tick calls for: the others', once a rank's cell raised; the
        whole cell's, once it ran past its ``--timeout``."""
        if not self.requested and unfinished:
            cause = first_cause(finished)
            if cause is not None:
                self.for_failure = True
                self.request(
                    f"stopped: rank {cause[0]} failed ({cause[1]}); the other ranks would "
                    "wait for it in their next collective"
                )
        if self.protocol.timed_out(elapsed_s, timeout_s):
            self.request(f"timed out after {timeout_s:g} s (--timeout)")

    def failure(self, name: str, finished: dict[int, RankUpdate]) -> Failure | None:
        """The error a rank's cell raised, for the failure policy to decide on; None
        when the user stopped the cell (their stop is not a failure) or none raised."""
        cause = first_cause(finished)
        if cause is None or (self.requested and not self.for_failure):
            return None
        return Failure(name, error=f"rank {cause[0]}: {cause[1]}")

    def judge(self, name: str, finished: dict[int, RankUpdate]) -> Outcome:
        return judge(name, finished, self.protocol, self.for_failure)

    def forgive_failure(self) -> None:
        """The cell runs again after a rank's failure: the stop that failure asked
        ended with the failed attempt (kept, it would stop the rerun once its grace
        ran out). A stop the user asked for still holds."""
        if self.for_failure:
            self.protocol = StopProtocol(self._grace_s)
            self.for_failure = False
