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
