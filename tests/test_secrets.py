"""No secret is ever written or printed: a secret planted through every entry point
(the ranks' env, a storage URI with credentials, `rtnb run` and `rtnb submit
--storage`, a secret-named `-p`) is grepped for in everything rtnb wrote.

Storage is a real S3-compatible server (moto) on loopback; moto accepts any key.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import nbformat
import pytest

import rtnb
from tests._kernel import new_notebook
from tests.conftest import CLUSTER_CPUS, wait_for_free_cpus
from tests.test_s3 import CREDENTIALS, s3_storage  # noqa: F401 - the moto fixture

pytestmark = [pytest.mark.ray, pytest.mark.slow]
RTNB = [sys.executable, "-m", "rtnb.batch.cli"]


def _with_credentials(storage: str, secret: str) -> str:
    """``s3://bucket/...`` → ``s3://testing:SECRET@bucket/...?...&secret_key=SECRET``."""
    scheme, rest = storage.split("://", 1)
    return f"{scheme}://testing:{secret}@{rest}"


def _everything_in(client, prefix: str) -> str:
    listed = client.list_objects_v2(Bucket="rtnb-test", Prefix=prefix).get("Contents", [])
    assert listed, f"nothing written under {prefix}"
    blobs = [client.get_object(Bucket="rtnb-test", Key=o["Key"])["Body"].read() for o in listed]
    return "\n".join(b.decode("latin-1") for b in blobs) + "\n".join(o["Key"] for o in listed)


def test_secrets_planted_in_a_session_appear_nowhere(ray_cluster, s3_storage, monkeypatch, capfd):  # noqa: F811
    storage, client = s3_storage
    key_secret, env_secret = f"uri-{uuid.uuid4().hex}", f"env-{uuid.uuid4().hex}"
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    secret_storage = _with_credentials(storage, key_secret)
    with rtnb.Session(
        workers=2,
        storage=secret_storage,
        name="planted",
        env={"AWS_SESSION_TOKEN": env_secret},
    ) as session:
        assert session.run("import os\nos.environ['AWS_SESSION_TOKEN'][:4]") == {
            0: "env-",
            1: "env-",
        }, "the ranks do get the value"
        session.run(
            "import rtnb\nrtnb.report({'loss': 1.0}, checkpoint=rtnb.Checkpoint.from_state({'a': 1}))"
        )
        shown = [
            repr(session.result()),
            str(session.result().path),
            str(session.status()),
            str(rtnb.list_runs(secret_storage)),
            repr(session.list_checkpoints()),
        ]
        with pytest.raises(rtnb.CheckpointError) as info:
            session.checkpoint_store("no-such-run")
        shown.append(str(info.value))
        frame = session.result().metrics_dataframe  # still readable with the real URI
        assert frame["loss"].tolist() == [1.0, 1.0]
    out, err = capfd.readouterr()
    written = _everything_in(client, "runs/planted/")
    record = json.loads(
        client.get_object(Bucket="rtnb-test", Key="runs/planted/run.json")["Body"].read()
    )
    assert record["config"]["env"] == ["AWS_SESSION_TOKEN"], "env recorded by name only"
    assert "***" in record["config"]["storage"]
    for secret in (key_secret, env_secret):
        for where, text in [("storage", written), ("stdout", out), ("stderr", err)] + [
            (f"shown[{i}]", s) for i, s in enumerate(shown)
        ]:
            assert secret not in text, f"secret found in {where}"


def test_secrets_given_to_rtnb_run_and_submit_appear_nowhere(
    ray_head,
    ray_cluster,
    s3_storage,  # noqa: F811 - the moto fixture, imported above
    tmp_path,
):
    storage, client = s3_storage
    secret = f"batch-{uuid.uuid4().hex}"
    secret_storage = _with_credentials(storage, secret)
    env = {**os.environ, **CREDENTIALS, "RTNB_STORAGE": secret_storage}
    nb = new_notebook(
        [
            "%load_ext rtnb\n%rtnb start --name batchsecret",
            "%%rtrain\nimport rtnb\nrtnb.report({'x': 1.0})",
            "%rtnb status",
            "r = %rtnb result\nprint(r)",
            "%rtnb runs",
            "%rtnb stop",
        ]
    )
    src = tmp_path / "secret.ipynb"
    nbformat.write(nb, src)
    proc = subprocess.run(
        [*RTNB, "run", str(src)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = (tmp_path / "secret.output.ipynb").read_text()
    assert "batchsecret" in output
    written = _everything_in(client, "runs/batchsecret/")
    assert "notebooks/secret.output.ipynb" in written, "output notebook kept in the run dir"
    for where, text in [
        ("output notebook", output),
        ("run directory", written),
        ("stdout", proc.stdout),
        ("stderr", proc.stderr),
    ]:
        assert secret not in text, f"secret found in {where}"

    # A parameter named like a secret is refused: parameters land in the notebook.
    refused = subprocess.run(
        [*RTNB, "run", str(src), "-p", "api_token", "x"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "looks like a secret" in refused.stderr
    assert refused.stderr.count("\n") == 1

    # rtnb submit: the storage URI never shows in the job's entrypoint, env or metadata.
    address = ray_head.wait_dashboard()
    job_src = tmp_path / "job.ipynb"
    nbformat.write(
        new_notebook(
            [
                "%load_ext rtnb\n%rtnb start --name jobsecret",
                "%%rtrain\nimport rtnb\nrtnb.report({'x': 2.0})",
                "%rtnb stop",
            ]
        ),
        job_src,
    )
    sub = subprocess.run(
        [
            *RTNB,
            "submit",
            str(job_src),
            "--address",
            address,
            "--storage",
            secret_storage,
            "--wait",
        ],
        capture_output=True,
        text=True,
        env={**env, "RTNB_STORAGE": ""},
        cwd=tmp_path,
        timeout=600,
    )
    assert sub.returncode == 0, sub.stdout[-3000:] + sub.stderr[-2000:]
    job = re.search(r"submitted (\S+)", sub.stdout).group(1)
    from ray.job_submission import JobSubmissionClient

    info = JobSubmissionClient(address).get_job_info(job)
    visible = json.dumps(
        {
            "entrypoint": info.entrypoint,
            "metadata": info.metadata,
            "runtime_env": info.runtime_env,
            "message": info.message,
        },
        default=str,
    )
    assert secret not in visible, f"secret in the job's visible info: {visible}"
    assert secret not in sub.stdout + sub.stderr
    written = _everything_in(client, "runs/jobsecret/")
    assert secret not in written
    assert wait_for_free_cpus(CLUSTER_CPUS, timeout=60) >= CLUSTER_CPUS
