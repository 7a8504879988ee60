"""Run directories on S3: a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

import logging
import urllib.request

import pytest

import rtnb
from tests.conftest import free_port, require

pytestmark = pytest.mark.ray

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def s3_storage():
    server_mod = require("moto.server", "the S3 tests run a moto server")
    boto3 = require("boto3", "the S3 tests read the bucket with boto3")
    port = free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    # A moto server keeps its buckets in process-global state that every server
    # started later in this pytest process shares: start each module's bucket empty
    # (another module's runs would show up in this one's listings otherwise).
    urllib.request.urlopen(
        urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST")
    ).close()
    # Each request is an INFO line; a failing test would print thousands of them.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    try:
        client = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{port}",
            **{
                "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing",
                "region_name": "us-east-1",
            },
        )
        client.create_bucket(Bucket="rtnb-test")
        yield (
            f"s3://rtnb-test/runs?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1",
            client,
        )
    finally:
        server.stop()


def test_metrics_and_checkpoints_live_in_s3(ray_cluster, s3_storage, monkeypatch):
    storage, client = s3_storage
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    with rtnb.Session(workers=2, storage=storage, name="s3run", env=CREDENTIALS) as session:
        session.run(
            "import rtnb, torch.distributed as dist\n"
            "for s in range(3):\n"
            "    rtnb.report({'loss': 1.0 + s}, checkpoint=rtnb.Checkpoint.from_state({'s': s, 'r': dist.get_rank()}))"
        )
        value = session.run("ck = rtnb.get_checkpoint()\n(ck.id, ck.load_state()['s'])")
        assert value == {0: ("step-000000002", 2), 1: ("step-000000002", 2)}
        committed = session.list_checkpoints()
        assert [c.step for c in committed] == [0, 1, 2] and all(
            c.ranks == [0, 1] for c in committed
        )
        uri = session.result().path
    keys = {
        o["Key"]
        for o in client.list_objects_v2(Bucket="rtnb-test", Prefix="runs/s3run/")["Contents"]
    }
    assert "runs/s3run/run.json" in keys
    assert "runs/s3run/checkpoints/step-000000002/_manifest.json" in keys
    assert any(k.startswith("runs/s3run/metrics/rank-1/") for k in keys), "metrics as chunk files"
    frame = rtnb.Result.from_path(uri).metrics_dataframe
    assert sorted(frame[frame["rank"] == 1]["loss"].tolist()) == [1.0, 2.0, 3.0]
    assert [r.name for r in rtnb.list_runs(storage).runs] == ["s3run"]
