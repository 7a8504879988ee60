"""A full disk is a clear stop, not a wedged session: the run's storage on a small
tmpfs fills up while a 2-rank cell saves checkpoints. The cell stops on every rank
at one step and ends with one line (what could not be written where, the last
committed checkpoint, what to do); nothing half-written is listed; the metrics
record and the journal stay readable; once space is free the next cell runs and
checkpoints again, and a replay in a new session starts from the last commit."""

from __future__ import annotations

import subprocess

import pytest

import rtnb
from tests.conftest import missing

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SAVE_UNTIL_FULL = """
import time, rtnb, torch
for step in range(10_000):
    # 1 MB per rank per step, a step every 50 ms: the commits keep up, then the disk fills.
    shard = rtnb.Checkpoint.from_state({'w': torch.full((250_000,), float(step))})
    rtnb.report({'loss': 1.0 / (step + 1)}, checkpoint=shard)
    time.sleep(0.05)
step
"""


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        missing(f"cannot mount a tmpfs here (needs root): {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_the_cell_on_every_rank_and_the_session_goes_on(ray_cluster, small_disk):
    storage = str(small_disk / "runs")
    filler = small_disk / "filler"
    with rtnb.Session(workers=2, cpus_per_worker=0.5, storage=storage, name="full") as session:
        filler.write_bytes(b"\0" * 8_000_000)  # given back once the cell has stopped
        with pytest.raises(rtnb.StorageError) as info:
            session.run(SAVE_UNTIL_FULL, output=lambda *a: None)
        said = str(info.value)
        assert "\n" not in said
        assert "could not" in said and str(small_disk) in said, said
        assert "No space left on device" in said, said
        assert "every rank stopped at step" in said, said
        committed = session.list_checkpoints()
        assert committed, "checkpoints made before the disk filled are committed"
        latest = committed[-1].id
        assert f"the last committed checkpoint is {latest}" in said, said
        assert "Free space there" in said
        assert session.status().state == "ready"
        for info_ in session.checkpoints.list(include_incomplete=True):
            if info_.status == "committed":
                session.checkpoints.get(info_.id).verify(full=True)
        assert all(c.status == "committed" for c in committed)

        # What was reported reads back, torn by nothing (what the full disk refused
        # is kept and written once there is space again).
        assert len(session.result().metrics_dataframe) > 0

        filler.unlink()
        assert session.run("1 + 1") == {0: 2, 1: 2}, "the next cell runs once space is free"
        frame = session.result().metrics_dataframe
        stopped_at = info.value.step
        for rank in (0, 1):
            steps = sorted(frame[frame["rank"] == rank]["step"])
            assert steps == list(range(stopped_at + 1)), (rank, steps, stopped_at)
        session.run(
            "import rtnb\nck = rtnb.get_checkpoint()\n"
            "rtnb.report({'loss': 0.0}, checkpoint=rtnb.Checkpoint.from_state({'after': True}))"
        )
        assert session.list_checkpoints()[-1].id != latest, "and checkpoints again"
        after = session.list_checkpoints()[-1].id
        session.run("x = 7")

    with rtnb.Session(
        workers=2, cpus_per_worker=0.5, storage=storage, name="full", replay=True
    ) as again:
        assert again.run("x") == {0: 7, 1: 7}
        assert again.latest_checkpoint_id() == after
