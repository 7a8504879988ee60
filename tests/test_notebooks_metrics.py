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
    assert rank1["x"][-1] == 299, "steps count from 0"
    assert rank1["y"][-1] == pytest.approx(1.0 / 300 + 1)
    assert rank1["y"][0] == pytest.approx(2.0)
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    lines = [line for line in text.splitlines() if line.startswith("rtnb: [")]
    assert 1 <= len(lines) <= 10, text
    assert "step 299" in lines[-1] and "300/300 done" in lines[-1], lines[-1]
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
    assert rank1["step"].iloc[-1] == steps - 1, "steps count from 0"


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
            "import json\nprint(json.dumps({t.name: [len(t.y), float(t.x[-1]), float(t.y[-1])] for t in view.figure.data}))\n"
            "print(view._log_view.value.count('printed to the log panel'), view.redraws)"
        )
        assert probe.status == "ok", probe.traceback
        traces_line, counts_line = probe.stdout.strip().splitlines()
        traces = json.loads(traces_line)
        assert set(traces) == {"rank 0", "rank 1", "mean"}
        assert traces["rank 1"][1:] == [2999, 6000.0] and traces["rank 0"][1:] == [2999, 3000.0]
        assert traces["mean"][2] == 4500.0
        assert all(n <= 1001 for n, _x, _y in traces.values())
        logged, redraws = (int(v) for v in counts_line.split())
        assert logged == 2 and redraws >= 1
        assert kernel.execute("%rtnb stop").status == "ok"
    finally:
        kernel.shutdown()


SVG = "image/svg+xml"


def test_live_cells_leave_figures_that_last_in_the_saved_notebook(ray_cluster, tmp_path):
    """A notebook run with the live view (as in JupyterLab) and saved: every widget is
    replaced by a static figure with its own buttons (log y, outliers, EMA) and an SVG
    (GitHub, nbviewer, nbconvert), the printed lines stay as text, a cell that
    reported nothing leaves text only, and `%rtnb plot` draws any run's record."""
    nb = new_notebook(
        [
            f"%load_ext rtnb\n%rtnb start --storage {tmp_path}/runs --name lasting",
            "%%rtrain --steps 50\nimport rtnb\nfor s in range(50):\n"
            "    rtnb.report({'loss': 100.0 if s < 2 else 1.0 / (s + 1), 'acc': s / 50})\n"
            "print('hello from the cell')",
            "%%rtrain\nx = 1\nprint('no reports here')",
            "%rtrain y = 2",
            "%%rtrain --background\nfor s in range(20):\n    rtnb.report({'loss': 0.5})",
            "%rtnb wait",
            "%rtnb plot lasting --metric loss",
            "%rtnb plot no-such-run",
            "%rtnb stop",
        ]
    )
    saved = os.environ.get("RTNB_LIVE")
    os.environ["RTNB_LIVE"] = "1"
    try:
        NotebookClient(
            nb,
            timeout=600,
            kernel_name="python3",
            allow_errors=True,
            resources={"metadata": {"path": str(tmp_path)}},
        ).execute()
    finally:
        if saved is None:
            os.environ.pop("RTNB_LIVE")
        else:
            os.environ["RTNB_LIVE"] = saved
    path = tmp_path / "lasting.ipynb"
    nbformat.write(nb, path)
    left = [
        (i, o["data"].get("text/plain", ""))
        for i, cell in enumerate(nb.cells)
        for o in cell.outputs
        if WIDGET in o.get("data", {})
    ]
    assert not left, f"no widget is left to read 'model not found' when reopened: {left}"

    def data(cell_index: int) -> list[dict]:
        return [o.get("data", {}) for o in nb.cells[cell_index].outputs]

    trained = data(1)
    figure = next(d for d in trained if PLOTLY in d)
    assert SVG in figure and figure[SVG].startswith("<svg")
    layout = figure[PLOTLY]["layout"]
    labels = [b["label"] for menu in layout["updatemenus"] for b in menu["buttons"]]
    assert {"log y", "fit all", "ignore outliers", "raw", "EMA 0.9"} <= set(labels)
    assert "done" in layout["title"]["text"] and "50/50" in layout["title"]["text"]
    loss_axis = layout["yaxis"]  # loss is reported first: the first subplot
    assert loss_axis["range"][1] < 100.0, "the first steps' outliers are left out of the y range"
    assert any("[rank 1] hello from the cell" in d.get("text/plain", "") for d in trained)

    kinds_2 = {o.get("output_type") for o in nb.cells[2].outputs}
    assert kinds_2 == {"stream"}, "a cell that never reported gets no view, its lines print"
    printed = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert "[rank 0] no reports here" in printed and "[rank 1] no reports here" in printed
    assert data(3) == [], "a one-liner shows no view (and here prints nothing)"
    assert any(PLOTLY in d for d in data(4)), "a background cell's view is replaced at its end"

    plotted = next(d[PLOTLY] for d in data(6) if PLOTLY in d)
    assert [a["text"] for a in plotted["layout"]["annotations"]] == ["loss"]
    rank0 = next(t for t in plotted["data"] if t["name"] == "rank 0")
    assert len(rank0["y"]) == 70, "both cells' reports, read from the run's record"
    said = "".join(o.get("text", "") for o in nb.cells[7].outputs)
    assert "UsageError: no run 'no-such-run'" in said and "%rtnb runs" in said

    for index in (1, 4, 6):
        kinds_shown = [sorted(d) for d in data(index)]
        assert any(d.get(SVG, "").startswith("<svg") for d in data(index)), (index, kinds_shown)

    from nbconvert import HTMLExporter

    html, _ = HTMLExporter().from_filename(str(path))
    # nbconvert shows each SVG output as an <img>; counting "<svg" in the page counted
    # the plotly logo inside the widget state nbclient keeps of every widget it saw
    # (it never drops a closed one), so it passed whatever the outputs were.
    assert html.count('data-mime-type="image/svg+xml"') >= 3, (
        "the figures show in nbconvert's HTML",
        [[sorted(d) for d in data(i)] for i in range(len(nb.cells))],
    )
