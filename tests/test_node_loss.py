"""Losing a whole node: a second Ray node joins the session's cluster, the ranks are
SPREAD over both, and the node is killed mid-cell (raylet, object store, ranks)."""

from __future__ import annotations

import time

import pytest

import rtnb
from tests.conftest import WorkerNode, wait_for_free_cpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TRAIN = (
    "import time, rtnb, torch, torch.distributed as dist\n"
    "ck = rtnb.get_checkpoint()\n"
    "i = ck.load_state()['i'] + 1 if ck is not None else 0\n"
    "t = torch.zeros(1)\n"
    "while i < 60:\n"
    "    time.sleep(0.05)\n"
    "    dist.all_reduce(t)\n"
    "    rtnb.report({'i': i}, checkpoint=rtnb.Checkpoint.from_state({'i': i}) if dist.get_rank() == 0 else None)\n"
    "    i += 1\n"
    "i"
)


@pytest.fixture
def second_node(ray_head, ray_cluster):
    # A fresh resource name per node: a node killed by an earlier test stays listed
    # until the GCS declares it dead.
    marker = f"rtnb_node_{time.monotonic_ns()}"
    node = WorkerNode(ray_head, num_cpus=1, resources={marker: 1})
    try:
        node.wait_joined(marker)
        yield node
    finally:
        node.kill()


def test_local_storage_over_two_nodes_is_refused_and_frees_the_cpus(second_node, tmp_path):
    free_before = wait_for_free_cpus(5)
    with pytest.raises(rtnb.ConfigError, match="2 nodes.*--allow-local-storage") as info:
        rtnb.Session(workers=2, cpus_per_worker=1, strategy="SPREAD", storage=str(tmp_path)).start()
    assert "\n" not in str(info.value)
    assert wait_for_free_cpus(free_before) >= free_before, "no rank left holding a CPU"


def test_a_lost_node_is_recovered_from_the_latest_checkpoint(second_node, tmp_path):
    with rtnb.Session(
        workers=2,
        cpus_per_worker=1,
        strategy="SPREAD",
        storage=str(tmp_path),  # one disk under both nodes here, hence the flag
        allow_local_storage=True,
        name="nodeloss",
        max_failures=1,
        stop_grace_s=1.0,
    ) as session:
        nodes = {r.node_id for r in session.group.ranks}
        assert len(nodes) == 2, "SPREAD put one rank on each node"
        notes: list[str] = []
        handle = session.run_background(
            TRAIN, output=lambda rank, _s, text: notes.append(text) if rank < 0 else None
        )
        deadline = time.monotonic() + 60
        while len(session.checkpoints.list()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        committed_before = {c.id for c in session.checkpoints.list()}
        second_node.kill()
        assert handle.wait(180) == {0: 60, 1: 60}, "finished exactly at the requested step"
        assert session.failures == 1
        assert any("worker group rebuilt" in n for n in notes), notes
        assert committed_before <= {c.id for c in session.checkpoints.list()}
        assert handle.restarted_from is not None
        assert len({r.node_id for r in session.group.ranks}) == 1, "rebuilt on the node left"


def test_a_node_with_another_torch_is_named_in_one_line_before_any_rank_starts(
    ray_head, ray_cluster, tmp_path
):
    """A node whose environment holds another torch (its Python finds a torch 2.0.0
    first on its path) is named with both sides' versions and what to do; nothing is
    left holding a CPU."""
    site = tmp_path / "other-env"
    for name, version in (("torch", "2.0.0"),):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    marker = f"rtnb_node_{time.monotonic_ns()}"
    node = WorkerNode(ray_head, num_cpus=1, resources={marker: 1}, env={"PYTHONPATH": str(site)})
    try:
        node.wait_joined(marker)
        free_before = wait_for_free_cpus(5)
        with pytest.raises(rtnb.ClusterError) as info:
            rtnb.Session(workers=2, storage=str(tmp_path / "runs")).start()
        line = str(info.value)
        assert "\n" not in line, line
        assert "runs torch 2.0.0; this kernel runs torch 2.13" in line, line
        assert "pip install torch==2.13" in line and "no rank was started" in line, line
        assert wait_for_free_cpus(free_before) >= free_before, "no rank left holding a CPU"
    finally:
        node.kill()


_OWN_RAY = """
import sys, ray, rtnb
from rtnb.core._startup import defer_unused_imports, lazy_imports_for_children

site, runs = sys.argv[1], sys.argv[2]
defer_unused_imports()


def own_ray(**options):
    with lazy_imports_for_children():
        ray.init(num_cpus=1, object_store_memory=80_000_000, include_dashboard=False,
                 log_to_driver=False, **options)


# The user's own Ray, whose job puts another torch first on its workers' path.
own_ray(runtime_env={"env_vars": {"PYTHONPATH": site}})
try:
    rtnb.Session(workers=1, cpus_per_worker=1, storage=runs).start().stop()
    print("STARTED on the other torch")
except rtnb.ClusterError as exc:
    print("REFUSED", exc)
ray.shutdown()
# The user's own Ray as ray.init() starts it: this very Python on its one node.
own_ray()
session = rtnb.Session(workers=1, cpus_per_worker=1, storage=runs).start()
print("ANSWER", session.run("6 * 7")[0])
asked = [e["name"] for e in ray.timeline() if "versions" in str(e.get("name"))]
print("ASKED" if asked else "NOT ASKED", asked)
session.stop()
ray.shutdown()
"""


def test_a_kernel_s_own_ray_is_not_asked_its_versions_unless_its_job_brings_other_packages(
    tmp_path,
):
    """A kernel that ran its own ``ray.init()`` starts its ranks on this very Python:
    no probe of the node's versions holds up the start (it took one of Ray's spare
    workers, which the ranks then waited for). When the job's runtime env puts
    another torch first on the workers' path, the node is asked and the start is
    refused in one line, as on any cluster."""
    import os
    import subprocess
    import sys

    site = tmp_path / "other-env"
    info = site / "torch-2.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.0.0\n")
    home = tmp_path / "home"  # where ray.init() writes its token: not the suite's
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", _OWN_RAY, str(site), str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**env, "HOME": str(home)},
        cwd=tmp_path,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-3000:]
    refused = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert refused and "runs torch 2.0.0; this kernel runs torch 2.13" in refused[0], out
    assert "ANSWER 42" in out, out
    assert "NOT ASKED" in out, out
