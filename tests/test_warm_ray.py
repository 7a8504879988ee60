"""The per-user warm Ray: later kernels join it and take ranks that imported torch
already; a dead kernel's ranks are killed; with no kernel left it ends by itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests._margins import until, waited

pytestmark = pytest.mark.slow

# A "kernel": starts a session on the warm Ray, runs a cell that looks at its
# environment, and either stops (detaches) or dies without a word.
KERNEL = r"""
import json, os, sys, time
os.environ["RTNB_TEST_VALUE"] = "set by the kernel"
import rtnb
from rtnb.driver.cluster import _warm_client as _warm
s = rtnb.Session(workers=2, storage=sys.argv[1])
s.start()
s.run("import os, torch, rtnb\nseen = dict(cwd=os.getcwd(), value=os.environ.get('RTNB_TEST_VALUE'), "
      "first_only=os.environ.get('RTNB_FIRST_KERNEL_ONLY'), "
      "threads=torch.get_num_threads(), pid=os.getpid(), rank=rtnb.get_context().get_world_rank())")
seen = s.pull("seen")
warm = _warm.active_warm_ray()
print(json.dumps({"seen": list(seen), "launched": warm.launched, "host": warm.launcher_pid,
                  "ray_s": s.last_start.seconds("Ray")}), flush=True)
if sys.argv[2] == "die":
    os._exit(0)
s.stop()
"""


def _kernel(tmp_path: Path, how: str, env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", KERNEL, str(tmp_path / "runs"), how],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path / "nb",
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _wait_for_spares(home: Path, count: int, timeout_s: float) -> None:
    """Until the warm Ray's pool has ``count`` ready spare ranks again (it makes them a
    few seconds after a claim, at low priority): listed is not enough, since a listed
    spare's process may start later than the next kernel, which then counts it as
    made for itself."""

    def ready() -> int:
        state = json.loads(next((home / "warm-ray").glob("*.json")).read_text())
        return state.get("spares_ready", 0)

    until(f"the warm Ray has {count} ready spare ranks", lambda: ready() >= count, timeout_s, 0.25)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    began = time.monotonic()
    alive = pids
    while alive and time.monotonic() < began + timeout_s:
        alive = [p for p in pids if _running(p)]
        time.sleep(0.2)
    waited("processes gone", time.monotonic() - began, timeout_s)
    return alive


def _family(host: psutil.Process) -> list[psutil.Process]:
    """``host`` and every process under it; one that exits while they are listed is
    left out (psutil then raises for it), so the list is read again."""
    for _ in range(20):
        if not host.is_running():
            return [host]
        try:
            return [host, *host.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return [host]


def test_kernels_share_one_warm_ray_that_ends_when_idle(tmp_path):
    (tmp_path / "nb").mkdir()
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Idle long enough for the next kernel process to start and find it on a loaded
    # 2-core machine (4 s once was not, in a fresh clone's CI run), short enough to
    # watch it end.
    env.update(RTNB_WARM_RAY="1", RTNB_HOME=str(home), RTNB_WARM_RAY_IDLE_S="10")
    # The kernel that starts the warm Ray has a variable the next kernel does not.
    first = _kernel(tmp_path, "stop", {**env, "RTNB_FIRST_KERNEL_ONLY": "token-123"})
    host = psutil.Process(first["host"])
    try:
        assert first["launched"], "the first kernel started the warm Ray"
        # An adopted rank runs where a cold one would: the kernel's directory and
        # environment, with the session's thread count.
        for rank, seen in enumerate(first["seen"]):
            assert seen["rank"] == rank
            assert seen["cwd"] == str(tmp_path / "nb")
            assert seen["value"] == "set by the kernel"
            assert seen["threads"] == 1
            assert seen["first_only"] == "token-123"
        second = _kernel(tmp_path, "die", env)
        assert not second["launched"] and second["host"] == first["host"]
        assert second["ray_s"] < 5.0, "joining took about a second, not a Ray start"
        dead_kernels_ranks = [seen["pid"] for seen in second["seen"]]
        assert [seen["first_only"] for seen in second["seen"]] == [None, None], (
            "a rank has its own kernel's environment, not the one that started the warm Ray"
        )
        assert not set(dead_kernels_ranks) & {seen["pid"] for seen in first["seen"]}
        # The second kernel died holding its ranks: the warm Ray kills them.
        assert _wait_gone(dead_kernels_ranks, 30) == []
        # No kernel left: after the idle time the warm Ray ends, and every process
        # it started with it.
        family = _family(host)
        assert _wait_gone([p.pid for p in family], 60) == [], "the warm Ray ended"
        assert not list((home / "warm-ray").glob("*.json")), "its state file is gone"
    finally:
        for proc in _family(host):
            try:
                proc.kill()
            except psutil.Error:
                pass


HOLDER = r"""
import os, sys, rtnb
s = rtnb.Session(workers=2, cpus_per_worker=os.cpu_count() / 2, storage=sys.argv[1])
s.start()
print("holding", flush=True)
sys.stdin.read()
s.stop()
"""

SECOND = r"""
import sys, rtnb
s = rtnb.Session(workers=1, cpus_per_worker=0.5, storage=sys.argv[1])
s.start(progress=print)
s.run("x = 1")
print("connection:", s.connection.address, flush=True)
s.stop()
"""


def test_a_warm_ray_whose_cpus_are_taken_is_left_to_its_kernel(tmp_path):
    """Two notebooks at once: the second embeds its own Ray instead of waiting for
    CPUs the first holds (as before the warm Ray existed)."""
    from rtnb.driver.cluster import _warm_client as _warm

    assert _warm.warm_ray_wanted(None) is False, "the test process itself never joins one"
    (tmp_path / "nb").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RTNB_WARM_RAY="1", RTNB_HOME=str(tmp_path / "home"), RTNB_WARM_RAY_IDLE_S="2")
    runs = str(tmp_path / "runs")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, runs],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path / "nb",
    )
    host = None
    try:
        assert holder.stdout.readline().strip() == "holding", holder.stderr.read()[-3000:]
        host = psutil.Process(
            json.loads(next((tmp_path / "home" / "warm-ray").glob("*.json")).read_text())["pid"]
        )
        second = subprocess.run(
            [sys.executable, "-c", SECOND, runs],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path / "nb",
            timeout=240,
        )
        assert second.returncode == 0, second.stderr[-3000:]
        assert "another kernel holds them" in second.stdout
        assert "connection: embedded" in second.stdout
    finally:
        holder.communicate("", timeout=60)
        if host is not None:
            assert _wait_gone([host.pid], 60) == [], "the warm Ray ended once idle"


def test_the_warm_ray_is_for_notebook_kernels_unless_asked(monkeypatch):
    from rtnb.driver.cluster import _warm_client as _warm

    monkeypatch.delenv("RTNB_WARM_RAY", raising=False)
    monkeypatch.delenv("RTNB_BATCH_RUNS_FILE", raising=False)
    monkeypatch.setitem(sys.modules, "ipykernel", sys)  # any module: "in a kernel"
    assert _warm.warm_ray_wanted(None) and _warm.warm_ray_wanted("127.0.0.1")
    assert not _warm.warm_ray_wanted("0.0.0.0"), "a Ray listening on the network is the user's own"
    monkeypatch.setenv("RTNB_BATCH_RUNS_FILE", "/tmp/x")
    assert not _warm.warm_ray_wanted(None), "rtnb run: a batch run leaves nothing behind"
    monkeypatch.setenv("RTNB_WARM_RAY", "1")
    assert _warm.warm_ray_wanted(None)
    monkeypatch.setenv("RTNB_WARM_RAY", "0")
    monkeypatch.delenv("RTNB_BATCH_RUNS_FILE")
    assert not _warm.warm_ray_wanted(None)
    monkeypatch.delitem(sys.modules, "ipykernel")
    monkeypatch.delenv("RTNB_WARM_RAY")
    assert not _warm.warm_ray_wanted(None), "a plain script embeds, as before"


DYING = r"""
import json, sys, time, psutil, ray, rtnb
s = rtnb.Session(workers=2, cpus_per_worker=0.5, storage=sys.argv[1])
s.start()
ranks = s.run("import os, psutil\n(os.getpid(), psutil.Process().create_time())")
print(json.dumps({
    "ranks": sorted(pid for pid, _ in ranks.values()),
    # A rank made before this kernel started was a spare of the warm Ray's.
    "spares_taken": sum(made < psutil.Process().create_time() for _, made in ranks.values()),
    "cpus_held": ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0),
    "joined": ray.get_runtime_context().gcs_address,
}), flush=True)
busy = (
    "import os, time, rtnb\n"
    f"open(os.path.join({sys.argv[3]!r}, str(rtnb.get_context().world_rank)), 'w').close()\n"
    "while True:\n    time.sleep(0.001)"
)
if sys.argv[2] == "background":
    s.run_background(busy)
print("ready", flush=True)
if sys.argv[2] == "foreground":
    s.run(busy)
time.sleep(600)
"""


def test_a_killed_kernels_ranks_end_at_once(tmp_path):
    """A kernel SIGKILLed idle, during a foreground and during a background cell: its
    ranks end within seconds although nobody reaped the kernel (a zombie, as under a
    Jupyter server), its CPUs are free, and the next kernel takes warm spare ranks."""
    (tmp_path / "nb").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Idle long enough to outlast the gap between two kernels on a slow day (the host
    # is killed at the end): with 10 s the third kernel once met a warm Ray that had
    # just ended, and started its own.
    env.update(RTNB_WARM_RAY="1", RTNB_HOME=str(tmp_path / "home"), RTNB_WARM_RAY_IDLE_S="120")
    host = kernel = None
    took: dict[str, float] = {}
    try:
        for when in ("idle", "foreground", "background"):
            marks = tmp_path / f"running-{when}"
            marks.mkdir()
            kernel = subprocess.Popen(
                [sys.executable, "-c", DYING, str(tmp_path / "runs"), when, str(marks)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=tmp_path / "nb",
            )
            first = kernel.stdout.readline()
            assert first.strip(), kernel.stderr.read()[-3000:]
            seen = json.loads(first)
            assert kernel.stdout.readline().strip() == "ready"
            if host is None:
                state = json.loads(
                    next((tmp_path / "home" / "warm-ray").glob("*.json")).read_text()
                )
                host, warm_address = psutil.Process(state["pid"]), state["address"]
            else:
                # The warm Ray the first kernel started, not a Ray of its own.
                assert seen["joined"] == warm_address, f"{when}: {seen} ({warm_address})"
                # The dead kernel's ranks were replaced by spares this kernel took,
                # and its CPUs were free: only this kernel's group holds any.
                assert seen["spares_taken"] == 2, f"{when}: {seen}"
                assert seen["cpus_held"] == 1.0, f"{when}: the dead kernel's CPUs: {seen}"
            if when != "idle":  # wait until the cell runs on both ranks
                deadline = time.monotonic() + 60
                while len(list(marks.iterdir())) < 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert len(list(marks.iterdir())) == 2, f"{when}: the cell never ran"
            kernel.kill()  # not waited for: the kernel stays a zombie
            killed = time.monotonic()
            assert _wait_gone(seen["ranks"], 20) == [], f"{when}: ranks outlived the kernel"
            took[when] = time.monotonic() - killed
            kernel.wait()
            _wait_for_spares(tmp_path / "home", 2, timeout_s=60)
        print("ranks ended after", took)
        # Typically well under a second; the bound leaves room for a busy machine.
        assert max(took.values()) < 10.0, took
    finally:
        if kernel is not None and kernel.poll() is None:
            # A kernel left alive by a failed assertion would start the warm Ray
            # anew once its host is killed below, and hold it for its idle time.
            kernel.kill()
            kernel.wait()
        if host is not None:
            for proc in _family(host):
                try:
                    proc.kill()
                except psutil.Error:
                    pass


def _rtnb_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rtnb.batch.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_warm_status_and_stop_from_a_notebook_and_the_shell(tmp_path):
    """``%rtnb warm`` names the address, this kernel, the spares and the idle timeout;
    a stop refuses while a kernel uses it, ``--force`` ends it under a live session
    (which then answers at once and starts a fresh one), and an idle one ends with
    every process and its state file."""
    from tests._kernel import Kernel

    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RTNB_WARM_RAY="1", RTNB_HOME=str(home), RTNB_WARM_RAY_IDLE_S="300")
    kernel = Kernel(cwd=str(tmp_path), env=env)
    hosts: list[psutil.Process] = []

    def cell(code: str, ok: bool = True):
        run = kernel.execute(code, timeout=240)
        assert (run.status == "ok") == ok, f"{code!r}: {run.text}\n" + "\n".join(run.traceback)
        return run

    def host_now() -> psutil.Process:
        state = json.loads(next((home / "warm-ray").glob("*.json")).read_text())
        hosts.append(psutil.Process(state["pid"]))
        return hosts[-1]

    try:
        cell(f"%load_ext rtnb\n%rtnb start --workers 2 --storage {tmp_path}/runs --name w")
        kernel_pid = int(cell("import os; print(os.getpid())").stdout.strip())
        host = host_now()
        shown = cell("%rtnb warm").stdout
        assert f"(pid {host.pid}," in shown and "127.0.0.1:" in shown
        assert f"kernels attached: 1: pid {kernel_pid} (this kernel)" in shown
        assert "ranks: 2 in use" in shown and "ends 5 min after the last kernel leaves" in shown
        # The pool makes two spares after the claim, importing torch at low priority;
        # the status tells those still importing from those a next kernel takes warm.
        until(
            "two spare ranks done importing torch",
            lambda: "2 spare (torch imported)\n" in cell("%rtnb warm").stdout,
            120,
            1.0,
        )

        refused = _rtnb_cli("warm", "stop", env=env)
        assert refused.returncode == 2 and f"in use by the kernel(s) with pid {kernel_pid}" in (
            refused.stderr
        ), refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and host.is_running()
        refused_here = cell("%rtnb warm stop", ok=False)
        assert refused_here.stderr.startswith("UsageError: the warm Ray is in use"), refused_here
        assert "--force" in refused_here.stderr and not refused_here.traceback

        # --force under a live session: the session is told, and answers at once.
        cell("%%rtrain --background\nimport time\nfor i in range(600):\n    time.sleep(0.1)")
        forced = cell("%rtnb warm stop --force")
        assert "stopped the warm Ray at" in forced.stdout
        assert _wait_gone([host.pid], 5) == [] and not list((home / "warm-ray").glob("*.json"))
        # The background cell ended with one line: Ray is gone, and what to do.
        waited = cell("%rtnb wait --timeout 30", ok=False)
        assert waited.elapsed_s < 5 and len(waited.traceback) == 1, waited
        assert waited.ename == "ClusterError", waited
        assert re.match(r"cell \[\d+\] ended: the warm Ray is gone", waited.evalue), waited
        assert "%rtnb start --name w --replay" in waited.evalue, waited
        status = cell("%rtnb status")
        shown = status.text + "".join(r.get("text/plain", "") for r in status.results)
        # Answered without Ray (milliseconds); 5 s catches a wait on the dead Ray
        # (Ray's own time-outs are 30-60 s), not a busy machine.
        assert status.elapsed_s < 5 and ": failed," in shown, (forced.text, shown)
        cell("%rtnb stop")
        # A new start in the same kernel starts a fresh warm Ray and replays the run.
        cell(f"%rtnb start --workers 2 --storage {tmp_path}/runs --name w --replay")
        again = host_now()
        assert again.pid != host.pid
        cell("%rtnb stop")
        idle = _rtnb_cli("warm", env=env)
        assert "no kernel attached for" in idle.stdout and "it ends in" in idle.stdout, idle
        stopped = _rtnb_cli("warm", "stop", env=env)
        assert stopped.returncode == 0 and f"(pid {again.pid})" in stopped.stdout, stopped
        family = [again.pid]
        assert _wait_gone(family, 5) == [] and not list((home / "warm-ray").glob("*.json"))
        assert "no warm Ray is running" in _rtnb_cli("warm", env=env).stdout
    finally:
        kernel.shutdown()
        for host in hosts:
            for proc in _family(host):
                try:
                    proc.kill()
                except psutil.Error:
                    pass


def test_the_kernel_that_launches_a_warm_ray_holds_it_until_it_leaves_or_dies():
    """A kernel joins the Ray it launched only after its ``ray.init`` (seconds on a
    slow machine): a short idle time must not end that Ray under it meanwhile. The
    pool's leases alone, no Ray."""
    from rtnb.driver.cluster._warm_host import WarmPool

    held = WarmPool(idle_s=0.05, spares=0, first_kernel=os.getpid())
    nobody = WarmPool(idle_s=0.05, spares=0)
    until("the pool nobody launched ends when idle", nobody.is_idle, 10, poll_s=0.05)
    assert not held.is_idle() and held.usage()["kernels"] == [os.getpid()]
    held.detach(os.getpid())  # the kernel's session stopped
    until("the launching kernel's pool ends once it left", held.is_idle, 10, poll_s=0.05)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    orphaned = WarmPool(idle_s=0.05, spares=0, first_kernel=gone.pid)
    gone.wait()
    until("a pool whose launching kernel died ends", orphaned.is_idle, 10, poll_s=0.05)
