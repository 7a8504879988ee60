"""The warm Ray is invisible to the user's own Ray: with a notebook holding it, and
after the notebook detached, `ray status`, `ray.init(address="auto")`, `ray.init()`,
`ray job submit` and a `TorchTrainer.fit()` behave as on a machine without rtnb.

The commands run in tests/_neighbour.py inside a fresh PID and mount namespace
(its own /proc, /tmp and HOME): there "the machine" has no Ray but what the
scenario starts, and everything it started ends with it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests._background import scenario as background_scenario
from tests._heads import RAYS_START_GAVE_UP
from tests.conftest import missing

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.background("warm-neighbour"),
]
# Its whole run, a few times what it takes alone beside the suite.
NEIGHBOUR_TIMEOUT_S = 900

SCENARIO = Path(__file__).with_name("_neighbour.py")
NOT_FOUND = "Could not find any running Ray instance"


def _namespace_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", "mount -t tmpfs t /tmp"],
        capture_output=True,
    )
    return probe.returncode == 0


def _needed_under_tmp() -> list[str]:
    """What the scenario runs from that a fresh /tmp would hide: a clone under /tmp
    (as CI may make) with its venv, or an interpreter installed there."""
    paths = {
        os.path.realpath(p)
        for p in (SCENARIO.parent.parent, sys.prefix, sys.base_prefix, sys.executable)
    }
    under = sorted(p for p in paths if p.startswith("/tmp/"))
    return [p for p in under if not any(p.startswith(q + "/") for q in under)]


def _fresh_tmp_keeping(paths: list[str]) -> str:
    """Shell steps that mount an empty /tmp in this namespace and bind ``paths`` back
    into it (held on a private tmpfs at /mnt meanwhile)."""
    if not paths:
        return "mount -t tmpfs tmpfs /tmp"
    steps = ["mount -t tmpfs tmpfs /mnt"]
    for i, path in enumerate(paths):
        steps += [f"mkdir /mnt/keep{i}", f'mount --bind "{path}" /mnt/keep{i}']
    steps.append("mount -t tmpfs tmpfs /tmp")
    for i, path in enumerate(paths):
        steps += [f'mkdir -p "{path}"', f'mount --move /mnt/keep{i} "{path}"']
    return " && ".join(steps)


class NeighbourScenario:
    """tests/_neighbour.py in its own PID and mount namespace."""

    def __init__(self) -> None:
        self.why_not = (
            ""
            if _namespace_works()
            else ("unshare cannot make a PID and mount namespace here (needs root)")
        )
        self._proc: subprocess.Popen | None = None
        self._results: dict | None = None
        if self.why_not:
            return
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RTNB_"))
        }
        env.update(
            HOME="/tmp/home",
            RTNB_HOME="/tmp/rtnb-home",
            NEIGHBOUR_WORK="/tmp/work",
            RTNB_WARM_RAY_IDLE_S="120",
            RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.1",
            PYTHONPATH=str(SCENARIO.parent.parent),
        )
        script = (
            _fresh_tmp_keeping(_needed_under_tmp())
            + " && mkdir -p /tmp/home /tmp/work && "
            + f'exec "{sys.executable}" "{SCENARIO}"'
        )
        # Files, not pipes: nobody reads a pipe while other tests run.
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
            stdout=self._out,
            stderr=self._err,
            text=True,
            env=env,
        )

    def results(self) -> dict:
        if self._results is None:
            assert self._proc is not None
            try:
                self._proc.wait(timeout=NEIGHBOUR_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            stdout, stderr = (_read_all(f) for f in (self._out, self._err))
            line = next((x for x in stdout.splitlines() if x.startswith("RESULTS ")), None)
            assert line is not None, stdout[-3000:] + stderr[-3000:]
            self._results = json.loads(line[len("RESULTS ") :])
        return self._results

    def close(self) -> None:
        # Killing the namespace's first process ends every process in it.
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _read_all(file) -> str:
    file.seek(0)
    return file.read()


def _failed_beside_the_suite(results: dict) -> str:
    """Why a run of the scenario is not one to assert on: it ended before its last
    step, or Ray's own node start gave up in a step (a starved Ray, not what the
    scenario is about); "" otherwise."""
    if "why_not" in results:
        return ""
    if "detached.fit" not in results:
        return f"it ended after {list(results)[-1:] or 'no step'}"
    gave_up = [
        name
        for name, step in results.items()
        if isinstance(step, dict)
        and step.get("rc") not in (0, None)
        and RAYS_START_GAVE_UP in step.get("out", "")
    ]
    return f"Ray's own node start gave up in {gave_up}" if gave_up else ""


@background_scenario("warm-neighbour", failed_because=_failed_beside_the_suite)
def _neighbour(folder: Path) -> dict:
    """Run in the suite's background lane (tests/_background.py): two minutes of
    Ray starts and waits for the user's head, its job agent and a fit."""
    scenario = NeighbourScenario()
    if scenario.why_not:
        return {"why_not": scenario.why_not}
    try:
        return scenario.results()
    finally:
        scenario.close()


@pytest.fixture
def results(background) -> dict:
    if "why_not" in background:
        missing(background["why_not"])
    return background


def test_without_a_user_cluster_ray_finds_nothing_at_once(results):
    """With the warm Ray idle after a notebook detached, and with a notebook holding
    it: as on a machine without Ray.

    "At once" is Ray's own message, not a time: Ray says it found no instance only
    when it found no address to try, and an address it found (the warm Ray's, or a
    stale one) makes it connect or wait on that Ray, then fail otherwise. A wait that
    never ends is the run's 120-s bound (rc None). CI's slow day took 27.5 s for a
    `ray status` beside a notebook's ranks that found nothing, as it should."""
    for name in ("status", "auto"):
        bare = results[f"bare.{name}"]
        assert bare["rc"] not in (0, None) and NOT_FOUND in bare["out"], bare
        for when in ("idle", "warm"):
            seen = results[f"{when}.{name}"]
            assert seen["rc"] == bare["rc"] and NOT_FOUND in seen["out"], (when, name, seen)


def test_ray_init_without_a_user_cluster_starts_its_own(results):
    assert results["first.detach"]["line"] == "detached"
    plain = results["idle.plain"]
    port = results["warm.state"]["address"].rpartition(":")[2]
    assert plain["rc"] == 0 and "GCS " in plain["out"], plain["out"]
    gcs = plain["out"].split("GCS ", 1)[1].split()[0]
    assert not gcs.endswith(f":{port}"), f"ray.init() joined the warm Ray at {gcs}"


def test_the_warm_ray_leaves_no_trace_where_ray_looks(results):
    state, idle = results["warm.state"], results["idle.trace"]
    for seen in (idle, state):
        assert not seen["home_ray"], "~/.ray/auth_token written: the user's ray start turns auth on"
    assert idle["tmp_ray"] == [], f"the warm Ray's session files in /tmp/ray: {idle['tmp_ray']}"
    port = state["address"].rpartition(":")[2]
    for name, result in results.items():
        if "out" in result:
            assert f":{port}" not in result["out"], f"{name} saw the warm Ray: {result['out']}"


def test_the_users_cluster_is_the_one_found(results):
    assert results["user.wait"]["rc"] == 0, results["user.wait"]
    status = results["user.status"]
    assert status["rc"] == 0 and "0.0/3.0 CPU" in status["out"], status["out"]
    for name in ("user.auto", "user.plain", "detached.auto", "detached.plain"):
        assert results[name]["rc"] == 0 and ":6379" in results[name]["out"], results[name]
    assert results["detach"]["line"] == "detached"
    detached = results["detached.status"]
    assert detached["rc"] == 0 and "0.0/3.0 CPU" in detached["out"], detached["out"]


@pytest.mark.parametrize("when", ["user", "detached"])
def test_jobs_and_ray_train_run_on_the_users_cluster(results, when):
    """With the notebook holding the warm Ray, and after it detached."""
    job = results[f"{when}.job"]
    assert job["rc"] == 0 and "job ran" in job["out"], job["out"]
    fit = results[f"{when}.fit"]
    assert fit["rc"] == 0 and "FIT OK" in fit["out"], fit["out"]
    assert "multiple active Ray instances" not in fit["out"], fit["out"]
    # Nothing of rtnb's Ray reaches the user's output: not its session files, its
    # renamed raylet or its address (checked for every command above).
    for trace in ("rtnb-warm", "rtnb.driver"):
        assert trace not in fit["out"] and trace not in job["out"], (trace, fit["out"])


def test_everything_the_warm_ray_opens_listens_on_loopback_only(results):
    sockets = results["warm.listen"]["sockets"]
    names = " ".join(name for _, _, name, _ in sockets)
    assert "gcs_server" in names and "WarmPool" in names, names
    # The group's two ranks and the pool's spares (probed once they were back).
    rank_processes = {pid for _, _, name, pid in sockets if "RankActor" in name}
    assert len(rank_processes) >= 4, sockets

    def loopback(ip: str) -> bool:
        address = ipaddress.ip_address(ip)
        return (getattr(address, "ipv4_mapped", None) or address).is_loopback

    exposed = [s for s in sockets if not loopback(s[0])]
    assert not exposed, f"listening beyond loopback: {exposed}"
