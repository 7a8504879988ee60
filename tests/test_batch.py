"""`rtnb run` / `rtnb demo`'s runner as a subprocess, on the example and on bad input."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from tests._kernel import new_notebook
from tests.conftest import CLUSTER_CPUS, wait_for_free_cpus

REPO = Path(__file__).resolve().parent.parent
RTNB = [sys.executable, "-m", "rtnb.batch.cli"]

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _run(args, tmp_path, timeout=300):
    return subprocess.run(
        RTNB + args, capture_output=True, text=True, timeout=timeout, cwd=tmp_path
    )


def _errors(nb) -> list:
    return [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]


def test_quickstart_runs_unattended_with_static_figure_and_metrics(ray_cluster, tmp_path):
    out = tmp_path / "quick.out.ipynb"
    proc = _run(
        ["run", str(REPO / "notebooks" / "quickstart.ipynb"), "-o", str(out), "-p", "steps", "40"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"output notebook: {out}" in proc.stdout
    # The kernel rtnb starts talks over Unix sockets: no warning about plain TCP.
    assert "without encryption" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    nb = nbformat.read(out, as_version=4)
    assert not _errors(nb)
    kinds = {k for cell in nb.cells for o in cell.get("outputs", []) for k in o.get("data", {})}
    assert "application/vnd.plotly.v1+json" in kinds
    assert "application/vnd.jupyter.widget-view+json" not in kinds
    text = "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))
    assert "80 reports from ranks [0, 1]" in text, text[-2000:]
    assert out.stat().st_size < 1_000_000
    # training progress reaches the terminal while it runs (papermill streams cell output)
    # named by its In [N], as the notebook numbers it
    assert re.search(r"rtnb: \[\d+\] · running · step \d+", proc.stdout), proc.stdout[-2000:]
    assert "steps/s" in proc.stdout, proc.stdout[-2000:]
    # The run lands under the caller's rtnb_runs, never in the repository, with a copy
    # of the output notebook.
    runs = list((tmp_path / "rtnb_runs").iterdir())
    assert (
        len(runs) == 1
        and (runs[0] / "run.json").exists()
        and (runs[0] / "metrics" / "rank-0.jsonl").exists()
    )
    assert not (REPO / "notebooks" / "rtnb_runs").exists(), "nothing is written into the repository"
    kept = runs[0] / "notebooks" / out.name
    assert kept.read_bytes() == out.read_bytes()
    assert f"kept in the run directory: {kept}" in proc.stdout


def test_a_failing_cell_exits_non_zero_and_keeps_the_output(ray_cluster, tmp_path):
    nb = new_notebook(
        [
            "%load_ext rtnb\n%rtnb start",
            # Rank 1 raises while rank 0 waits for it in a collective: rank 0 cannot
            # stop and the group is rebuilt; the saved notebook still shows where.
            "%%rtrain\nimport torch, torch.distributed as dist\nif dist.get_rank() == 1:\n"
            "    raise RuntimeError('boom on the ranks')\ndist.all_reduce(torch.ones(1))",
            "print('never')",
        ]
    )
    src = tmp_path / "fails.ipynb"
    nbformat.write(nb, src)
    proc = _run(["run", str(src)], tmp_path)
    assert proc.returncode == 1
    assert "failed" in proc.stderr and "boom on the ranks" in proc.stderr
    saved = nbformat.read(tmp_path / "fails.output.ipynb", as_version=4)
    (error,) = _errors(saved)
    shown = "\n".join(error["traceback"])
    assert error["ename"] == "CellError" and "--- rank 1 ---" in shown, shown
    assert re.search(r"Cell In\[\d+\], line 4\n", shown), shown
    assert "----> 4     raise RuntimeError('boom on the ranks')" in shown, shown
    assert shown.rstrip().splitlines()[-1].startswith("[rtnb] "), "the group's line last"


def test_bad_parameter_name_is_refused_before_running(tmp_path):
    proc = _run(
        ["run", str(REPO / "notebooks" / "quickstart.ipynb"), "-p", "not-a-name", "1"],
        tmp_path,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "not a Python identifier" in proc.stderr and proc.stderr.count("\n") == 1
    missing = _run(["run", "nope.ipynb"], tmp_path, timeout=60)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    zero = _run(
        ["run", str(REPO / "notebooks" / "quickstart.ipynb"), "--timeout", "0"],
        tmp_path,
        timeout=60,
    )
    assert zero.returncode == 2 and zero.stderr.count("\n") == 1
    assert "--timeout must be a positive number of seconds" in zero.stderr


# The examples that the tests above and below run unattended with their own checks.
RUN_BY_THEIR_OWN_TESTS = {"quickstart.ipynb", "batch_template.ipynb"}


@pytest.mark.parametrize(
    "name",
    sorted(
        p.name for p in (REPO / "notebooks").glob("*.ipynb") if p.name not in RUN_BY_THEIR_OWN_TESTS
    ),
)
def test_every_example_notebook_runs_unattended(ray_cluster, tmp_path, name):
    out = tmp_path / f"{name}.out.ipynb"
    proc = _run(["run", str(REPO / "notebooks" / name), "-o", str(out)], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not _errors(nbformat.read(out, as_version=4))
    assert out.stat().st_size < 1_000_000


def test_batch_template_resumes_a_named_run_from_its_latest_checkpoint(ray_cluster, tmp_path):
    template = str(REPO / "notebooks" / "batch_template.ipynb")
    first = _run(
        [
            "run",
            template,
            "-o",
            str(tmp_path / "1.ipynb"),
            "-p",
            "steps",
            "20",
            "-p",
            "run_name",
            "nightly",
        ],
        tmp_path,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert not _errors(nbformat.read(tmp_path / "1.ipynb", as_version=4))
    assert (tmp_path / "1.ipynb").stat().st_size < 1_000_000
    second = _run(
        [
            "run",
            template,
            "-o",
            str(tmp_path / "2.ipynb"),
            "-p",
            "steps",
            "30",
            "-p",
            "run_name",
            "nightly",
        ],
        tmp_path,
    )
    assert second.returncode == 0, second.stderr[-2000:]
    text = "".join(
        o.get("text", "")
        for c in nbformat.read(tmp_path / "2.ipynb", as_version=4).cells
        for o in c.get("outputs", [])
    )
    assert "resumed from step-000000019 at step 20" in text, text[-1500:]


def _notebook(tmp_path: Path, name: str, cells: list[str]) -> Path:
    src = tmp_path / f"{name}.ipynb"
    nbformat.write(new_notebook(cells), src)
    return src


def _checkpoints(tmp_path: Path, run: str):
    from rtnb.storage._checkpoints import CheckpointStore
    from rtnb.storage._rundir import RunDirectory

    return CheckpointStore(RunDirectory(str(tmp_path / "rtnb_runs"), run))


def _assert_nothing_left_behind(tmp_path: Path, name: str, run: str) -> None:
    assert (tmp_path / f"{name}.output.ipynb").exists(), "the output notebook is saved"
    assert (tmp_path / "rtnb_runs" / run / "notebooks" / f"{name}.output.ipynb").exists()
    assert wait_for_free_cpus(CLUSTER_CPUS, timeout=60) >= CLUSTER_CPUS, "ranks left behind"


TRAIN_FOREVER = (
    "%%rtrain\nimport time, rtnb, torch.distributed as dist\n"
    "i = 0\n"
    "while True:\n"
    "    time.sleep(0.1)\n"
    "    rtnb.report({'i': i}, checkpoint=rtnb.Checkpoint.from_state({'i': i}) if dist.get_rank() == 0 else None)\n"
    "    i += 1"
)


def test_a_hung_cell_hits_the_timeout_and_stops_cleanly(ray_cluster, tmp_path):
    src = _notebook(
        tmp_path,
        "hangs",
        [
            "%load_ext rtnb\n%rtnb start --name hung --stop-grace 1",
            "%%rtrain\nimport time\nwhile True:\n    time.sleep(0.1)",
            "print('never')",
        ],
    )
    started = time.monotonic()
    # Long enough for `%rtnb start` on a loaded 2-core machine: the hang is what times out.
    proc = _run(["run", str(src), "--timeout", "25"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "cell [2] ran past --timeout 25 s and was stopped" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - started < 150
    last = nbformat.read(tmp_path / "hangs.output.ipynb", as_version=4).cells[-1]
    assert not last.get("outputs"), "nothing ran after the timed-out cell"
    _assert_nothing_left_behind(tmp_path, "hangs", "hung")


def test_sigterm_stops_the_group_and_keeps_every_committed_checkpoint(ray_cluster, tmp_path):
    src = _notebook(
        tmp_path,
        "term",
        ["%load_ext rtnb\n%rtnb start --name term --stop-grace 1", TRAIN_FOREVER],
    )
    proc = subprocess.Popen(
        [*RTNB, "run", str(src)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        store = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            run = tmp_path / "rtnb_runs" / "term"
            if (run / "run.json").exists():
                store = _checkpoints(tmp_path, "term")
                if len(store.list()) >= 3:
                    break
            time.sleep(0.2)
        assert store is not None and len(store.list()) >= 3, "training did not get going"
        seen = {c.id for c in store.list()}
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM" in err
    listed = store.list()
    assert seen <= {c.id for c in listed}, "no committed checkpoint was lost"
    for info in listed:
        store.get(info.id).verify(full=True)
    _assert_nothing_left_behind(tmp_path, "term", "term")


def test_a_killed_kernel_exits_non_zero_and_keeps_the_output(ray_cluster, tmp_path):
    src = _notebook(
        tmp_path,
        "dies",
        [
            "%load_ext rtnb\n%rtnb start --name dies",
            "%%rtrain\nimport rtnb\nfor i in range(3):\n    rtnb.report({'i': i}, checkpoint=rtnb.Checkpoint.from_state({'i': i}))",
            "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
            "print('never')",
        ],
    )
    proc = _run(["run", str(src)], tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "DeadKernelError" in proc.stderr, proc.stderr[-2000:]
    _assert_nothing_left_behind(tmp_path, "dies", "dies")
    committed = _checkpoints(tmp_path, "dies").list()
    assert [c.step for c in committed] == [0, 1, 2], "steps count from 0"


def test_a_notebook_without_kernelspec_runs_in_this_pythons_kernel(ray_cluster, tmp_path):
    nb = nbformat.v4.new_notebook()  # as nbformat, jupytext and many tools write them
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext rtnb\n%rtnb start --name bare"),
        nbformat.v4.new_code_cell(
            "%%rtrain\nimport torch.distributed as dist\ndist.get_world_size()"
        ),
        nbformat.v4.new_code_cell("%rtnb stop"),
    ]
    assert "kernelspec" not in nb.metadata
    src = tmp_path / "bare.ipynb"
    nbformat.write(nb, src)
    proc = _run(["run", str(src)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = nbformat.read(tmp_path / "bare.output.ipynb", as_version=4)
    text = "".join(o.get("data", {}).get("text/plain", "") for o in out.cells[1].outputs)
    assert "[rank 1] 2" in text


def test_a_notebook_naming_a_missing_kernel_gets_one_line_listing_the_installed(tmp_path):
    nb = new_notebook(["1"])
    nb.metadata["kernelspec"] = {"name": "julia-1.9", "display_name": "Julia", "language": "julia"}
    src = tmp_path / "julia.ipynb"
    nbformat.write(nb, src)
    proc = _run(["run", str(src)], tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "kernel 'julia-1.9', which is not installed here" in proc.stderr
    assert "python3" in proc.stderr and proc.stderr.count("\n") == 1
    (tmp_path / "broken.ipynb").write_text("{not json")
    proc = _run(["run", str(tmp_path / "broken.ipynb")], tmp_path, timeout=60)
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr
    assert proc.stderr.count("\n") == 1
