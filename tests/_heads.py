"""A ``ray start --head --block`` counted as up once its raylet says it started, and
started again when it died first. Imports nothing but the standard library: the
suite's conftest uses it, and so do the scenarios that run as scripts of their own
(the Ray-lost kernels, the neighbour in its own namespace), which must not import
pytest's conftest.

On a busy 2-core machine a head's raylet can wait out its 15 s for its agents' port
files and exit (``Timed out waiting for file .../metrics_agent_port_...``), taking the
``--block`` head with it: a Ray bug, not what any test is about."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

# What a raylet logs once it waited for its agents and runs (Ray 2.60's raylet.out).
RAYLET_STARTED = "started. Raylet consists of"
# Ray's own start of a local node giving up on a busy machine (its raylet registers
# late, or dies waiting for its agents): the user would run the cell again.
RAYS_START_GAVE_UP = "The current node timed out during startup"


def _latest_session(temp_dir: str) -> str | None:
    latest = Path(temp_dir) / "session_latest"
    return os.path.realpath(latest) if latest.exists() else None


def raylet_started(temp_dir: str, earlier_session: str | None = None) -> bool:
    """Whether the newest Ray session under ``temp_dir`` (other than
    ``earlier_session``, which an earlier ``ray.init()`` may have left in a shared
    ``/tmp/ray``) has a raylet that says it started."""
    session = _latest_session(temp_dir)
    if session is None or session == earlier_session:
        return False
    try:
        return RAYLET_STARTED in (Path(session) / "logs" / "raylet.out").read_text()
    except OSError:
        return False


def end_process_group(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """End a head and everything it started. ``ray start --block`` drains for up to
    30 s on SIGTERM; the node's processes (raylet, workers) share its process group,
    so they are ended directly."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def start_head_until_up(
    start: Callable[[], subprocess.Popen], temp_dir: str, tries: int = 3, timeout_s: float = 120
) -> subprocess.Popen:
    """``start()`` (a ``ray start --head --block`` whose sessions go under
    ``temp_dir``, in a process group of its own) until its raylet is up."""
    for _ in range(tries):
        earlier = _latest_session(temp_dir)
        proc = start()
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            if raylet_started(temp_dir, earlier):
                return proc
            time.sleep(0.2)
        end_process_group(proc)
    raise RuntimeError(f"`ray start --head` did not come up in {tries} tries (logs: {temp_dir})")
