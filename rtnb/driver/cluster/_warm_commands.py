"""The warm Ray seen and ended from outside: ``%rtnb warm`` and ``rtnb warm``.

Reads the state file the warm Ray's host keeps current (who is attached, how
many spare ranks, since when it is idle), so neither the status nor the stop
joins Ray; a stop is the host's SIGTERM, which shuts its Ray down, removes its
temp dir and state file, and exits.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from rtnb.driver.cluster._warm_client import IDLE_ENV, SWITCH_ENV, live_state, state_dir
from rtnb.errors import ConfigError

__all__ = ["WarmRayStatus", "stop_warm_ray", "warm_ray_status"]

# How long a stopped warm Ray's host may take to shut its Ray down.
_STOP_WAIT_S = 30.0


@dataclass(frozen=True)
class WarmRayStatus:
    """One live warm Ray (normally there is one per user and Python environment)."""

    address: str
    pid: int
    cpus: int
    started: float  # wall-clock time
    kernels: tuple[int, ...]  # pids of the kernels attached now
    spares: int  # rank processes waiting for a kernel
    ranks_in_use: int
    idle_s: float  # it ends this long after the last kernel leaves
    idle_since: float | None  # wall-clock time; None while a kernel is attached
    detached: tuple[str, ...] = ()  # runs of the detached groups it holds
    spares_ready: int = 0  # of the spares, those done importing torch

    def summary(self, this_pid: int | None = None) -> str:
        now = time.time()
        lines = [
            f"warm Ray at {self.address} (pid {self.pid}, up {_span(now - self.started)}, "
            f"{self.cpus} CPUs)"
        ]
        if self.kernels:
            pids = ", ".join(
                f"{pid} (this kernel)" if pid == this_pid else str(pid) for pid in self.kernels
            )
            lines.append(f"  kernels attached: {len(self.kernels)}: pid {pids}")
        elif not self.detached:
            idle_for = max(0.0, now - (self.idle_since or now))
            left = max(0.0, self.idle_s - idle_for)
            lines.append(f"  no kernel attached for {_span(idle_for)}: it ends in {_span(left)}")
        if self.detached:
            lines.append(
                f"  detached groups: {', '.join(self.detached)} (`rtnb ps`; it ends only "
                "after they are freed)"
            )
        warming = self.spares - self.spares_ready
        lines.append(
            f"  ranks: {self.ranks_in_use} in use, {self.spares} spare (torch imported"
            + (f"; {warming} still importing it)" if warming > 0 else ")")
        )
        lines.append(
            f"  ends {_span(self.idle_s)} after the last kernel leaves ({IDLE_ENV}); "
            f"`rtnb warm stop` ends it now; {SWITCH_ENV}=0 keeps kernels off it"
        )
        return "\n".join(lines)


def warm_ray_status() -> list[WarmRayStatus]:
    """The live warm Rays of this user (``RTNB_HOME``), oldest first.

    In [1]: rtnb.warm_ray_status()
    Out[1]: [WarmRayStatus(address='127.0.0.1:39117', pid=4121, ...)]
    """
    found = []
    directory = state_dir()
    for state_file in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        state = live_state(state_file)
        if state is None:
            continue
        try:
            found.append(
                WarmRayStatus(
                    address=str(state["address"]),
                    pid=int(state["pid"]),
                    cpus=int(state.get("cpus", 0)),
                    started=float(state.get("started", time.time())),
                    kernels=tuple(int(pid) for pid in state.get("kernels", ())),
                    spares=int(state.get("spares", 0)),
                    spares_ready=int(state.get("spares_ready", 0)),
                    ranks_in_use=int(state.get("claimed", 0)),
                    idle_s=float(state.get("idle_s", 0.0)),
                    idle_since=state.get("idle_since"),
                    detached=tuple(str(run) for run in state.get("detached", ())),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue  # a state file of another rtnb version
    return sorted(found, key=lambda status: status.started)


def stop_warm_ray(force: bool = False) -> list[WarmRayStatus]:
    """End the warm Ray(s) now; returns what was stopped.

    A warm Ray a kernel is attached to is only stopped with ``force`` (that
    kernel's session then ends with "the warm Ray is gone" and can be rebuilt with
    ``%rtnb start --name RUN --replay``).

    In [1]: rtnb.stop_warm_ray()
    """
    running = warm_ray_status()
    in_use = [status for status in running if status.kernels or status.detached]
    if in_use and not force:
        pids = ", ".join(str(pid) for status in in_use for pid in status.kernels)
        runs = ", ".join(run for status in in_use for run in status.detached)
        users = " and ".join(
            part
            for part in (
                f"the kernel(s) with pid {pids}" if pids else "",
                f"the detached group(s) of {runs}" if runs else "",
            )
            if part
        )
        raise ConfigError(
            f"the warm Ray is in use by {users}: stop them (`%rtnb stop`, `rtnb stop RUN`) "
            "first, or stop it anyway with --force (they end)"
        )
    for status in running:
        try:
            os.kill(status.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _STOP_WAIT_S
    for status in running:
        while _running(status.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _running(status.pid):
            _kill_tree(status.pid)
    return running


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        host = psutil.Process(pid)
        family = [host, *host.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in family:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def _span(seconds: float) -> str:
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"
