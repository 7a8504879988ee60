"""Checkpoint uploads that never stall training: ``report(...,
checkpoint_upload_mode=ASYNC)`` to a real S3 server over a link the test slows down.

While the link is held, a checkpoint's upload stays in flight for as long as the test
likes: the loop must run on past it, the checkpoint must not be listed, and the cell
must not end before it landed. A rank killed mid-upload leaves nothing listed and the
cell runs again from the last committed checkpoint.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

import rtnb
from tests._slow_link import SlowLink
from tests.test_s3 import CREDENTIALS, s3_storage  # noqa: F401 - the moto fixture

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# 2 MB a rank: at the held link's 4 kB/s an upload takes minutes, so it is in flight
# for as long as the test holds the link.
LOOP = """
import rtnb, torch
ck = rtnb.get_checkpoint()
start = int(ck.load_state()["w"][0]) + 1 if ck else 0
for s in range(start, 40):
    shard = rtnb.Checkpoint.from_state({"w": torch.full((500_000,), float(s))}) if s in SAVE_AT else None
    rtnb.report({"loss": 1.0 / (s + 1)}, checkpoint=shard, step=s,
                checkpoint_upload_mode="ASYNC" if shard is not None else None)
'looped'
"""


@pytest.fixture
def slow_s3(s3_storage, monkeypatch):  # noqa: F811 - the fixture imported above
    storage, _client = s3_storage
    port = int(re.search(r"endpoint_override=127\.0\.0\.1:(\d+)", storage).group(1))
    link = SlowLink(("127.0.0.1", port))
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    try:
        yield storage.replace(f"127.0.0.1:{port}", f"127.0.0.1:{link.port}"), link
    finally:
        link.close()


def _session(storage: str, name: str, **options) -> rtnb.Session:
    return rtnb.Session(
        workers=2, cpus_per_worker=0.5, storage=storage, name=name, env=CREDENTIALS, **options
    )


def _reached(session: rtnb.Session, step: int) -> threading.Event:
    """Set once every rank's reports reached ``step`` (the loop ran there)."""
    reached = threading.Event()

    def seen(_rank, _batch) -> None:
        last = session.metrics.last
        if all(r in last and last[r].step >= step for r in (0, 1)):
            reached.set()

    session.metrics.subscribe(seen)
    return reached


def test_the_loop_runs_on_while_uploads_are_in_flight_and_they_land_in_order(ray_cluster, slow_s3):
    storage, link = slow_s3
    with _session(storage, "async") as session:
        session.run("SAVE_AT = (10, 20)")
        link.hold()
        reached = _reached(session, 39)
        handle = session.run_background(LOOP)
        assert reached.wait(120), "the loop stalled behind its checkpoint uploads"
        # The loop can run past step 39 before an upload thread, starved on 2 cores,
        # sent its first free bytes: wait for the crawl itself.
        assert link.crawling.wait(60), "no upload was held mid-flight"
        # Both checkpoints are still on their way: not listed, and the cell, whose
        # loop is over, has not ended.
        assert session.list_checkpoints() == []
        assert not handle.done()
        status = session.status()
        assert status.state == "running", status
        link.release()
        assert handle.wait(180) == {0: "looped", 1: "looped"}
        listed = session.list_checkpoints()
        assert [c.step for c in listed] == [10, 20], listed
        for info in listed:
            assert info.ranks == [0, 1]
            session.checkpoints.get(info.id).verify(full=True)
        latest = session.run("ck = rtnb.get_checkpoint()\n(ck.id, float(ck.load_state()['w'][0]))")
        assert latest == {r: ("step-000000020", 20.0) for r in (0, 1)}


def test_uploads_beyond_the_limit_wait_and_say_so_once(ray_cluster, slow_s3):
    storage, link = slow_s3
    with _session(storage, "behind") as session:
        session.run("SAVE_AT = (10, 20, 30)")
        link.hold()
        lines: list[str] = []
        reached = _reached(session, 29)
        handle = session.run_background(LOOP, output=lambda rank, stream, text: lines.append(text))
        # Two in flight (RTNB_UPLOADS_IN_FLIGHT's default): the third report waits
        # for room, so the loop stops at step 30 until the link is released.
        assert reached.wait(120)
        deadline = time.monotonic() + 60
        while not any("fall behind" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert session.metrics.last[0].step < 30
        link.release()
        assert handle.wait(180) == {0: "looped", 1: "looped"}
        said = [line for line in lines if "fall behind" in line]
        assert len(said) == 1 and "RTNB_UPLOADS_IN_FLIGHT" in said[0], lines
        assert [c.step for c in session.list_checkpoints()] == [10, 20, 30]


def test_a_rank_killed_mid_upload_leaves_nothing_listed_and_the_cell_goes_on_from_the_last(
    ray_cluster, slow_s3
):
    storage, link = slow_s3
    with _session(storage, "killed", max_failures=1, stop_grace_s=1.0) as session:
        session.run("SAVE_AT = (5,)\nimport rtnb, torch")
        session.run(
            "rtnb.report({'loss': 1.0}, step=5, checkpoint=rtnb.Checkpoint.from_state("
            "{'w': torch.full((10,), 5.0)}), checkpoint_upload_mode='ASYNC')"
        )
        assert [c.step for c in session.list_checkpoints()] == [5]
        session.run("SAVE_AT = (10, 20)")
        link.hold()
        reached = _reached(session, 39)
        handle = session.run_background(LOOP)
        assert reached.wait(120) and link.crawling.wait(60)
        os.kill(session.group.ranks[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while session.failures < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        link.release()
        assert handle.wait(240) == {0: "looped", 1: "looped"}
        assert handle.restarted_from == "step-000000005"
        listed = session.checkpoints.list(include_incomplete=True)
        assert [(c.step, c.status) for c in listed] == [
            (5, "committed"),
            (10, "committed"),
            (20, "committed"),
        ], listed
        for info in listed:
            session.checkpoints.get(info.id).verify(full=True)


def test_a_stop_whose_grace_ends_with_uploads_in_flight_says_what_it_dropped(ray_cluster, slow_s3):
    storage, link = slow_s3
    with _session(storage, "dropped", stop_grace_s=1.0) as session:
        session.run("SAVE_AT = (10, 20)")
        link.hold()
        lines: list[str] = []
        reached = _reached(session, 39)
        handle = session.run_background(LOOP, output=lambda rank, stream, text: lines.append(text))
        assert reached.wait(120) and link.crawling.wait(60)
        # The ranks wait for their uploads at the cell's end, past a stop's interrupt:
        # the stop's grace runs out and the group is rebuilt.
        handle.stop()
        with pytest.raises(rtnb.RtnbError) as ended:
            handle.wait(120)
        assert "rebuilt with fresh ranks" in str(ended.value), ended.value
        said = [line for line in lines if "dropped" in line]
        assert said and "step 10, 20" in said[0], lines
        link.release()
        assert session.list_checkpoints() == []
