"""`rtnb submit` / `jobs` / `logs` against the session's cluster's job server (its
dashboard on loopback): the notebook runs as a real Ray Job on the head."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CLUSTER_CPUS, wait_for_free_cpus

REPO = Path(__file__).resolve().parent.parent
RTNB = [sys.executable, "-m", "rtnb.batch.cli"]

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _rtnb(args, cwd, timeout=300):
    return subprocess.run(RTNB + args, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_a_submitted_notebook_runs_as_a_ray_job_and_keeps_its_results(
    ray_head, ray_cluster, tmp_path
):
    address = ray_head.wait_dashboard()
    storage = tmp_path / "runs"
    proc = _rtnb(
        [
            "submit",
            str(REPO / "notebooks" / "batch_template.ipynb"),
            "--address",
            address,
            "--storage",
            str(storage),
            "-p",
            "steps",
            "20",
            "-p",
            "run_name",
            "jobrun",
            "--wait",
        ],
        tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    job = re.search(r"submitted (\S+)", proc.stdout).group(1)
    assert "batch_template.ipynb ran to completion" in proc.stdout, "the job's log was followed"
    run = storage / "jobrun"
    assert list((run / "checkpoints").glob("step-*/_manifest.json")), "checkpoints committed"
    assert (run / "notebooks" / "batch_template.output.ipynb").exists(), "output notebook kept"

    listed = _rtnb(["jobs", "--address", address], tmp_path, timeout=60)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(job))
    assert "SUCCEEDED" in row and "batch_template.ipynb" in row

    logs = _rtnb(["logs", job, "--address", address], tmp_path, timeout=60)
    assert logs.returncode == 0 and "ran to completion" in logs.stdout
    assert "SUCCEEDED" in logs.stderr
    assert wait_for_free_cpus(CLUSTER_CPUS, timeout=60) >= CLUSTER_CPUS, "ranks left behind"


def test_bad_submissions_get_one_line_before_anything_runs(ray_head, tmp_path):
    notebook = str(REPO / "notebooks" / "batch_template.ipynb")
    bad_name = _rtnb(
        ["submit", notebook, "--address", ray_head.dashboard_url, "-p", "bad-name", "1"],
        tmp_path,
        timeout=60,
    )
    assert bad_name.returncode == 2 and "not a Python identifier" in bad_name.stderr
    no_time = _rtnb(
        ["submit", notebook, "--address", ray_head.dashboard_url, "--timeout", "-1"],
        tmp_path,
        timeout=60,
    )
    assert no_time.returncode == 2 and "--timeout must be a positive" in no_time.stderr
    nobody = _rtnb(["submit", notebook, "--address", "http://127.0.0.1:9"], tmp_path, timeout=60)
    assert nobody.returncode == 2
    assert nobody.stderr.count("\n") == 1 and "no Ray dashboard answers" in nobody.stderr
    unknown = _rtnb(["logs", "nope", "--address", ray_head.wait_dashboard()], tmp_path, timeout=60)
    assert unknown.returncode == 2 and "no job 'nope'" in unknown.stderr


def test_a_jobs_detached_group_is_left_running_then_listed_followed_and_stopped_from_a_terminal(
    ray_head, ray_cluster, tmp_path
):
    """A submitted notebook that starts --detached: its job ends, its group stays on
    the cluster, found and freed there with --address, as from a notebook's kernel."""
    import json

    from tests._kernel import new_notebook

    address = ray_head.wait_dashboard()
    notebook = tmp_path / "detached_job.ipynb"
    cells = [
        "%load_ext rtnb",
        "%rtnb start --detached --name jobdet --workers 2 --cpus-per-worker 0.5",
        "%%rtrain\nimport rtnb\nfor s in range(3):\n    rtnb.report({'loss': 1.0 / (s + 1)}, step=s)",
    ]
    notebook.write_text(json.dumps(new_notebook(cells)))
    proc = _rtnb(
        [
            "submit",
            str(notebook),
            "--address",
            address,
            "--storage",
            str(tmp_path / "runs"),
            "--wait",
        ],
        tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "run 'jobdet' was started --detached and is left running on purpose" in proc.stdout
    gcs = ["--address", ray_head.address]
    listed = _rtnb(["ps", *gcs], tmp_path, timeout=120)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("jobdet"))
    assert "ready" in row and "1 CPU" in row and "no kernel" in row, row
    followed = _rtnb(["attach", "jobdet", *gcs], tmp_path, timeout=120)
    assert "has no cell running (cell [3] ended)" in followed.stdout, (
        followed.stdout + followed.stderr
    )
    stopped = _rtnb(["stop", "jobdet", *gcs], tmp_path, timeout=120)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
    assert wait_for_free_cpus(CLUSTER_CPUS, timeout=60) >= CLUSTER_CPUS, "ranks left behind"
