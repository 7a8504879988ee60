"""Whether the machines under a group's ranks can still be reached.

A machine that is switched off closes its connections, and Ray notices in seconds.
A machine whose link is cut closes nothing: every packet to it is dropped, and
Ray's GCS declares its node dead only after its health checks time out (5 checks
of up to 10 s each by default: over a minute), while the other ranks wait in a
collective for a peer that will never answer. So the group knocks (a TCP connect,
no Ray call) on each remote machine's raylet port, and a machine that accepted no
connection for :data:`CUT_OFF_S` counts as cut off: its ranks are lost, and the
cell ends in one line naming them and the machine.

A machine that answers but refuses the connection has no raylet on that port any
more: the node is gone (its raylet crashed or was killed) even where its rank
processes linger and still answer the kernel on the open channel, which no Ray
call would tell. After :data:`REFUSED_S` of refusals its ranks are lost too. Every
node but the kernel's own is watched, several on one machine each on its port.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CUT_OFF_S", "REFUSED_S", "Machine", "MachineWatch"]

# A machine that accepted no connection for this long is cut off. A busy machine's
# kernel still accepts a TCP connection for its raylet; only a dead or cut-off one
# does not.
CUT_OFF_S = 6.0
# A raylet port refused this long (two knocks) is a node that ended: nothing
# listens there any more, which no busy or slow machine answers.
REFUSED_S = 0.5
_KNOCK_EVERY_S = 0.5
_KNOCK_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Machine:
    """A machine under some of the group's ranks: where its raylet listens."""

    name: str
    address: str
    port: int
    ranks: tuple[int, ...]


class MachineWatch:
    """Knocks on each machine in a thread of its own; :meth:`cut_off` says which
    ranks are on a machine that stopped answering, and why, in one line each."""

    def __init__(self, machines: Iterable[Machine]) -> None:
        self.machines = [m for m in machines if m.port > 0]
        # Judged only once it answered: a machine whose raylet port this process
        # cannot reach at all (a firewall) is Ray's to judge, not this watch's.
        self._answered: dict[Machine, float] = {}
        self._refused: dict[Machine, float] = {}  # refused since, while it is
        self._closed = threading.Event()
        if self.machines:
            threading.Thread(target=self._knock, name="rtnb-machine-watch", daemon=True).start()

    def cut_off(self) -> dict[int, str]:
        now = time.monotonic()
        lost: dict[int, str] = {}
        for machine, answered in list(self._answered.items()):
            silent = now - answered
            refused = now - self._refused.get(machine, now)
            if refused >= REFUSED_S:
                why = (
                    f"its Ray node's port {machine.port} refused every connection for "
                    f"{refused:.0f} s (the node's raylet ended)"
                )
            elif silent >= CUT_OFF_S:
                why = (
                    f"that machine accepted no connection for {silent:.0f} s (switched off, "
                    "or its network cut)"
                )
            else:
                continue
            for rank in machine.ranks:
                lost[rank] = f"on {machine.name} ({machine.address}): {why}"
        return lost

    def close(self) -> None:
        self._closed.set()

    def _knock(self) -> None:
        while not self._closed.wait(_KNOCK_EVERY_S):
            for machine in self.machines:
                if self._closed.is_set():
                    return
                try:
                    with socket.create_connection(
                        (machine.address, machine.port), timeout=_KNOCK_TIMEOUT_S
                    ):
                        self._answered[machine] = time.monotonic()
                        self._refused.pop(machine, None)
                except ConnectionRefusedError:
                    self._refused.setdefault(machine, time.monotonic())
                except OSError:
                    pass
