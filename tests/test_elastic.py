"""Elastic groups (``--workers MIN-MAX``): as many ranks as the cluster places, a lost
node's ranks dropped instead of waited for, and the group grown back at a cell's
start once the cluster has room again."""

from __future__ import annotations

import time

import pytest

import rtnb
from tests.conftest import CLUSTER_CPUS, WorkerNode, wait_for_free_cpus
from tests.test_node_loss import TRAIN  # a resumable loop: all-reduce, checkpoints

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _node(ray_head, cpus: int) -> WorkerNode:
    marker = f"rtnb_node_{time.monotonic_ns()}"
    node = WorkerNode(ray_head, num_cpus=cpus, resources={marker: 1})
    node.wait_joined(marker)
    return node


def test_an_elastic_group_shrinks_on_node_loss_and_grows_back(ray_head, ray_cluster, tmp_path):
    free = wait_for_free_cpus(4)
    node = _node(ray_head, 2)
    second = None
    try:
        session = rtnb.Session(
            workers=(2, 8),
            cpus_per_worker=2,
            storage=str(tmp_path),  # one disk under both nodes here, hence the flag
            allow_local_storage=True,
            name="elastic",
            max_failures=1,
            stop_grace_s=1.0,
        )
        session.start()
        try:
            room = int(free // 2) + 1
            assert session.world_size == room, session.status()
            assert len({r.node_id for r in session.group.ranks}) == 2
            assert f"elastic 2-8: {room} ranks" in str(session.status())
            notes: list[str] = []
            handle = session.run_background(
                TRAIN, output=lambda rank, _s, text: notes.append(text) if rank < 0 else None
            )
            deadline = time.monotonic() + 60
            while len(session.checkpoints.list()) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            lost_at = time.monotonic()
            node.kill()
            finished = handle.wait(240)
            assert set(finished.values()) == {60} and len(finished) == room - 1, finished
            assert session.world_size == room - 1
            assert any(f"elastic 2-8: {room - 1} ranks" in n for n in notes), notes
            print(f"shrunk and finished {time.monotonic() - lost_at:.1f} s after the node loss")
            # Room again: the next cell's start grows the group back, state kept.
            second = _node(ray_head, 2)
            grown: list[str] = []
            session.run(
                "kept = 'across the growth'",
                output=lambda rank, _s, text: grown.append(text) if rank < 0 else None,
            )
            sizes = session.run("import torch.distributed as dist\ndist.get_world_size()")
            assert set(sizes.values()) == {room} and len(sizes) == room, sizes
            assert any(f"grew from {room - 1} to {room} ranks" in n for n in grown), grown
            assert session.pull("i") == [60] * room, "the journal's replay kept the state"
            entries = [e for e in session.journal.entries() if e.reason]
            assert any("elastic" in (e.reason or "") and e.workers == room - 1 for e in entries)
            assert entries[-1].workers == room
        finally:
            session.stop()
    finally:
        node.kill()
        if second is not None:
            second.kill()


def test_an_elastic_group_that_cannot_have_min_ranks_says_so_and_holds_nothing(
    ray_cluster, tmp_path
):
    free = wait_for_free_cpus(4)
    session = rtnb.Session(
        workers=(20, 30), cpus_per_worker=1, storage=str(tmp_path), placement_timeout_s=2.0
    )
    with pytest.raises(rtnb.RtnbError) as caught:
        session.start()
    message = str(caught.value)
    assert "needs at least 20" in message or "20 workers" in message, message
    assert "\n" not in message
    # A node an earlier test killed can still be counted when `free` was read: the
    # head's own CPUs are what this session must not hold.
    expected = min(free, CLUSTER_CPUS)
    assert wait_for_free_cpus(expected) >= expected
    with pytest.raises(rtnb.ConfigError, match="MIN is more than MAX"):
        rtnb.Session(workers=(3, 2))
