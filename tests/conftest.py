"""Shared fixtures: one real local Ray cluster per test session.

The cluster is a real ``ray start --head --block`` on loopback, so the same
cluster serves this process (``ray.init(address=...)``), the Jupyter kernels the
tests start (through ``RAY_ADDRESS``) and the remote-connection tests. It is torn
down by process group at the end; ``ray stop`` is never used because it kills
every Ray process on the machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CLUSTER_CPUS = 4  # logical CPUs: two 2-rank groups may coexist (kernel + this process)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class HeadNode:
    def __init__(self) -> None:
        self.port = free_port()
        self.client_port = free_port()
        self.temp_dir = tempfile.mkdtemp(prefix="rtnb-ray-")
        self.address = f"127.0.0.1:{self.port}"
        self.client_address = f"ray://127.0.0.1:{self.client_port}"
        self.log = Path(self.temp_dir) / "head.log"
        ray_bin = Path(sys.executable).parent / "ray"
        cmd = [
            str(ray_bin),
            "start",
            "--head",
            "--block",
            f"--port={self.port}",
            f"--ray-client-server-port={self.client_port}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={CLUSTER_CPUS}",
            "--object-store-memory=300000000",
            "--include-dashboard=false",
            f"--temp-dir={self.temp_dir}",
        ]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 60
        for port in (self.port, self.client_port):
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"ray start failed:\n{self.log.read_text()[-3000:]}")
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                        break
                except OSError:
                    time.sleep(0.2)
            else:
                self.stop()
                raise RuntimeError(f"ray head did not open port {port} within 60 s")

    def stop(self) -> None:
        # ray start --block drains for up to 30 s on SIGTERM; its processes share our
        # process group, so end them all directly.
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=3)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def ray_head():
    head = HeadNode()
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = head.address
    try:
        yield head
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        finally:
            head.stop()
            if old is None:
                os.environ.pop("RAY_ADDRESS", None)
            else:
                os.environ["RAY_ADDRESS"] = old


@pytest.fixture(scope="session")
def ray_cluster(ray_head):
    """This test process connected to the session's cluster."""
    from rtnb._cluster import connect

    connect(ray_head.address)
    return ray_head


def wait_for_free_cpus(expected: float, timeout: float = 30.0) -> float:
    import ray

    deadline = time.monotonic() + timeout
    free = 0.0
    while time.monotonic() < deadline:
        free = ray.available_resources().get("CPU", 0.0)
        if free >= expected:
            return free
        time.sleep(0.2)
    return free


@pytest.fixture(scope="module")
def group(ray_cluster):
    """A started 2-rank session shared by a module's tests."""
    import rtnb

    session = rtnb.Session(
        workers=2, stop_grace_s=1.0, storage=tempfile.mkdtemp(prefix="rtnb-runs-")
    )
    session.start()
    yield session
    session.stop()
