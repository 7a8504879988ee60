"""The Jupyter server extension warms Ray before a notebook asks: a real
``jupyter server`` (the extension enabled by the config file the install puts in
this environment) starts the warm Ray on its own start and, once that Ray ended,
again when it starts a Python kernel; a kernel it starts then joins that Ray in
its ``%rtnb start`` instead of starting one. ``RTNB_WARM_RAY=0`` keeps it off."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from jupyter_client import BlockingKernelClient

from tests._heads import end_process_group
from tests._kernel import Execution
from tests.conftest import free_port

pytestmark = pytest.mark.slow

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Server:
    def __init__(self, tmp_path: Path, **env_extra: str) -> None:
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        self.runtime = tmp_path / "runtime"
        self.home = tmp_path / "home"
        self.log_path = tmp_path / "server.log"
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RTNB_WARM_RAY")}
        env.update(
            RTNB_HOME=str(self.home),
            RTNB_WARM_RAY_IDLE_S="60",
            JUPYTER_RUNTIME_DIR=str(self.runtime),
            **env_extra,
        )
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jupyter_server",
                    "--ServerApp.ip=127.0.0.1",
                    f"--ServerApp.port={self.port}",
                    "--ServerApp.port_retries=0",
                    f"--IdentityProvider.token={self.token}",
                    "--ServerApp.open_browser=False",
                    "--ServerApp.allow_root=True",
                    f"--ServerApp.root_dir={tmp_path}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tmp_path,
                start_new_session=True,
            )
        self.env = env
        self.wait_for(lambda: self.call("GET", "/api/status") is not None, 120, "the server")

    def call(self, method: str, path: str, body: dict | None = None):
        data = json.dumps(body or {}).encode() if method == "POST" else None
        request = urllib.request.Request(
            self.base + path,
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        try:
            with _NO_PROXY.open(request, timeout=60) as response:
                raw = response.read()
                return json.loads(raw) if raw else {}
        except OSError:
            return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the server exited:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"{what} not within {timeout} s:\n{self.log()[-3000:]}"
            )
            time.sleep(0.1)

    def warm(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "rtnb.batch.cli", "warm", *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=120,
        )

    def warm_ray_running(self) -> bool:
        return "warm Ray at 127.0.0.1:" in self.warm().stdout

    def kernel(self) -> ServerKernel:
        model = self.call("POST", "/api/kernels", {"name": "python3"})
        assert model and "id" in model, model
        return ServerKernel(self, model["id"])

    def stop(self) -> None:
        end_process_group(self.proc)
        self.warm("stop", "--force")


class ServerKernel:
    """A kernel the server started, driven through its connection file."""

    def __init__(self, server: Server, kernel_id: str) -> None:
        self.server, self.id = server, kernel_id
        connection = server.runtime / f"kernel-{kernel_id}.json"
        server.wait_for(connection.exists, 60, "the kernel's connection file")
        self.client = BlockingKernelClient(connection_file=str(connection))
        self.client.load_connection_file()
        # No heartbeat: the server owns the process, and a heartbeat missed for a
        # second (a kernel starting on a busy machine) read as "the kernel died".
        self.client.start_channels(hb=False)
        self.client.wait_for_ready(timeout=60)

    def execute(self, code: str, timeout: float = 120.0) -> Execution:
        result = Execution()
        reply = self.client.execute_interactive(
            code, timeout=timeout, output_hook=lambda msg: _collect(result, msg)
        )
        result.status = reply["content"]["status"]
        return result

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.server.call("DELETE", f"/api/kernels/{self.id}")


def _shown(result: Execution) -> str:
    """Everything the cell showed: streams, results and the progress line's updates."""
    data = result.results + result.updates
    return result.text + "\n".join(d.get("text/plain", "") for d in data)


def _collect(result: Execution, msg: dict) -> None:
    kind, content = msg["msg_type"], msg["content"]
    if kind == "stream":
        setattr(result, content["name"], getattr(result, content["name"]) + content["text"])
    elif kind in ("execute_result", "display_data"):
        result.results.append(content["data"])
    elif kind == "update_display_data":
        result.updates.append(content["data"])
    elif kind == "error":
        result.ename, result.evalue = content["ename"], content["evalue"]


def test_the_server_warms_ray_and_its_kernels_join_it(tmp_path):
    server = Server(tmp_path)
    try:
        # No kernel yet: the server's own start warmed Ray.
        # The log line comes once the start returned; `rtnb warm status` may show the
        # address a moment before (a slow machine showed that gap).
        server.wait_for(
            lambda: "rtnb: warm Ray started at 127.0.0.1:" in server.log(),
            90,
            "the server's log saying it started a warm Ray",
        )
        assert server.warm_ray_running()
        assert "no kernel attached" in server.warm().stdout

        kernel = server.kernel()
        kernel.execute("%load_ext rtnb")
        started = kernel.execute("%rtnb start --workers 2")
        assert started.status == "ok", _shown(started)
        assert "joining the warm Ray" in _shown(started)
        assert "starting the warm Ray" not in _shown(started), _shown(started)
        cell = kernel.execute(
            "%%rtrain\nimport rtnb\nx = 20 + rtnb.get_context().get_world_rank()\nx"
        )
        assert "[rank 0] 20" in _shown(cell) and "[rank 1] 21" in _shown(cell), _shown(cell)
        assert str(os.getpid()) not in server.warm().stdout  # the kernel, not this process
        assert "kernels attached: 1" in server.warm().stdout
        kernel.execute("%rtnb stop")

        # The warm Ray ends (its idle time-out, here `rtnb warm stop`); the server's
        # next Python kernel warms it again while that kernel starts.
        stopped = server.warm("stop")
        assert stopped.returncode == 0, stopped.stderr
        assert not server.warm_ray_running()
        second = server.kernel()
        server.wait_for(server.warm_ray_running, 90, "a warm Ray started for the new kernel")
        second.execute("%load_ext rtnb")
        started = second.execute("%rtnb start --workers 2")
        assert "joining the warm Ray" in _shown(started), _shown(started)
        assert "starting the warm Ray" not in _shown(started), _shown(started)
        second.execute("%rtnb stop")
        kernel.shutdown()
        second.shutdown()
    finally:
        server.stop()
    assert not server.warm_ray_running()


def test_rtnb_warm_ray_0_keeps_the_server_from_warming_ray(tmp_path):
    server = Server(tmp_path, RTNB_WARM_RAY="0")
    try:
        server.wait_for(
            lambda: "RTNB_WARM_RAY=0: the server does not warm Ray" in server.log(),
            30,
            "the extension's note",
        )
        kernel = server.kernel()
        assert kernel.execute("1 + 1").status == "ok"
        kernel.shutdown()
        assert not server.warm_ray_running()
        assert not (server.home / "warm-ray").exists() or not list(
            (server.home / "warm-ray").glob("*.json")
        )
    finally:
        server.stop()
