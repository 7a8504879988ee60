"""Reporting cells in real notebooks: saved batch output, and the live widget in a kernel."""

from __future__ import annotations

import json
import os

import nbformat
import pytest
from nbclient import NotebookClient

import rtnb
from tests._kernel import Kernel, new_notebook

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"


def _execute(cells: list[str], tmp_path, name: str):
    nb = new_notebook(cells)
    env_live = os.environ.pop("RTNB_LIVE", None)
    try:
        NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    finally:
        if env_live is not None:
            os.environ["RTNB_LIVE"] = env_live
    path = tmp_path / name
    nbformat.write(nb, path)
    return nb, path


def test_batch_output_has_progress_lines_and_a_static_figure_of_the_reports(ray_cluster, tmp_path):
    nb, _ = _execute(
        [
            f"%load_ext rtnb\n%rtnb start --storage {tmp_path}/runs --name metrics-nb",
            "%%rtrain --steps 300\nimport rtnb, torch.distributed as dist\nr = dist.get_rank()\n"
            "for s in range(1, 301):\n    rtnb.report({'loss': 1.0 / s + r, 'acc': s / 300, 'lr': 0.1})",
            "import rtnb\nresult = rtnb.Result.from_path("
            f"'{tmp_path}/runs/metrics-nb')\nprint(len(result.metrics_dataframe), result.metrics)",
            "%rtnb stop",
        ],
        tmp_path,
        "out.ipynb",
    )
    cell = nb.cells[1]
    kinds = [k for o in cell.outputs for k in o.get("data", {})]
    assert WIDGET not in kinds, "no widget may land in a batch notebook"
    figure = next(o["data"][PLOTLY] for o in cell.outputs if PLOTLY in o.get("data", {}))
    traces = {(t["name"], t.get("yaxis", "y")): t for t in figure["data"]}
    assert {name for name, _axis in traces} == {"rank 0", "rank 1", "mean"}
    assert len(traces) == 9, "3 metrics x (2 ranks + mean)"
    subplot_titles = [a["text"] for a in figure["layout"]["annotations"]]
    loss_y = f"y{subplot_titles.index('loss') + 1}".replace("y1", "y")
    rank1 = traces[("rank 1", loss_y)]
    assert rank1["x"][-1] == 300 and rank1["y"][-1] == pytest.approx(1.0 / 300 + 1)
    assert rank1["y"][0] == pytest.approx(2.0)
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    lines = [line for line in text.splitlines() if line.startswith("rtnb: cell")]
    assert 1 <= len(lines) <= 10, text
    assert "step" in lines[-1] and "/300" in lines[-1]
    printed = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert printed.startswith("600 ") and "'lr': 0.1" in printed


def test_saved_batch_notebook_of_a_long_run_stays_small(ray_cluster, tmp_path):
    steps = 100_000
    nb, path = _execute(
        [
            f"%load_ext rtnb\n%rtnb start --storage {tmp_path}/runs --name long",
            f"%%rtrain --steps {steps}\nimport rtnb, math\nfor s in range(1, {steps + 1}):\n"
            "    rtnb.report({'loss': math.exp(-s / 3e4), 'acc': s / 1e5, 'lr': 0.1 * 0.99 ** (s // 1000)})",
            "%rtnb stop",
        ],
        tmp_path,
        "long.ipynb",
    )
    size = path.stat().st_size
    assert size < 1_000_000, f"saved notebook is {size} bytes"
    frame = rtnb.Result.from_path(str(tmp_path / "runs" / "long")).metrics_dataframe
    rank1 = frame[frame["rank"] == 1]
    assert len(rank1) == steps, "every report is on disk at full resolution"
    assert rank1["step"].iloc[-1] == steps


def test_live_widget_in_a_kernel_shows_every_rank_and_the_reported_values(ray_cluster, tmp_path):
    kernel = Kernel(cwd=str(tmp_path), env={**os.environ, "RTNB_LIVE": "1"})
    try:
        assert (
            kernel.execute(f"%load_ext rtnb\n%rtnb start --storage {tmp_path}/runs").status == "ok"
        )
        run = kernel.execute(
            "%%rtrain --steps 3000\nimport rtnb, torch.distributed as dist\nfor s in range(1, 3001):\n"
            "    rtnb.report({'loss': s * (dist.get_rank() + 1)})\nprint('printed to the log panel')"
        )
        assert run.status == "ok", run.traceback
        assert any(WIDGET in r for r in run.results), "the live widget is displayed"
        assert "printed to the log panel" not in run.stdout
        probe = kernel.execute(
            "view = get_ipython().magics_manager.registry['RtnbMagics'].last_view\n"
            "import json\nprint(json.dumps({t.name: [len(t.y), (t.x or [None])[-1], (t.y or [None])[-1]] for t in view.figure.data}))\n"
            "print(view._log_view.value.count('printed to the log panel'), view.redraws)"
        )
        assert probe.status == "ok", probe.traceback
        traces_line, counts_line = probe.stdout.strip().splitlines()
        traces = json.loads(traces_line)
        assert set(traces) == {"rank 0", "rank 1", "mean"}
        assert traces["rank 1"][1:] == [3000, 6000.0] and traces["rank 0"][1:] == [3000, 3000.0]
        assert traces["mean"][2] == 4500.0
        assert all(n <= 1001 for n, _x, _y in traces.values())
        logged, redraws = (int(v) for v in counts_line.split())
        assert logged == 2 and redraws >= 1
        assert kernel.execute("%rtnb stop").status == "ok"
    finally:
        kernel.shutdown()
