"""JupyterLab's scheduler (jupyter-scheduler) as a client: jobs created through its
REST API, in a real Jupyter server, run an rtnb notebook in a kernel of their own.

A job completes with the lasting figure kept in its output notebook; a job whose
rank raised is FAILED, and its status message and its output notebook both show the
rank's traceback. Skipped where jupyter-scheduler is not installed (never in CI).
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from tests._jupyter import jupyter_server
from tests._kernel import new_notebook
from tests._margins import until
from tests.conftest import require

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOKEN = "rtnb-scheduler-test"


@pytest.fixture
def scheduler(ray_cluster, tmp_path):
    """A Jupyter server with the scheduler's extension, its database and staging area
    in the test's folder; its working folder is its root, where the scheduler's
    download writes a job's files (it writes them relative to the working folder)."""
    require("jupyter_scheduler", "the scheduler test drives jupyter-scheduler's API")
    root = tmp_path / "root"
    root.mkdir()
    with jupyter_server(
        "jupyter-server",
        root,
        tmp_path / "server.log",
        TOKEN,
        env={"JUPYTER_DATA_DIR": str(tmp_path / "data")},
        cwd=root,
    ) as url:
        yield url, root


def _call(url: str, path: str, body: dict | None = None):
    request = urllib.request.Request(
        f"{url}/{path}?token={TOKEN}",
        data=None if body is None else json.dumps(body).encode(),
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        text = answer.read()
    return json.loads(text) if text else None


def _job(url: str, root: Path, name: str, cells: list[str]) -> dict:
    """The job of notebook ``name`` created through the API, once it ended."""
    nbformat.write(new_notebook(cells), root / f"{name}.ipynb")
    environment = _call(url, "scheduler/runtime_environments")[0]["name"]
    created = _call(
        url,
        "scheduler/jobs",
        {
            "input_uri": f"{name}.ipynb",
            "runtime_environment_name": environment,
            "name": name,
            "output_formats": ["ipynb"],
        },
    )
    job_id = created["job_id"]

    def ended() -> dict | None:
        job = _call(url, f"scheduler/jobs/{job_id}")
        # A job is STOPPED, by the scheduler's default, from its creation until its
        # process starts it: only its end time tells a stopped job from a new one.
        return job if job["status"] in ("COMPLETED", "FAILED") or job["end_time"] else None

    return until(f"the scheduler's job {name!r} ending", ended, 300)


def _output_notebook(url: str, root: Path, job: dict):
    """The job's output notebook, fetched as the scheduler's "Download" does."""
    _call(url, f"scheduler/jobs/{job['job_id']}/download_files")
    folder = root / "jobs" / f"{job['name']}-{job['job_id']}"

    def written() -> Path | None:
        found = [p for p in folder.glob("*.ipynb") if p.name != f"{job['name']}.ipynb"]
        return found[0] if found and found[0].stat().st_size else None

    path = until("the job's output notebook downloaded", written, 60)
    time.sleep(0.5)  # the download's own process may still be writing the last bytes
    return nbformat.read(path, as_version=4)


def test_a_scheduler_job_completes_with_its_figure_and_a_failing_one_shows_the_ranks_traceback(
    scheduler,
):
    url, root = scheduler
    done = _job(
        url,
        root,
        "trains",
        [
            "%load_ext rtnb\n%rtnb start --workers 2",
            "%%rtrain\nimport rtnb\nfor step in range(30):\n    rtnb.report({'loss': 1.0 / (step + 1)})",
            "print('trained')",
        ],
    )
    assert done["status"] == "COMPLETED", done.get("status_message")
    nb = _output_notebook(url, root, done)
    kinds = {k for cell in nb.cells for o in cell.get("outputs", []) for k in o.get("data", {})}
    # The lasting figure, interactive and as a picture, in the saved notebook.
    assert {"application/vnd.plotly.v1+json", "image/svg+xml"} <= kinds, kinds
    plain = "".join(
        o.get("data", {}).get("text/plain", "") + o.get("text", "")
        for cell in nb.cells
        for o in cell.get("outputs", [])
    )
    assert "loss for ranks [0, 1], 30 steps" in plain and "trained" in plain, plain[-2000:]

    failed = _job(
        url,
        root,
        "fails",
        [
            "%load_ext rtnb\n%rtnb start --workers 2",
            "%%rtrain\nimport torch, torch.distributed as dist\nif dist.get_rank() == 1:\n"
            "    raise RuntimeError('boom on the ranks')\ndist.all_reduce(torch.ones(1))",
            "print('never')",
        ],
    )
    assert failed["status"] == "FAILED"
    message = failed["status_message"]
    # The scheduler's job list shows the rank's frame, numbered as the editor numbers
    # the cell, and rtnb's line of what happened to the group last.
    assert "--- rank 1 ---" in message and "----> 4     raise RuntimeError" in message, message
    assert message.rstrip().splitlines()[-1].startswith("[rtnb] "), message[-800:]
    saved = _output_notebook(url, root, failed)
    errors = [
        o for cell in saved.cells for o in cell.get("outputs", []) if o["output_type"] == "error"
    ]
    assert len(errors) == 1 and errors[0]["ename"] == "CellError", errors
    shown = "\n".join(errors[0]["traceback"])
    assert "Cell In[2], line 4" in shown and "boom on the ranks" in shown, shown
    assert not any("never" in o.get("text", "") for c in saved.cells for o in c.get("outputs", []))
