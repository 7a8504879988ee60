"""A full disk (and a bucket made read-only) is a clear stop, not a wedged session: the run's storage on a small
tmpfs fills up while a 2-rank cell saves checkpoints. The cell stops on every rank
at one step and ends with one line (what could not be written where, the last
committed checkpoint, what to do); nothing half-written is listed; the metrics
record and the journal stay readable; once space is free the next cell runs and
checkpoints again, and a replay in a new session starts from the last commit."""

from __future__ import annotations

import json
import subprocess
import threading

import pytest

import rtnb
from tests.conftest import missing
from tests.test_s3 import CREDENTIALS, s3_storage  # noqa: F401 - the moto fixture

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


def test_a_full_disk_stops_the_cell_on_every_rank_and_the_session_goes_on(lend, small_disk):
    storage = str(small_disk / "runs")
    filler = small_disk / "filler"
    with rtnb.Session(
        workers=2, cpus_per_worker=0.5, group_factory=lend, storage=storage, name="full"
    ) as session:
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
        after = _checkpoints_again(session, latest)

    _replay_starts_from(after, group_factory=lend, storage=storage, name="full")


def _checkpoints_again(session, latest: str) -> str:
    """Once the cause is gone the session checkpoints again (a new id after
    ``latest``) and sets a variable for the replay to bring back; the new id."""
    session.run(
        "import rtnb\nck = rtnb.get_checkpoint()\n"
        "rtnb.report({'loss': 0.0}, checkpoint=rtnb.Checkpoint.from_state({'after': True}))"
    )
    after = session.list_checkpoints()[-1].id
    assert after != latest, "and checkpoints again"
    session.run("x = 7")
    return after


def _replay_starts_from(after: str, **options) -> None:
    """A new session of the run with --replay has the variable and ``after``."""
    with rtnb.Session(workers=2, cpus_per_worker=0.5, replay=True, **options) as again:
        assert again.run("x") == {0: 7, 1: 7}
        assert again.latest_checkpoint_id() == after


def _deny_writes(client, bucket: str) -> None:
    """Make the bucket read-only, as an operator's policy or an expired write role does."""
    client.put_bucket_policy(
        Bucket=bucket,
        Policy=json.dumps(
            {
                "Version": "2012-10-17",
                "Statement": [
                    {
                        "Effect": "Deny",
                        "Principal": "*",
                        "Action": ["s3:PutObject"],
                        "Resource": f"arn:aws:s3:::{bucket}/*",
                    }
                ],
            }
        ),
    )


def test_a_bucket_made_read_only_mid_run_stops_cleanly(lend, s3_storage, monkeypatch):  # noqa: F811
    storage, client = s3_storage
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    with rtnb.Session(
        workers=2,
        cpus_per_worker=0.5,
        group_factory=lend,
        storage=storage,
        name="readonly",
        env=CREDENTIALS,
    ) as session:
        two_committed = threading.Event()
        session.checkpoints.subscribe(
            lambda _info: len(session.list_checkpoints()) >= 2 and two_committed.set()
        )
        handle = session.run_background(SAVE_UNTIL_FULL, output=lambda *a: None)
        assert two_committed.wait(120), "no two checkpoints committed in 120 s"
        _deny_writes(client, "rtnb-test")
        try:
            with pytest.raises(rtnb.StorageError) as info:
                handle.wait(120)
            said = str(info.value)
            assert "\n" not in said
            assert "could not" in said and "every rank stopped at step" in said, said
            assert "secret" not in said.lower() and CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in said
            committed = session.list_checkpoints()
            latest = committed[-1].id
            assert f"the last committed checkpoint is {latest}" in said, said
            for info_ in committed:
                session.checkpoints.get(info_.id).verify(full=True)
            assert session.status().state == "ready"
        finally:
            client.delete_bucket_policy(Bucket="rtnb-test")
        assert session.run("1 + 1") == {0: 2, 1: 2}, "the next cell runs once writes work"
        after = _checkpoints_again(session, latest)

    _replay_starts_from(
        after, group_factory=lend, storage=storage, name="readonly", env=CREDENTIALS
    )
