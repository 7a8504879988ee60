"""`rtnb run` / `rtnb demo`'s runner as a subprocess, on the example and on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tests._kernel import new_notebook

REPO = Path(__file__).resolve().parent.parent
RTNB = [sys.executable, "-m", "rtnb.cli"]

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _run(args, tmp_path, timeout=300):
    return subprocess.run(
        RTNB + args, capture_output=True, text=True, timeout=timeout, cwd=tmp_path
    )


def test_quickstart_runs_unattended_with_static_figure_and_metrics(ray_cluster, tmp_path):
    out = tmp_path / "quick.out.ipynb"
    proc = _run(
        ["run", str(REPO / "notebooks" / "quickstart.ipynb"), "-o", str(out), "-p", "steps", "40"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"output notebook: {out}" in proc.stdout
    nb = nbformat.read(out, as_version=4)
    kinds = {k for cell in nb.cells for o in cell.get("outputs", []) for k in o.get("data", {})}
    assert "application/vnd.plotly.v1+json" in kinds
    assert "application/vnd.jupyter.widget-view+json" not in kinds
    text = "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))
    assert "80 reports from ranks [0, 1]" in text, text[-2000:]
    assert out.stat().st_size < 1_000_000


def test_a_failing_cell_exits_non_zero_and_keeps_the_output(ray_cluster, tmp_path):
    nb = new_notebook(
        [
            "%load_ext rtnb\n%rtnb start",
            "%%rtrain\nraise RuntimeError('boom on the ranks')",
            "print('never')",
        ]
    )
    src = tmp_path / "fails.ipynb"
    nbformat.write(nb, src)
    proc = _run(["run", str(src)], tmp_path)
    assert proc.returncode == 1
    assert "failed" in proc.stderr and "boom on the ranks" in proc.stderr
    assert (tmp_path / "fails.output.ipynb").exists()


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


def test_runs_land_under_the_callers_rtnb_runs(ray_cluster, tmp_path):
    proc = _run(
        [
            "run",
            str(REPO / "notebooks" / "quickstart.ipynb"),
            "-o",
            str(tmp_path / "o.ipynb"),
            "-p",
            "steps",
            "8",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = list((tmp_path / "rtnb_runs").iterdir())
    assert (
        len(runs) == 1
        and (runs[0] / "run.json").exists()
        and (runs[0] / "metrics" / "rank-0.jsonl").exists()
    )
    assert not (REPO / "notebooks" / "rtnb_runs").exists(), "nothing is written into the repository"


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb")))
def test_every_example_notebook_runs_unattended(ray_cluster, tmp_path, name):
    out = tmp_path / f"{name}.out.ipynb"
    proc = _run(["run", str(REPO / "notebooks" / name), "-o", str(out)], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    nb = nbformat.read(out, as_version=4)
    errors = [
        o for cell in nb.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"
    ]
    assert not errors
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
    assert "resumed from step-000000020 at step 20" in text, text[-1500:]
