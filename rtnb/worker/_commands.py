"""Control calls to a rank, as typed commands on one channel.

The hot paths — a cell's run, its polls and the relay — are calls of their own, with
byte-encoded messages. Everything else the driver asks of a running rank (stop,
hold, release, debug, stacks, values in and out, …) is a :class:`RankCommand` sent
through one call: ``RankActor.command`` on Ray, ``command`` on the groups in the
kernel, ``RankRuntime.command`` on the rank. The rank runs the command's ``apply``
with its runtime, so a new control is its command here and, when it needs one, the
runtime part that does it; no group, actor or protocol names it.

A command that carries bulk data many ranks share (``Push``'s values) takes it as
the call's ``payload``: the group stores it once and Ray resolves it before
``apply`` runs (a value nested inside a command would reach the rank as a
reference).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rtnb.core._stacks import RankStack
    from rtnb.worker._debug import DebugState
    from rtnb.worker._runtime import RankRuntime


class RankCommand:
    """A control for one rank: ``apply`` runs on the rank, with its runtime and the
    call's payload, and its result is the call's answer."""

    def apply(self, runtime: RankRuntime, payload: Any = None) -> Any:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Stop(RankCommand):
    """Stop at the next report boundary; answers the rank's step."""

    def apply(self, runtime: RankRuntime, payload: Any = None) -> int:
        return runtime.request_stop()


@dataclasses.dataclass(frozen=True)
class StopAt(RankCommand):
    """Stop once the rank reaches ``step`` (the group's agreed step)."""

    step: int

    def apply(self, runtime: RankRuntime, payload: Any = None) -> None:
        runtime.set_stop_target(self.step)


@dataclasses.dataclass(frozen=True)
class Interrupt(RankCommand):
    """Raise ``CellStopped`` in the cell thread; answers whether it was delivered."""

    def apply(self, runtime: RankRuntime, payload: Any = None) -> bool:
        return runtime.interrupt()


@dataclasses.dataclass(frozen=True)
class Hold(RankCommand):
    """Pause at the next report for live change ``change``; answers the step now."""

    change: int = 0

    def apply(self, runtime: RankRuntime, payload: Any = None) -> int | None:
        return runtime.hold(self.change)


@dataclasses.dataclass(frozen=True)
class Release(RankCommand):
    """``changes`` hold from ``from_step`` on (-1: at once), ``triggers`` fire in
    that step's report; a held rank goes on."""

    changes: dict[str, Any]
    from_step: int
    triggers: tuple[str, ...] = ()
    change: int = 0

    def apply(self, runtime: RankRuntime, payload: Any = None) -> None:
        runtime.release(self.changes, self.from_step, self.triggers, self.change)


@dataclasses.dataclass(frozen=True)
class SetStep(RankCommand):
    """The rank's step and line counter (a resumed run goes on from them)."""

    step: int
    line: int = 0

    def apply(self, runtime: RankRuntime, payload: Any = None) -> None:
        runtime.set_step(self.step, self.line)


@dataclasses.dataclass(frozen=True)
class Stack(RankCommand):
    """Where the cell thread is now (``%rtnb stacks``, the hang doctor)."""

    def apply(self, runtime: RankRuntime, payload: Any = None) -> RankStack:
        return runtime.stack()


@dataclasses.dataclass(frozen=True)
class DebugPoll(RankCommand):
    """The debugger's state, waiting up to ``wait_s`` for it to stop somewhere."""

    wait_s: float

    def apply(self, runtime: RankRuntime, payload: Any = None) -> DebugState:
        return runtime.debugger.poll(self.wait_s)


@dataclasses.dataclass(frozen=True)
class DebugInput(RankCommand):
    """One line typed at the debugger's prompt."""

    line: str

    def apply(self, runtime: RankRuntime, payload: Any = None) -> None:
        runtime.debugger.give(self.line)


@dataclasses.dataclass(frozen=True)
class PostMortem(RankCommand):
    """Where the rank's last failure happened, if its traceback is kept."""

    def apply(self, runtime: RankRuntime, payload: Any = None) -> str | None:
        return runtime.debugger.post_mortem()


@dataclasses.dataclass(frozen=True)
class Pull(RankCommand):
    """Variable ``name`` of the rank's namespace, portable: (found, bytes, kind)."""

    name: str

    def apply(self, runtime: RankRuntime, payload: Any = None) -> tuple[bool, bytes | None, str]:
        return runtime.pull(self.name)


@dataclasses.dataclass(frozen=True)
class Push(RankCommand):
    """Set variables: the payload is a dict, or its cloudpickled bytes (the
    journal's form, so a pushed value is serialized once for both)."""

    def apply(self, runtime: RankRuntime, payload: Any = None) -> None:
        if isinstance(payload, bytes):
            from ray import cloudpickle

            payload = cloudpickle.loads(payload)
        runtime.push(dict(payload or {}))


@dataclasses.dataclass(frozen=True)
class SetDatasets(RankCommand):
    """This rank's dataset shards, replacing the last set, each watched for the time
    the rank waits in it (the hang doctor's "waiting for data")."""

    shards: dict[str, Any]

    def apply(self, runtime: RankRuntime, payload: Any = None) -> None:
        from rtnb.worker._shards import watched_shard

        runtime.datasets = {
            name: watched_shard(name, shard, runtime.shard_waits)
            for name, shard in self.shards.items()
        }


@dataclasses.dataclass(frozen=True)
class Ping(RankCommand):
    """The rank's cell state, as a word: it answers."""

    def apply(self, runtime: RankRuntime, payload: Any = None) -> str:
        return str(runtime.state)
