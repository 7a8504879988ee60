"""The user's own Ray tools beside a live warm Ray, run as a user would run them.

Run by tests/test_warm_neighbour.py inside a fresh PID and mount namespace with
its own /tmp and HOME, so "the machine" has no Ray but what this script starts
(the test session's own cluster would otherwise be found by Ray's process scan).
Prints one JSON line: what each command did, in order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests._heads import RAYS_START_GAVE_UP, start_head_until_up

BIN = Path(sys.executable).parent
WORK = Path(os.environ["NEIGHBOUR_WORK"])
results: dict[str, dict] = {}

KERNEL = r"""
import sys, rtnb
s = rtnb.Session(workers=2, cpus_per_worker=0.5, storage=sys.argv[1])
s.start()
s.run("x = 1")
print("holding", flush=True)
sys.stdin.readline()
s.stop()
print("detached", flush=True)
sys.stdin.readline()
"""

AUTO = r"""
import ray
ray.init(address="auto")
print("GCS", ray.get_runtime_context().gcs_address)
"""

PLAIN = r"""
import ray
ray.init()
print("GCS", ray.get_runtime_context().gcs_address)
"""

FIT = r"""
import os, ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
ray.init()

def loop(config):
    import ray.train
    ray.train.report({"x": 1.0})

TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=1),
             run_config=RunConfig(storage_path=os.environ["NEIGHBOUR_WORK"] + "/fit")).fit()
print("FIT OK")
"""


def run(
    name: str, args: list[str], timeout: float = 120.0, home: str | None = None, tries: int = 1
) -> None:
    """Run ``args`` and keep what it printed under ``name``; ``tries`` > 1 runs it again
    when Ray's own node start gave up (not what the scenario is about)."""
    env = {**os.environ, "HOME": home} if home else None
    for attempt in range(1, tries + 1):
        started = time.monotonic()
        try:
            out = subprocess.run(
                args, capture_output=True, text=True, timeout=timeout, cwd=WORK, env=env
            )
            code, stdout, stderr = out.returncode, out.stdout, out.stderr
        except subprocess.TimeoutExpired as exc:
            code = None
            stdout = (exc.stdout or b"").decode(errors="replace")
            stderr = (exc.stderr or b"").decode(errors="replace")
        # What the script printed, then what Ray logged: a busy Ray logs tracebacks after
        # a script's last line (Train's controller under load), which a tail of both cut.
        text = stdout[-4000:] + "\n" + stderr[-50_000:]
        results[name] = {
            "rc": code,
            "s": round(time.monotonic() - started, 1),
            "out": text,
            "tries": attempt,
        }
        if RAYS_START_GAVE_UP not in stderr:
            return


def python(
    name: str, code: str, timeout: float = 120.0, home: str | None = None, tries: int = 1
) -> None:
    run(name, [sys.executable, "-c", code], timeout, home, tries)


def start_user_head() -> subprocess.Popen:
    """`ray start --head` as a user types it (its sessions in Ray's default folder,
    this namespace's own /tmp/ray, where an earlier `ray.init()` left one), up once
    its raylet says it started (tests/_heads.py)."""
    return start_head_until_up(
        lambda: subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=3"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd=WORK,
        ),
        "/tmp/ray",
    )


def listening() -> list[list]:
    """Every listening socket on this "machine": the warm Ray, its spare ranks, the
    kernel and its group's ranks (nothing else runs in this namespace yet)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append([conn.laddr.ip, conn.laddr.port, proc.name(), proc.pid])
        except psutil.Error:
            pass
    return found


def warm_state() -> dict:
    return json.loads(next((Path(os.environ["RTNB_HOME"]) / "warm-ray").glob("*.json")).read_text())


def listening_with_spares(ranks: int, timeout_s: float) -> list[list]:
    """The listening sockets once ``ranks`` rank processes listen: the group's and
    the spares the pool makes a few seconds after a claim (so they are probed too)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = listening()
        if len({pid for *_, name, pid in found if "RankActor" in name}) >= ranks:
            return found
        if time.monotonic() >= deadline:
            return found
        time.sleep(0.5)


def start_kernel() -> subprocess.Popen:
    """A notebook kernel on the warm Ray (it starts one if none runs), holding its
    group until told to detach."""
    kernel = subprocess.Popen(
        [sys.executable, "-c", KERNEL, str(WORK / "runs")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=WORK,
        env={**os.environ, "RTNB_WARM_RAY": "1"},
    )
    if kernel.stdout.readline().strip() != "holding":
        raise SystemExit(f"kernel did not start: {kernel.stderr.read()[-3000:]}")
    return kernel


def detach(kernel: subprocess.Popen) -> str:
    kernel.stdin.write("\n")
    kernel.stdin.flush()
    return kernel.stdout.readline().strip()


def without_user_cluster(prefix: str) -> None:
    # A bound for a wait that never ends, not a time to meet: CI's slow day took 27.5 s
    # for a `ray status` beside a notebook's ranks (9 s with nothing running).
    run(f"{prefix}status", [str(BIN / "ray"), "status"], 120)
    python(f"{prefix}auto", AUTO, 120)


def main() -> None:
    without_user_cluster("bare.")
    # A first notebook starts the warm Ray and leaves: with no cluster of the user's,
    # the idle warm Ray is as invisible as a held one.
    first = start_kernel()
    results["first.detach"] = {"line": detach(first)}
    without_user_cluster("idle.")
    # Where Ray looks for a machine's Ray, before anything of the user's ran.
    results["idle.trace"] = {
        "home_ray": (Path.home() / ".ray").exists(),
        "tmp_ray": sorted(os.listdir("/tmp/ray")) if os.path.isdir("/tmp/ray") else [],
    }
    # With no cluster of the user's, ray.init() starts a Ray of its own, not the idle
    # warm one. In a HOME of its own: the Ray it starts writes ~/.ray/auth_token,
    # which (rtnb or not) turns token auth on for the user's later `ray start`.
    python("idle.plain", PLAIN + "ray.shutdown()\n", 120, home=str(WORK / "plain-home"), tries=3)
    first.kill()
    kernel = start_kernel()
    head = None
    try:
        state = warm_state()
        results["warm.state"] = {
            "address": state["address"],
            "home_ray": (Path.home() / ".ray").exists(),
        }
        results["warm.listen"] = {"sockets": listening_with_spares(4, 60)}
        without_user_cluster("warm.")
        head = start_user_head()
        python(
            "user.wait",
            "import ray, time\nfor _ in range(120):\n"
            "    try:\n        ray.init(address='auto'); break\n"
            "    except Exception: time.sleep(0.5)\n",
            90,
        )
        # A new head publishes its status a few seconds after its GCS answers
        # ("No cluster status" until then), with or without rtnb.
        for _ in range(30):
            run("user.status", [str(BIN / "ray"), "status"], 60)
            if "No cluster status" not in results["user.status"]["out"]:
                break
            time.sleep(1)
        python("user.auto", AUTO, 60)
        python("user.plain", PLAIN, 60)
        # The head's job agent registers after its dashboard answers ("No available
        # agent ... try again later" until then), with or without rtnb; beside a
        # busy test suite on 2 cores that took over a minute.
        job_submit = [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            "http://127.0.0.1:8265",
            "--",
            sys.executable,
            "-c",
            "print('job ran')",
        ]
        # Over a minute beside the suite on 2 cores; 462 s of scenario at half the
        # machine ran out of a 240 s bound here: ten times the usual minute.
        deadline = time.monotonic() + 600
        while True:
            run("user.job", job_submit, 180)
            if "No available agent" not in results["user.job"]["out"]:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(5)
        python("user.fit", FIT, 240)
        results["detach"] = {"line": detach(kernel)}
        # Detached: the warm Ray idles, still alive, for its idle time. The fit's
        # workers give their CPUs back a moment after it returned (Ray frees them
        # asynchronously), so the status is read until they are back.
        for _ in range(30):
            run("detached.status", [str(BIN / "ray"), "status"], 60)
            if "0.0/3.0 CPU" in results["detached.status"]["out"]:
                break
            time.sleep(1)
        python("detached.auto", AUTO, 60)
        python("detached.plain", PLAIN, 60)
        run("detached.job", job_submit, 180)
        python("detached.fit", FIT, 240)
    finally:
        if head is not None:
            os.killpg(head.pid, signal.SIGKILL)
        kernel.kill()
        print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
