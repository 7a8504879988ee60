"""Joining a `ray start --head` cluster on loopback: HOST:PORT, ray://, bad addresses,
and what a kernel leaves behind when it shuts down."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from tests._kernel import Kernel
from tests.conftest import CLUSTER_CPUS, free_port, wait_for_free_cpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]

_CELL = (
    "%%rtrain\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
    "dist.all_reduce(t)\n(dist.get_world_size(), t.item())"
)


def _env_without_ray_address() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_MODE", None)  # rtnb must find the cluster's token by itself
    return env


@pytest.mark.parametrize("kind", ["gcs", "client"])
def test_start_joins_a_remote_cluster_quietly(ray_cluster, tmp_path, kind):
    address = ray_cluster.address if kind == "gcs" else ray_cluster.client_address
    kernel = Kernel(cwd=str(tmp_path), env=_env_without_ray_address())
    try:
        # ray:// may need three tries on a head that has run a while (ray#63202).
        run = kernel.execute(f"%load_ext rtnb\n%rtnb start --address {address}", timeout=240)
        assert run.status == "ok", run.text + "\n".join(run.traceback)
        assert "ready" in str(run.results)
        noise = [line for line in run.text.splitlines() if line.strip()]
        assert noise == [], f"Ray's connection chatter reached the cell: {noise}"
        out = kernel.execute(_CELL, timeout=60)
        assert out.results[-1]["text/plain"] == "[rank 0] (2, 2.0)\n[rank 1] (2, 2.0)"
        assert kernel.execute("%rtnb stop").status == "ok"
    finally:
        kernel.shutdown()
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS


def test_unreachable_address_fails_fast_with_one_line(tmp_path):
    port = free_port()  # nothing listens there
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import rtnb\ntry:\n    rtnb.Session(address='127.0.0.1:{port}').start()\n"
            "except rtnb.ClusterError as e:\n    print('ERR', e)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env_without_ray_address(),
        cwd=tmp_path,
    )
    assert time.monotonic() - start < 20
    assert proc.stdout.startswith("ERR cannot reach a Ray cluster at 127.0.0.1:"), (
        proc.stdout + proc.stderr
    )
    assert proc.stdout.count("\n") == 1


def test_kernel_shutdown_leaves_no_ranks_behind(ray_cluster, tmp_path):
    kernel = Kernel(cwd=str(tmp_path))
    try:
        run = kernel.execute("%load_ext rtnb\n%rtnb start", timeout=120)
        assert run.status == "ok", run.traceback
        assert kernel.execute("%rtrain x = 1").status == "ok"
        import ray

        assert ray.available_resources().get("CPU", 0) <= CLUSTER_CPUS - 2
    finally:
        kernel.shutdown()
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS


def test_a_cluster_without_auth_is_joined_without_the_users_token(ray_cluster, tmp_path):
    """The user has a Ray token (any Ray 2.60 `ray.init()` writes one) and joins a
    cluster started without token auth. Sending the token there made every rank's
    actor "die unexpectedly" (the cluster calls a token-mode driver back without one):
    rtnb asks the GCS first and joins as the cluster expects."""
    from tests._heads import end_process_group, start_head_until_up

    token = tmp_path / "auth_token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    port = free_port()
    env = _env_without_ray_address()
    # Short: Ray's Unix sockets live under it (a path of at most 107 bytes).
    temp_dir = tempfile.mkdtemp(prefix="rtnb-noauth-")

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            [
                os.path.join(os.path.dirname(sys.executable), "ray"),
                "start",
                "--head",
                "--block",
                f"--port={port}",
                "--node-ip-address=127.0.0.1",
                "--num-cpus=1",
                "--include-dashboard=false",
                "--object-store-memory=100000000",
                f"--temp-dir={temp_dir}",
            ],
            env={**env, "RAY_AUTH_MODE": "disabled"},
            stdout=(tmp_path / "head.log").open("a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    head = start_head_until_up(start, temp_dir)
    kernel = None
    try:
        kernel = Kernel(cwd=str(tmp_path), env={**env, "RAY_AUTH_TOKEN_PATH": str(token)})
        run = kernel.execute(
            f"%load_ext rtnb\n%rtnb start --address 127.0.0.1:{port} --workers 1 "
            f"--storage {tmp_path / 'runs'}",
            timeout=240,
        )
        assert run.status == "ok", run.text + run.evalue + "\n".join(run.traceback)
        out = kernel.execute("%rtrain 40 + 2", timeout=120)
        assert out.status == "ok" and "42" in out.results[-1]["text/plain"], out.text + out.evalue
        assert kernel.execute("%rtnb stop").status == "ok"
    finally:
        if kernel is not None:
            kernel.shutdown()
        end_process_group(head)
