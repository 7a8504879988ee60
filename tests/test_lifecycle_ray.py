"""Start, stop, restart, scale and failures of the worker group, on real Ray."""

from __future__ import annotations

import time

import pytest

import rtnb
from tests.conftest import CLUSTER_CPUS, require, wait_for_free_cpus

pytestmark = pytest.mark.ray


@pytest.fixture
def session(ray_cluster, tmp_path):
    s = rtnb.Session(workers=2, stop_grace_s=1.0, storage=str(tmp_path))
    yield s
    s.stop()
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS


def _pids(session) -> list[int]:
    return session.run("import os\nos.getpid()").values_list()


def test_stop_frees_cpus_and_state_follows_the_lifecycle(session):
    import ray

    seen = []
    session.on_state_change(lambda change: seen.append(str(change.new)))
    session.start()
    assert ray.available_resources().get("CPU", 0) <= CLUSTER_CPUS - 2
    with pytest.raises(rtnb.SessionError, match="already started"):
        session.start()
    session.stop()
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS
    assert seen == ["starting", "ready", "stopping", "stopped"]
    with pytest.raises(rtnb.SessionError, match="%rtnb start"):
        session.run("1")


def test_restart_gives_fresh_ranks_and_scale_changes_the_world_size(session):
    session.start()
    before = _pids(session)
    session.run("leftover = 1")
    session.restart()
    assert set(_pids(session)).isdisjoint(before)
    with pytest.raises(rtnb.SessionError, match="not defined"):
        session.pull("leftover")
    session.scale(3)
    value = session.run(
        "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n(dist.get_world_size(), t.item())"
    )
    assert value == {0: (3, 3.0), 1: (3, 3.0), 2: (3, 3.0)}
    with pytest.raises(rtnb.ConfigError):
        session.scale(-1)
    with pytest.raises(rtnb.ConfigError, match="MIN is more than MAX"):
        session.scale((3, 1))
    assert session.world_size == 3 and session.config.workers == 3, "the group keeps its size"


def test_more_workers_than_cpus_is_refused_before_anything_is_held(ray_cluster):
    import ray

    free = ray.available_resources().get("CPU", 0)
    start = time.monotonic()
    with pytest.raises(rtnb.ClusterError, match=r"need 9 CPUs.*has 4") as info:
        rtnb.Session(workers=9).start()
    assert time.monotonic() - start < 5
    assert "\n" not in str(info.value)
    assert ray.available_resources().get("CPU", 0) == free


def test_resources_held_elsewhere_time_out_with_a_clear_error(session):
    session.start()
    other = rtnb.Session(workers=3, placement_timeout_s=2)
    start = time.monotonic()
    with pytest.raises(rtnb.ClusterError, match="held by something else"):
        other.start()
    assert time.monotonic() - start < 10
    assert session.run("1") == {0: 1, 1: 1}, "the first group is untouched"


def test_a_rank_that_dies_fails_the_cell_and_the_group_is_rebuilt_empty(session):
    session.start()
    session.run("doomed_variable = 1")
    before = _pids(session)
    with pytest.raises(rtnb.WorkerGroupError, match=r"rank 1 died.*rebuilt") as info:
        session.run(
            "import os, signal, torch.distributed as dist, time\nif dist.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(2)"
        )
    assert "\n" not in str(info.value)
    assert set(_pids(session)).isdisjoint(before)
    with pytest.raises(rtnb.SessionError):
        session.pull("doomed_variable")
    assert session.run(
        "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    ) == {0: 2.0, 1: 2.0}


def test_run_json_records_config_ranks_and_status(session, tmp_path):
    import json

    session.start()
    record = json.loads((tmp_path / session.run_name / "run.json").read_text())
    assert record["status"] == "ready" and record["config"]["workers"] == 2
    assert sorted(r["rank"] for r in record["ranks"]) == [0, 1]
    session.stop()
    assert json.loads((tmp_path / session.run_name / "run.json").read_text())["status"] == "stopped"


def test_unwritable_storage_is_refused_before_any_rank_starts(ray_cluster, tmp_path):
    import ray

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    free = ray.available_resources().get("CPU", 0)
    with pytest.raises(rtnb.ConfigError, match="not writable"):
        rtnb.Session(storage=str(blocker / "runs")).start()
    assert ray.available_resources().get("CPU", 0) == free


def _read_scalars(folder):
    import struct

    event_pb2 = require("tensorboardX.proto.event_pb2", "the TensorBoard export test reads events")

    values = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                values.append((value.tag, event.step, value.simple_value))
    return values


def test_tensorboard_export_writes_every_report_per_rank(lend, tmp_path):
    with rtnb.Session(
        workers=2,
        cpus_per_worker=0.5,
        group_factory=lend,
        storage=str(tmp_path),
        name="tb",
        tensorboard=True,
    ) as session:
        session.run(
            "import rtnb, torch.distributed as dist\nfor s in range(1, 6):\n    rtnb.report({'loss': s * 10 + dist.get_rank()})"
        )
    for rank in (0, 1):
        scalars = _read_scalars(tmp_path / "tb" / "tensorboard" / f"rank_{rank}")
        scalars = [x for x in scalars if not x[0].startswith("sys/")]  # resource samples
        assert [(t, v) for t, _s, v in scalars] == [("loss", s * 10 + rank) for s in range(1, 6)]
        assert [s for _t, s, _v in scalars] == [0, 1, 2, 3, 4], "steps count from 0"


def test_tensorboard_gets_each_ranks_resource_samples_beside_its_reports(lend, tmp_path):
    with rtnb.Session(
        workers=2,
        cpus_per_worker=0.5,
        group_factory=lend,
        storage=str(tmp_path),
        name="tbsys",
        tensorboard=True,
    ) as session:
        session.run(
            "import time, rtnb\nfor s in range(25):\n    rtnb.report({'loss': 1.0})\n"
            "    time.sleep(0.1)"
        )
    for rank in (0, 1):
        tags = {
            t for t, _s, _v in _read_scalars(tmp_path / "tbsys" / "tensorboard" / f"rank_{rank}")
        }
        assert {"loss", "sys/cpu", "sys/rss_mb"} <= tags, tags
