"""A short soak in CI (benchmarks/soak.py is the long one): 300 cells on one group,
with background cells, interrupts and checkpoints among them. Neither the kernel's
memory nor a rank's grows past 50 MB after the first 60 cells, every checkpoint is
listed, and stopping leaves no rank process and no CPU held."""

from __future__ import annotations

import os
import tempfile
import time

import psutil
import pytest

import rtnb
from benchmarks.soak import BACKGROUND, CHECKPOINT, INTERRUPTED, SHORT
from tests.conftest import CLUSTER_CPUS, wait_for_free_cpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MB = 1024 * 1024


def test_three_hundred_cells_with_interrupts_keep_memory_bounded_and_leave_nothing(ray_cluster):
    quiet = lambda *a: None  # noqa: E731
    session = rtnb.Session(
        workers=2, cpus_per_worker=0.5, storage=tempfile.mkdtemp(), name="soak", stop_grace_s=1.0
    ).start()
    pids = [r.pid for r in session.group.ranks]
    processes = {"kernel": psutil.Process(os.getpid())} | {
        f"rank {r}": psutil.Process(p) for r, p in enumerate(pids)
    }
    session.run("import torch, rtnb", output=quiet)
    baseline: dict[str, float] = {}
    interrupts = checkpoints = 0
    for i in range(1, 301):
        assert session.run(SHORT.format(i=i), output=quiet) == {0: i, 1: i}
        if i % 10 == 0:
            session.run_background(BACKGROUND, output=quiet).wait(60)
        if i % 20 == 0:
            spun = len(session.metrics.series("spin", 0)[0]) if interrupts else 0
            handle = session.run_background(INTERRUPTED, output=quiet)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(session.metrics.series("spin", 0)[0]) <= spun:
                time.sleep(0.01)  # until it is in its loop
            handle.stop()
            with pytest.raises(rtnb.CellInterrupted):
                handle.wait(60)
            interrupts += 1
        if i % 40 == 0:
            session.run(CHECKPOINT.format(i=i), output=quiet)
            checkpoints += 1
        if i == 60:
            baseline = {name: p.memory_info().rss / MB for name, p in processes.items()}
    grown = {name: p.memory_info().rss / MB - baseline[name] for name, p in processes.items()}
    print("RSS growth after cell 60 (MB):", {k: round(v, 1) for k, v in grown.items()})
    assert max(grown.values()) <= 50, grown
    assert interrupts == 15 and len(session.list_checkpoints()) == checkpoints == 7
    assert session.run("x") == {0: 300, 1: 300}, "the group is the one it started with"
    session.stop()

    def alive() -> list[int]:
        return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]

    deadline = time.monotonic() + 30  # Ray ends a killed actor's process soon after
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(), "the ranks' processes outlived the stop"
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS
