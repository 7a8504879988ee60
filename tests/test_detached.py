"""Training that outlives its notebook: ``%rtnb start --detached`` in a real kernel,
the kernel SIGKILLed mid-cell, a rank killed while no kernel is attached, another
kernel's ``%rtnb attach``, and ``rtnb ps`` / ``rtnb stop`` / ``rtnb run`` from a
terminal, on the warm Ray a plain notebook gets (a private one per test)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rtnb.storage._result import read_run_metrics
from tests._kernel import Kernel, new_notebook
from tests._margins import until

pytestmark = [pytest.mark.slow]

# Steps 0-59, a checkpoint at every step ending in 9; the ranks wait at step 30 until
# the test opens the gate (while no kernel is attached).
LOOP = """%%rtrain --background
import os, time, rtnb, torch
ck = rtnb.get_checkpoint()
start = int(ck.load_state()["s"]) + 1 if ck else 0
for s in range(start, 60):
    while s == 30 and not os.path.exists(GATE):
        time.sleep(0.05)
    rtnb.report({"loss": 1.0 / (s + 1)}, step=s,
                checkpoint=rtnb.Checkpoint.from_state({"s": torch.tensor(s)}) if s % 10 == 9 else None)
f"rank {rtnb.get_context().get_world_rank()} at {s}"
"""


@pytest.fixture
def warm_env(tmp_path):
    """The kernels' environment: a warm Ray of this test's own, stopped at the end."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RTNB_WARM_RAY")}
    env["RTNB_HOME"] = str(tmp_path / "home")
    yield env
    subprocess.run(
        [sys.executable, "-m", "rtnb.batch.cli", "warm", "stop", "--force"],
        env=env,
        capture_output=True,
        timeout=120,
    )


def _cli(env: dict, *args: str, ok: bool = True) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "rtnb.batch.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert (out.returncode == 0) == ok, out.stdout + out.stderr
    return out.stdout + out.stderr


def _until(what: str, check, timeout_s: float = 120.0):
    return until(what, check, timeout_s)


def _steps(storage: Path, run: str) -> dict[int, list[int]]:
    try:
        rows = read_run_metrics(str(storage), run)
    except Exception:  # noqa: BLE001 - not written yet
        return {}
    steps: dict[int, list[int]] = {}
    for row in rows:
        steps.setdefault(int(row["rank"]), []).append(int(row["step"]))
    return steps


def _committed(storage: Path, run: str) -> list[int]:
    from rtnb.storage._checkpoints import CheckpointStore
    from rtnb.storage._rundir import RunDirectory

    try:
        return [c.step for c in CheckpointStore(RunDirectory(str(storage), run)).list()]
    except Exception:  # noqa: BLE001 - not written yet
        return []


def _cell(kernel: Kernel, code: str, ok: bool = True, timeout: float = 240.0) -> str:
    result = kernel.execute(code, timeout=timeout)
    shown = result.text + "".join(str(r.get("text/plain", "")) for r in result.results)
    assert (result.status == "ok") == ok, shown + result.evalue + "\n".join(result.traceback)
    return shown + result.evalue


def test_a_detached_cell_outlives_its_kernel_recovers_and_another_kernel_attaches(
    tmp_path, warm_env
):
    storage, gate = tmp_path / "runs", tmp_path / "gate"
    first = Kernel(cwd=str(tmp_path), env=warm_env)
    second = None
    try:
        started = _cell(
            first,
            "%load_ext rtnb\n"
            f"%rtnb start --detached --name det --workers 2 --cpus-per-worker 0.5 "
            f"--max-failures 1 --storage {storage}",
        )
        assert "is detached" in started, started
        _cell(first, "%rtrain import os; pid = os.getpid()")
        pids = json.loads(
            _cell(first, "pids = %rtnb pull pid\nimport json\nprint(json.dumps(list(pids)))")
        )
        kernel_pid = int(_cell(first, "import os; print(os.getpid())").strip())
        _cell(first, f"%rtrain GATE = {str(gate)!r}")
        _cell(first, LOOP)
        # Step 29's checkpoint committed: every rank passed step 29 and waits at the gate.
        _until("the ranks reach the gate", lambda: _committed(storage, "det") == [9, 19, 29])

        # The kernel dies without a word: the cell goes on.
        os.kill(kernel_pid, signal.SIGKILL)
        _until(
            "the kernel is gone",
            lambda: (
                not psutil.pid_exists(kernel_pid)
                or psutil.Process(kernel_pid).status() == psutil.STATUS_ZOMBIE
            ),
        )
        runs = _cli(warm_env, "runs", str(storage))
        assert "(detached)" in runs.splitlines()[1] and runs.splitlines()[1].startswith("det"), runs
        listed = _until(
            "rtnb ps shows it unattached",
            lambda: out if "no kernel" in (out := _cli(warm_env, "ps")) else None,
            30,
        )
        assert "det" in listed and "running" in listed and "1 CPU" in listed, listed

        # From a terminal: follow the cell in text, then Ctrl-C leaves it running.
        follower = subprocess.Popen(
            [sys.executable, "-m", "rtnb.batch.cli", "attach", "det"],
            env=warm_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        first_line = follower.stdout.readline()
        assert "following cell [" in first_line and "Ctrl-C leaves it running" in first_line
        assert "step 29" in follower.stdout.readline()
        follower.send_signal(signal.SIGINT)
        try:
            rest = follower.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            follower.kill()
            shown = follower.communicate()[0]
            raise AssertionError(f"Ctrl-C did not end `rtnb attach`: {shown}") from None
        assert follower.returncode == 130 and "is left running" in rest, rest
        assert "running" in _cli(warm_env, "ps")

        # A rank dies while no kernel is attached: recovered from step 29's checkpoint.
        os.kill(pids[1], signal.SIGKILL)
        _until(
            "the group is rebuilt",
            lambda: "recover" not in (out := _cli(warm_env, "ps")) and "running" in out,
            120,
        )
        gate.touch()

        second = Kernel(cwd=str(tmp_path), env=warm_env)
        attached = _cell(
            second,
            "%load_ext rtnb\n%rtnb attach det\n"
            "m = get_ipython().magics_manager.registry['RtnbMagics']\n"
            "print('history', m.session.metrics.count())",
        )
        assert "attached to this kernel" in attached, attached
        # The history so far came with the attach: both ranks' steps up to 29 at least.
        assert int(attached.split("history ")[1].split()[0]) >= 60, attached
        value = _cell(second, "%rtnb wait --timeout 180")
        # The host's rebuilt group keeps its open channel to both ranks.
        status = _cell(second, "%rtnb status")
        assert sum(" channel " in line for line in status.splitlines()) == 2, status
        assert "rank 0 at 59" in value and "rank 1 at 59" in value, value
        restarted = _cell(
            second,
            "m = get_ipython().magics_manager.registry['RtnbMagics']\n"
            "print(m.session.cells[-1].restarted_from, m.session.metrics.count())",
        )
        assert restarted.split()[0] == "step-000000029", restarted
        # The history the second kernel drew: every report of both ranks, and the run's
        # record holds every step once, across the kernel's death and the recovery.
        assert int(restarted.split()[1]) == 120, restarted
        assert _steps(storage, "det") == {0: list(range(60)), 1: list(range(60))}

        stopped = _cell(second, "%rtnb stop")
        assert "stopped" in stopped
        assert "no detached groups" in _cli(warm_env, "ps")
        assert "(detached)" not in _cli(warm_env, "runs", str(storage))
    finally:
        for kernel in (first, second):
            if kernel is not None:
                try:
                    kernel.shutdown()
                except Exception:  # noqa: BLE001 - the killed one
                    pass


def _batch_cells(gate: Path, done: Path) -> list[str]:
    """A notebook that starts a detached group, trains, and leaves a background cell
    running until the test opens ``gate``; the cell's last act writes ``done``. While
    it runs the group is busy, so no step of the test waits inside its idle timeout."""
    return [
        "%load_ext rtnb",
        "%rtnb start --detached --name batchdet --workers 2 --cpus-per-worker 0.5 "
        "--idle-timeout 12",
        "%%rtrain\nimport rtnb\nfor s in range(5):\n    rtnb.report({'loss': 1.0 / (s + 1)}, step=s)",
        "%%rtrain --background\nimport os, time, rtnb\n"
        f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.05)\n"
        f"if rtnb.get_context().world_rank == 0:\n    open({str(done)!r}, 'w').close()",
    ]


def test_a_batch_run_leaves_its_detached_group_which_is_held_taken_and_freed_when_idle(
    tmp_path, warm_env
):
    gate, done = tmp_path / "gate", tmp_path / "done"
    notebook = tmp_path / "detached.ipynb"
    notebook.write_text(json.dumps(new_notebook(_batch_cells(gate, done))))
    # The warm Ray ends 2 s after its last kernel leaves, unless a detached group holds it.
    env = {**warm_env, "RTNB_STORAGE": str(tmp_path / "runs"), "RTNB_WARM_RAY_IDLE_S": "2"}
    ran = _cli(env, "run", str(notebook))
    assert "run 'batchdet' was started --detached and is left running on purpose" in ran, ran
    time.sleep(3)  # past the warm Ray's idle time: it must still be there for the group
    assert "batchdet" in _cli(env, "ps")
    warm = _cli(env, "warm")
    assert "detached groups: batchdet" in warm, warm
    assert "in use by the detached group(s) of batchdet" in _cli(env, "warm", "stop", ok=False)

    holder = Kernel(cwd=str(tmp_path), env=env)
    other = Kernel(cwd=str(tmp_path), env=env)
    try:
        _cell(holder, "%load_ext rtnb")
        # The background cell ends with no kernel attached; from then on the idle
        # timeout counts, and only the attach below runs inside it.
        gate.touch()
        _until("the background cell ends", done.exists)
        ended = _cell(holder, "%rtnb attach batchdet")
        assert "cell [4] ended while detached" in ended, ended
        refused = _cell(other, "%load_ext rtnb\n%rtnb attach batchdet", ok=False)
        assert "is attached to kernel pid" in refused and "--take" in refused, refused
        assert "Traceback" not in refused
        _cell(other, "%rtnb attach batchdet --take")
        assert "[1, 1]" in _cell(other, "%rtrain x = 1\n%rtnb pull x")
        lost = _cell(holder, "%rtnb pull x", ok=False)
        assert "took it over" in lost, lost
        # The kernel that holds it lets go: nothing runs, nobody holds it, and after
        # its idle timeout its ranks and CPUs are freed.
        other.shutdown()
        other = None
        _until("the idle group is freed", lambda: "no detached groups" in _cli(env, "ps"), 240)
    finally:
        for kernel in (holder, other):
            if kernel is not None:
                kernel.shutdown()
