"""The kernel outlives its Ray: the warm Ray's host, its GCS alone, or a
`ray start --head` used with --address is SIGKILLed during a foreground and,
after a new start at once, during a background cell. Each cell ends in about a
second with one line naming what died and what to do; status and stop answer at once;
the process lives on past Ray's own "GCS gone, exit" timeout; a new start in the
same process works, and --replay brings the ranks' variables back from the journal.

Ray's timeout is 60 s by default; these tests shorten it to RAYS_RULE_S (Ray reads it
from the environment) and tell rtnb to take that for Ray's default and lift it all the
same, so the kernel outliving it takes seconds, not a minute. The last test shows
the shortened rule does end a driver rtnb did not make. Every scenario, mostly
waiting, runs beside the rest of the suite (tests/_background.py); the tests assert
on what it printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests._background import scenario as background_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1300)]

RAYS_RULE_S = 8
# One scenario's whole run (three starts, two kills, the rule's wait): ~70 s alone,
# and 280 s ran out once beside CI's suite on a slow day.
SCENARIO_TIMEOUT_S = 420
RAYS_RULE = {
    "RAY_gcs_rpc_server_reconnect_timeout_s": str(RAYS_RULE_S),
    "RTNB_LIFT_RAY_RULE_OVER_ENV": "1",
}

# A user's `ray start --head` on a free loopback port: (its process, its address),
# up once its raylet says it started (tests/_heads.py; the scripts run outside pytest,
# so the repository is appended to their path for it). Its dashboard (started even
# with --include-dashboard=false) is off Ray's default port, which the neighbour
# scenario's user head needs; the head ends with the script whatever fails in it.
HEAD = r"""
import atexit, os, signal, socket, subprocess, sys, tempfile, time
sys.path.append(REPO)
from tests._heads import start_head_until_up

def free_port():
    port = socket.socket(); port.bind(("127.0.0.1", 0)); free = port.getsockname()[1]; port.close()
    return free

def end(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

def user_head():
    free, temp = free_port(), tempfile.mkdtemp(prefix="rl-")
    def start():
        proc = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
             f"--port={free}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
             "--include-dashboard=false", f"--dashboard-port={free_port()}",
             f"--temp-dir={temp}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        atexit.register(end, proc)
        return proc
    return start_head_until_up(start, temp), f"127.0.0.1:{free}"
""".replace("REPO", repr(str(Path(__file__).resolve().parent.parent)))

KERNEL = (
    HEAD
    + r"""
import json, pathlib, signal, threading
import psutil, rtnb

victim, storage = sys.argv[1], sys.argv[2]
out = {"kills": []}
options = dict(workers=2, cpus_per_worker=0.5, storage=storage, name="lost")
head = None

def start_head():
    global head
    head, options["address"] = user_head()

def kill():
    if victim == "address":
        os.killpg(head.pid, signal.SIGKILL)
        return
    # The warm Ray this session joined: the one whose host still has its GCS (the
    # Ray lost in the first round may not have cleared its state file, nor reaped
    # its killed GCS, yet).
    for state in (pathlib.Path(os.environ["RTNB_HOME"]) / "warm-ray").glob("*.json"):
        try:
            host = psutil.Process(json.loads(state.read_text())["pid"])
            gcs = [
                p for p in host.children(recursive=True)
                if "gcs_server" in p.name() and p.status() != psutil.STATUS_ZOMBIE
            ]
        except (OSError, ValueError, psutil.Error):
            continue
        if gcs:
            if victim == "gcs":
                lost_ray.extend(p for p in host.children(recursive=True) if p.pid != gcs[0].pid)
            (host if victim == "host" else gcs[0]).kill()
            return
    raise RuntimeError("no warm Ray with a GCS to kill")

lost_ray = []  # the processes of a warm Ray whose GCS was killed

def alive(p):
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
loop = "import time, rtnb\nfor i in range(100000):\n    time.sleep(0.02)\n    rtnb.report({'i': i})\n"
first_kill = None

def stage(what):
    # Where the scenario stood, should it fail or hang (on stderr, in the failure).
    print(f"{time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)

for n, how in enumerate(("foreground", "background")):
    # The second start comes straight after the first loss (no waiting for the dead
    # Ray's processes to go), and replays the run onto the new Ray.
    if victim == "address":
        start_head()
    stage(f"start {n}")
    s = rtnb.Session(**options, replay=n > 0)
    s.start()
    stage(f"started {n}")
    kill_out = {"how": how, "x": s.run("x") if n else None}
    if n == 0:
        s.run("x = 41")
    # The kill comes once the loop is running on the ranks (its first report), not
    # after a fixed time, which a slow start could outlast.
    running = threading.Event()
    unsubscribe = s.metrics.subscribe(lambda rank, batch: running.set())
    killed_at = []
    def kill_when_running():
        stage("the loop reported" if running.wait(120) else "no report in 120 s")
        killed_at.append(time.monotonic())
        kill()
    killed = threading.Thread(target=kill_when_running)
    killed.start()
    started = time.monotonic()
    try:
        if how == "background":
            handle = s.run_background(loop)
            handle.wait(30)
        else:
            s.run(loop)
    except Exception as exc:
        kill_out["error"] = [type(exc).__name__, str(exc)]
    killed.join()
    stage(f"killed during the {how} cell")
    unsubscribe()
    first_kill = first_kill or killed_at[0]
    kill_out["ended_after_kill_s"] = time.monotonic() - killed_at[0]
    t = time.monotonic(); status = s.status(); kill_out["status"] = [status.state, status.cell, time.monotonic() - t]
    t = time.monotonic(); s.stop(); kill_out["stop_s"] = time.monotonic() - t
    out["kills"].append(kill_out)
# Ray's driver ends its process when its GCS stopped answering for the rule's time;
# this one lives on to twice that. (Waited out once, in the real kernel that joined the
# warm Ray: every join of rtnb's goes through the one ray.init that lifts the rule.)
if victim == "host":
    rule = float(os.environ["RAY_gcs_rpc_server_reconnect_timeout_s"])
    time.sleep(max(0.0, 2 * rule + 2 - (time.monotonic() - first_kill)))
out["alive_after_s"] = time.monotonic() - first_kill
if victim == "address":  # the user starts a head again
    start_head()
stage("start again")
again = rtnb.Session(**options, replay=True)
again.start()
out["after"] = again.run("x + 1")
again.stop()
if head is not None:
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
# A Ray whose GCS was lost leaves no process behind (its raylet's agents included).
deadline = time.monotonic() + 60
while time.monotonic() < deadline and any(alive(p) for p in lost_ray):
    time.sleep(0.5)
out["strays"] = [f"{p.pid} {p.name()}" for p in lost_ray if alive(p)]
print("OUT " + json.dumps(out), flush=True)
"""
)


def _in_a_jupyter_kernel(folder: Path, victim: str, env: dict[str, str]) -> str:
    """The script run as cells of a real Jupyter kernel (ipykernel's threads, signal
    handlers and event loop around the Ray driver); the kernel must answer after."""
    from tests._kernel import Kernel

    kernel = Kernel(cwd=str(folder), env=env)
    try:
        run = kernel.execute(
            f"import sys\nsys.argv = ['kernel', {victim!r}, {str(folder)!r}]\n"
            f"exec(compile({KERNEL!r}, '<ray-lost>', 'exec'))",
            timeout=SCENARIO_TIMEOUT_S,
        )
        assert run.status == "ok", run.text + "\n".join(run.traceback)
        alive = kernel.execute("print(6 * 7)", timeout=30)
        assert alive.status == "ok" and alive.stdout.strip() == "42", alive.text
        return run.stdout
    finally:
        kernel.shutdown()


def _outlived(victim: str, where: str) -> Callable[[Path], str]:
    def run(folder: Path) -> str:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RTNB_WARM_RAY="1", RTNB_HOME=str(folder / "home"), RTNB_WARM_RAY_IDLE_S="5")
        env.update(RAYS_RULE)
        if where == "kernel":
            return _in_a_jupyter_kernel(folder, victim, env)
        proc = subprocess.run(
            [sys.executable, "-c", KERNEL, victim, str(folder)],
            capture_output=True,
            text=True,
            env=env,
            cwd=folder,
            timeout=SCENARIO_TIMEOUT_S,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    return run


VICTIMS = [("host", "kernel"), ("gcs", "process"), ("address", "process")]
for _victim, _where in VICTIMS:
    background_scenario(f"ray-lost-{_victim}-{_where}")(_outlived(_victim, _where))


@pytest.mark.parametrize(
    ("victim", "where"),
    [
        pytest.param(v, w, marks=pytest.mark.background(f"ray-lost-{v}-{w}"), id=f"{v}-{w}")
        for v, w in VICTIMS
    ],
)
def test_the_kernel_outlives_its_ray(background, victim, where):
    """Each victim killed during a foreground cell, then (after an immediate new
    start with --replay) during a background cell, in one kernel or process."""
    stdout = background
    line = next(x for x in stdout.splitlines() if x.startswith("OUT "))
    out = json.loads(line[4:])
    print(victim, [(k["how"], round(k["ended_after_kill_s"], 2)) for k in out["kills"]])
    for kill in out["kills"]:
        kind, text = kill["error"]
        assert kind == "ClusterError", kill
        assert "is gone" in text and "--name lost --replay" in text, text
        assert "\n" not in text
        # Bounds ~10x what they take (about 1 s; milliseconds): they catch a wait on
        # the dead Ray (Ray's own time-outs are 30-60 s), not a busy machine.
        assert kill["ended_after_kill_s"] < 10, kill
        state, cell, status_s = kill["status"]
        assert state == "failed" and "is gone" in cell and status_s < 5, kill
        assert kill["stop_s"] < 5, kill
    # The immediate new start had the ranks' variables back from the journal.
    assert out["kills"][1]["x"] in ({"0": 41, "1": 41}, {0: 41, 1: 41}), out["kills"][1]
    if victim == "host":
        assert out["alive_after_s"] >= 2 * RAYS_RULE_S, out
    assert out["after"] in ({"0": 42, "1": 42}, {0: 42, 1: 42}), out["after"]
    assert out["strays"] == [], f"the lost Ray left {out['strays']} running"


# A Ray driver rtnb has no part in, its GCS killed: Ray's rule ends it.
PLAIN_DRIVER = (
    HEAD
    + r"""
import signal
import ray

head, address = user_head()
ray.init(address=address)
os.killpg(head.pid, signal.SIGKILL)
print("KILLED", time.time(), flush=True)
time.sleep(60)
print("ALIVE", flush=True)
"""
)

USER_INIT = (
    HEAD
    + r"""
import signal, threading
import ray, rtnb

head, address = user_head()
ray.init(address=address)  # the user's own, before rtnb
s = rtnb.Session(workers=2, cpus_per_worker=0.5, storage=sys.argv[1], name="mine")
s.start()
killed = time.monotonic()
threading.Timer(1.5, lambda: os.killpg(head.pid, signal.SIGKILL)).start()
try:
    s.run("import time\nwhile True:\n    time.sleep(0.05)")
except Exception as exc:
    print("ERROR", type(exc).__name__, str(exc), flush=True)
rule = float(os.environ["RAY_gcs_rpc_server_reconnect_timeout_s"])
time.sleep(max(0.0, rule + 5 - (time.monotonic() - killed)))
print("ALIVE", flush=True)
"""
)


def _run_script(
    script: str, folder: Path, rule_s: int = RAYS_RULE_S, timeout: float = SCENARIO_TIMEOUT_S
) -> tuple[subprocess.CompletedProcess, float]:
    """The script's outcome and the wall-clock time it ended (a head that came up
    slowly on a busy day is no part of how long the script lived after its kill).
    ``timeout`` bounds a script that never ends, not its pace: CI's slow day ran out
    of 120 s twice in the user-init script's head and group starts beside the suite."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAYS_RULE, RAY_gcs_rpc_server_reconnect_timeout_s=str(rule_s))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(folder)],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=timeout,
    )
    return proc, time.time()


@background_scenario("ray-lost-plain-driver")
def _plain_driver(folder: Path) -> tuple[subprocess.CompletedProcess, float]:
    return _run_script(PLAIN_DRIVER, folder)


# Here nothing lifts the rule: the watch's ray.shutdown (~1.5 s to notice, ~5 s to
# shut down) races it, so the rule stays long enough for a slow day.
@background_scenario("ray-lost-user-init")
def _user_init(folder: Path) -> tuple[subprocess.CompletedProcess, float]:
    return _run_script(USER_INIT, folder, rule_s=30)


@pytest.mark.background("ray-lost-plain-driver")
def test_the_shortened_rule_ends_a_ray_driver_rtnb_has_no_part_in(background):
    """The control of the tests above: with Ray's timeout at RAYS_RULE_S, a plain
    Ray driver whose GCS died is ended by Ray, so a kernel that outlives twice that
    outlived Ray's rule."""
    proc, ended_at = background
    killed = next((x for x in proc.stdout.splitlines() if x.startswith("KILLED ")), None)
    assert killed is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ALIVE" not in proc.stdout and proc.returncode != 0, (proc.returncode, proc.stdout)
    lived = ended_at - float(killed.split()[1])
    assert lived < 60, f"Ray's rule, not the script's end, ended it ({lived:.0f} s after the kill)"


@pytest.mark.background("ray-lost-user-init")
def test_a_kernel_whose_own_ray_init_came_first_lives_on_and_is_told_its_connection_closed(
    background,
):
    """A Ray driver the user's code made keeps Ray's rule, but rtnb's watch closes it
    first: the cell ends at once, the kernel outlives the rule, and its line says the
    user's own connection closed too."""
    proc, _ended_at = background
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ERROR ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert line.startswith("ERROR ClusterError "), line
    assert "--name mine --replay" in line and "own ray.init()" in line, line
    assert "is closed too (the kernel lives on)" in line, line
    assert "ALIVE" in proc.stdout and proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
