"""What rtnb keeps out of start-up: jsonschema's IRI grammar, built only if used, and
a Ray head's wait for its agents."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from rtnb.core._startup import LAZY_IMPORTS_PATH, with_lazy_imports
from tests._heads import RAYLET_STARTED

PROBE = r"""
import json, sys, time
started = time.perf_counter()
import ray  # imports jsonschema, which imports rfc3987_syntax when installed
import_s = time.perf_counter() - started
stand_in = sys.modules["rfc3987_syntax"].__file__
from jsonschema import FormatChecker
checker = FormatChecker()
ok = [checker.conforms("http://example.com/ä", "iri"), checker.conforms("http://exa mple", "iri")]
print(json.dumps({"stand_in": stand_in, "real": sys.modules["rfc3987_syntax"].__file__,
                  "ok": ok, "import_s": import_s}))
"""


def test_ray_processes_import_the_iri_grammar_only_when_an_iri_is_validated():
    pytest.importorskip("rfc3987_syntax")  # the package whose import costs seconds
    env = {**os.environ, "PYTHONPATH": with_lazy_imports(os.environ.get("PYTHONPATH"))}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["stand_in"].startswith(LAZY_IMPORTS_PATH), "import ray found the stand-in"
    assert not seen["real"].startswith(LAZY_IMPORTS_PATH), "first use loaded the real module"
    assert seen["ok"] == [True, False], "IRI validation behaves as without rtnb"


def test_the_users_pythonpath_is_kept_after_the_stand_ins():
    joined = with_lazy_imports(os.pathsep.join(["/a", LAZY_IMPORTS_PATH, "/b"]))
    assert joined.split(os.pathsep) == [LAZY_IMPORTS_PATH, "/a", "/b"]
    assert with_lazy_imports(None) == LAZY_IMPORTS_PATH


EMBEDDED_START = r"""
import json, os, pathlib, sys
import psutil, ray
from rtnb.driver.cluster._embedded import start_embedded_ray
private = pathlib.Path(sys.argv[1])
start_embedded_ray(ray, num_cpus=1, private_dir=private)
try:
    @ray.remote(num_cpus=0, runtime_env={"env_vars": {"ASKED": "yes"}})
    def asked():
        return os.environ["ASKED"]
    env_var = ray.get(asked.remote(), timeout=120)  # through the runtime env agent
    node = ray._private.worker.global_worker.node
    agents = {}
    for proc in psutil.Process(node.all_processes["raylet"][0].process.pid).children():
        agents[proc.name()] = {"nice": proc.nice(), "ports": sorted(
            c.laddr.port for c in proc.net_connections("tcp") if c.status == "LISTEN")}
    print(json.dumps({"env_var": env_var, "agents": agents, "logs": node.get_logs_dir_path(),
                      "nice": os.nice(0),
                      "ports": [node.runtime_env_agent_port, node.dashboard_agent_listen_port]}))
finally:
    ray.shutdown()
"""


def _first_time(log: str, marker: str) -> str:
    line = next(line for line in log.splitlines() if marker in line)
    return line.lstrip("[")[:23].replace("\t", " ")  # "2026-11-29 16:35:55,243"


def test_a_started_ray_registers_its_node_before_its_agents_are_up():
    """The raylet is told the agents' ports up front, so the head's start does not
    wait for the dashboard agent to import its modules; the agents start at a
    lower CPU priority, bind the ports they were given, and serve (a task with a
    runtime env passes through the runtime env agent)."""
    pytest.importorskip("psutil")
    # Not under pytest's tmp_path: Ray's socket paths below it would pass 107 bytes.
    private = tempfile.mkdtemp(prefix="rtnb-agents-", dir="/tmp")
    try:
        out = subprocess.run(
            [sys.executable, "-c", EMBEDDED_START, private],
            capture_output=True,
            text=True,
            timeout=300,
            # A Ray of its own, not the suite's cluster that RAY_ADDRESS names, with
            # the ranks' priority as a user gets it (not the suite's).
            env={
                k: v
                for k, v in os.environ.items()
                if k not in ("RAY_ADDRESS", "RAY_worker_niceness")
            },
        )
        assert out.returncode == 0, out.stderr[-2000:]
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        with open(os.path.join(seen["logs"], "raylet.out")) as raylet:
            registered = _first_time(raylet.read(), RAYLET_STARTED)
        with open(os.path.join(seen["logs"], "dashboard_agent.log")) as agent:
            agent_up = _first_time(agent.read(), "Dashboard agent grpc address")
    finally:
        shutil.rmtree(private, ignore_errors=True)
    assert seen["env_var"] == "yes"
    children = seen["agents"]
    agents = {name: child for name, child in children.items() if name.endswith("Agent")}
    assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= set(agents), children
    assert all(agent["nice"] >= 10 for agent in agents.values()), agents
    # Its workers (the ranks to be) at the driver's priority, not Ray's niceness 15.
    workers = [child for name, child in children.items() if name.startswith("ray::IDLE")]
    assert workers and all(w["nice"] == seen["nice"] for w in workers), (seen["nice"], children)
    runtime_env_port, listen_port = seen["ports"]
    assert runtime_env_port in agents["ray::RuntimeEnvAgent"]["ports"]
    assert listen_port in agents["ray::DashboardAgent"]["ports"]
    assert registered < agent_up, (registered, agent_up)
