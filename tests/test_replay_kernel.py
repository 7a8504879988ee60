"""A lost kernel is not a lost notebook: ``%rtnb start --name RUN --replay`` in a new
kernel rebuilds the ranks' state from the run's journal and carries on training.

Two real ipykernel processes through jupyter_client; the first is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests._kernel import Kernel
from tests.conftest import CLUSTER_CPUS, wait_for_free_cpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TRAIN = """%%rtrain
ck = rtnb.get_checkpoint()
i = ck.load_state()['i'] + 1 if ck is not None else 0
first = i
while i < STEPS:
    rtnb.report({'i': i}, checkpoint=rtnb.Checkpoint.from_state({'i': i}) if dist.get_rank() == 0 else None)
    i += 1
(first, i, rtnb.get_context().run_name)
"""


def _ok(run):
    assert run.status == "ok", run.text + "\n".join(run.traceback)
    return run


def _out(run) -> str:
    return "".join(r.get("text/plain", "") for r in run.results)


def test_a_new_kernel_replays_the_journal_of_a_killed_one(ray_cluster, tmp_path):
    storage = str(tmp_path / "runs")
    start = f"%rtnb start --name lost --storage {storage} --cpus-per-worker 0.5"
    first = Kernel(cwd=str(tmp_path))
    try:
        _ok(first.execute("%load_ext rtnb"))
        _ok(first.execute(start))
        _ok(first.execute("lr = 0.125"))
        _ok(first.execute("%rtnb push lr"))
        _ok(first.execute("%%rtrain\nimport rtnb, torch.distributed as dist\nSTEPS = 12"))
        _ok(first.execute("%%rtrain --once\nexpensive = 'computed once'"))
        _ok(first.execute("%%rtrain\nhistory = [dist.get_rank() * lr]"))
        run = _ok(first.execute(TRAIN))
        assert "[rank 0] (0, 12, 'lost')" in _out(run)
        # The kernel dies without a word: no %rtnb stop, no exit hooks.
        os.kill(first.km.provisioner.pid, signal.SIGKILL)
    finally:
        first.kc.stop_channels()
        first.km.cleanup_resources()
    # Ray ends the dead driver's ranks; their CPUs come back.
    assert wait_for_free_cpus(CLUSTER_CPUS, timeout=60) >= CLUSTER_CPUS

    second = Kernel(cwd=str(tmp_path))
    try:
        _ok(second.execute("%load_ext rtnb"))
        run = _ok(second.execute(start + " --replay"))
        assert "rebuilt from its journal" in run.text, run.text
        # named by its In [N] in the first kernel (the `%%rtrain --once` cell, the 6th run)
        assert "(not replayed: cell [6] (marked --once))" in run.text, run.text
        assert "3 cells and 1 push replayed in" in run.text, run.text
        run = _ok(second.execute("%rtrain (lr, history, 'expensive' in globals())"))
        assert "[rank 0] (0.125, [0.0], False)" in _out(run)
        assert "[rank 1] (0.125, [0.125], False)" in _out(run)
        # Training carries on from the run's latest checkpoint, and so does the step count.
        _ok(second.execute("%rtrain STEPS = 20"))
        run = _ok(second.execute(TRAIN))
        assert "[rank 0] (12, 20, 'lost')" in _out(run), _out(run)
        run = _ok(second.execute("ck = %rtnb checkpoints --list\nprint([c.step for c in ck][-9:])"))
        # steps count from 0, so each checkpoint's step is the i it holds
        assert "[11, 12, 13, 14, 15, 16, 17, 18, 19]" in run.stdout, run.text
        _ok(second.execute("%rtnb stop"))
    finally:
        second.shutdown()
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS


def test_a_kernel_killed_the_instant_a_cell_returns_loses_nothing(ray_cluster, tmp_path):
    """The journal is written ahead: a push and a cell whose results reached the
    notebook are in it even when the kernel dies the next instant (its writer thread
    had no time to put their files in storage)."""
    storage = str(tmp_path / "runs")
    start = f"%rtnb start --name instant --storage {storage} --cpus-per-worker 0.5"
    first = Kernel(cwd=str(tmp_path))
    try:
        _ok(first.execute("%load_ext rtnb"))
        _ok(first.execute(start))
        # One cell: push, a cell on the ranks, and the kernel's death microseconds later.
        first.kc.execute(
            "import os, signal\n"
            "a = 3\n"
            "get_ipython().run_line_magic('rtnb', 'push a')\n"
            "get_ipython().run_line_magic('rtrain', 'b = a * 2')\n"
            "os.kill(os.getpid(), signal.SIGKILL)"
        )
        deadline = time.monotonic() + 60
        while first.km.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not first.km.is_alive()
    finally:
        first.kc.stop_channels()
        first.km.cleanup_resources()
    assert wait_for_free_cpus(CLUSTER_CPUS, timeout=60) >= CLUSTER_CPUS

    second = Kernel(cwd=str(tmp_path))
    try:
        _ok(second.execute("%load_ext rtnb"))
        run = _ok(second.execute(start + " --replay"))
        assert "1 cell and 1 push replayed in" in run.text, run.text
        run = _ok(second.execute("%rtrain (a, b)"))
        assert "[rank 0] (3, 6)" in _out(run) and "[rank 1] (3, 6)" in _out(run), _out(run)
        _ok(second.execute("%rtnb stop"))
    finally:
        second.shutdown()
