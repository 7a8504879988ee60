"""The runs dashboard on real run directories: its table and curves are the runs'
metrics records; the saved/terminal form keeps the table and a figure; a resumed
line is drawn as a branch over the original."""

from __future__ import annotations

from rtnb.metrics._store import MetricsStore
from rtnb.storage._metricslog import MetricsLog, read_metrics
from rtnb.storage._result import list_runs, read_run_metrics
from rtnb.storage._rundir import RunDirectory


def _run(tmp_path, name: str, losses: dict[int, list[float]], status: str, updated: float):
    run_dir = RunDirectory(str(tmp_path), name)
    run_dir.ensure_writable()
    log = MetricsLog(run_dir)
    for rank, values in losses.items():
        store = MetricsStore(log=log)
        store.begin(sorted(losses))
        store.add(rank, [(i, 100.0 + i, {"loss": v}) for i, v in enumerate(values)])
        store.flush()
    run_dir.write_json(
        "run.json",
        {
            "run_name": name,
            "status": status,
            "config": {"workers": len(losses), "backend": "gloo", "score": "loss", "mode": "min"},
            "started": 50.0,
            "updated": updated,
            "line": 0,
            "last_step": len(losses[0]) - 1,
        },
    )


def test_dashboard_rows_and_overlaid_curves_are_the_runs_metrics_records(tmp_path):
    from rtnb.widgets import RunsDashboard, runs_bundle

    _run(tmp_path, "fast", {0: [4.0, 2.0, 1.0, 1.5], 1: [6.0, 4.0, 3.0, 2.5]}, "stopped", 200.0)
    _run(tmp_path, "slow", {0: [5.0, 4.5], 1: [5.0, 3.5]}, "failed", 100.0)
    _run(tmp_path, "now", {0: [9.0, 8.0, 7.0]}, "running", 300.0)
    storage = str(tmp_path)

    def load(name):
        return MetricsStore.from_rows(read_run_metrics(storage, name))

    view = RunsDashboard(lambda: list_runs(storage), load, refresh_s=0)
    try:
        rows = {r["run"]: r for r in view.rows()}
        assert [r["run"] for r in view.rows()] == ["now", "fast", "slow"], "newest first"
        assert {n: r["status"] for n, r in rows.items()} == {
            "now": "live",
            "fast": "finished",
            "slow": "failed",
        }
        # last and best of the mean over ranks, from the records themselves
        for name in rows:
            by_step: dict[int, list[float]] = {}
            for row in read_metrics(RunDirectory(storage, name)):
                by_step.setdefault(row["step"], []).append(row["loss"])
            means = [sum(v) / len(v) for _s, v in sorted(by_step.items())]
            assert rows[name]["last"] == means[-1] and rows[name]["best"] == min(means), name
        assert rows["fast"]["steps"] == 4 and rows["fast"]["ranks"] == 2
        assert "score=loss(min)" in rows["fast"]["config"]
        best = next(c for c in view.table.columns if c["key"] == "best")
        assert best["label"] == "best loss" and best["descending_first"] is False
        view.table.sort_by, view.table.descending = "best", False  # a click on its header
        assert [r["run"] for r in view.rows()] == ["fast", "slow", "now"], "lowest best first"
        assert view.picked == ["now"], "the first listed is drawn; a re-sort keeps the ticks"
        states = {row["id"]: row["badges"] for row in view.table.rows}
        assert states["slow"] == [["failed", "bad"]] and states["now"] == [["live", "busy"]]
        view.pick("fast", "slow")
        curves = {t.name: list(t.y) for t in view.figure.data}
        assert curves == {"fast": [5.0, 3.0, 2.0, 2.0], "slow": [5.0, 4.0]}
        view.band.value = True
        assert len(view.figure.data) == 6, "each run's mean with its min-max band"
        view.log_y.value = True
        assert view.figure.layout.yaxis.type == "log"
        view.x_axis.value = "time"
        assert view.figure.layout.xaxis.title.text == "seconds"
        bundle = runs_bundle(list_runs(storage).runs, {n: load(n) for n in rows}, "loss")
        assert "best loss" in bundle["text/plain"] and "fast" in bundle["text/plain"]
        assert bundle["image/svg+xml"].count("<polyline") == 3, "one curve per run"
        assert len(bundle["application/vnd.plotly.v1+json"]["data"]) == 3
    finally:
        view.close()


def test_a_resumed_line_is_drawn_as_a_branch_over_the_original():
    from rtnb.widgets._plot import build_figure, trace_keys

    store = MetricsStore()
    store.begin([0])
    store.add(0, [(i, float(i), {"loss": 10.0 - i}) for i in range(8)])
    store.add(0, [(i, 20.0 + i, {"loss": 5.0 - i}) for i in range(3, 6)])
    keys = trace_keys(store)
    assert keys == [("loss", "earlier-0"), ("loss", 0)]
    fig = build_figure(store, keys, widget=False)
    earlier, current = fig.data
    assert list(earlier.x) == list(range(8)) and earlier.line.dash == "dot"
    assert list(current.x) == [3, 4, 5], "the branch starts at the checkpoint's next step"
    # A record read back (another kernel's %rtnb plot) draws the same picture.
    rows = [
        {"rank": 0, "step": s, "timestamp": t, "loss": v}
        for s, t, v in [(i, float(i), 10.0 - i) for i in range(8)]
        + [(i, 20.0 + i, 5.0 - i) for i in range(3, 6)]
    ]
    again = MetricsStore.from_rows(rows)
    assert again.earlier_series("loss", 0)[0] == list(range(8))
    assert again.series("loss", 0)[0] == [3, 4, 5]


def test_a_two_rank_record_read_back_has_one_earlier_line_per_resume():
    rows = []
    for rank in (0, 1):
        rows += [
            {"rank": rank, "step": i, "timestamp": float(i), "x": 1.0 + rank} for i in range(6)
        ]
        rows += [{"rank": rank, "step": i, "timestamp": 9.0 + i, "x": 5.0} for i in range(2, 4)]
    store = MetricsStore.from_rows(rows)
    assert len(store.earlier) == 1
    assert store.earlier_series("x", 0)[2] == [1.5] * 6, "the earlier line is the mean of both"
    assert store.mean_series("x")[0] == [2, 3]


def test_the_dashboard_draws_a_resumed_run_with_the_main_line_it_came_from():
    from rtnb.widgets._runs import runs_figure

    # 200 steps on the main line, then resumed from step 99: a branch 100..199.
    rows = [
        {"rank": 0, "step": i, "timestamp": float(i), "loss": 2.0 * 0.98**i} for i in range(200)
    ]
    rows += [{"rank": 0, "step": i, "timestamp": 300.0 + i, "loss": 0.5} for i in range(100, 200)]
    fig = runs_figure({"resumed": MetricsStore.from_rows(rows)}, ["resumed"], "loss")
    main, branch = fig.data
    assert list(main.x) == list(range(200)) and main.line.dash == "dot", "the main line, dotted"
    assert list(branch.x) == list(range(100, 200)) and branch.name == "resumed"
    assert main.line.color == branch.line.color and main.legendgroup == branch.legendgroup
    assert fig.layout.showlegend is True and fig.layout.title.text == "loss", "one run: a legend"
    assert fig.layout.yaxis.title.text == "loss" and fig.layout.autosize is True


def test_one_runs_first_loss_does_not_flatten_the_others_unless_asked():
    from rtnb.widgets._runs import runs_figure

    def store(first: float) -> MetricsStore:
        values = [first] + [1.0 / s for s in range(1, 100)]
        return MetricsStore.from_rows(
            [{"rank": 0, "step": i, "timestamp": float(i), "loss": v} for i, v in enumerate(values)]
        )

    stores = {"wild": store(1000.0), "calm": store(1.2)}
    clipped = runs_figure(stores, ["wild", "calm"], "loss", outliers=True)
    assert clipped.layout.yaxis.range[1] < 5.0, "the 1000 at step 0 is left out"
    full = runs_figure(stores, ["wild", "calm"], "loss", outliers=False)
    assert full.layout.yaxis.range is None


def test_a_live_run_says_when_its_curves_were_last_read(tmp_path):
    """While a run is live the dashboard says when it last read it (a plot that stopped
    moving is told apart from a run that stopped reporting); without one, nothing."""
    from rtnb.widgets import RunsDashboard

    storage = str(tmp_path)

    def load(name):
        return MetricsStore.from_rows(read_run_metrics(storage, name))

    _run(tmp_path, "done", {0: [1.0, 0.5]}, "stopped", 100.0)
    quiet = RunsDashboard(lambda: list_runs(storage), load, refresh_s=30, title="runs")
    try:
        assert quiet.title.value == "<b>runs</b>"
    finally:
        quiet.close()
    _run(tmp_path, "now", {0: [9.0, 8.0]}, "running", 300.0)
    view = RunsDashboard(lambda: list_runs(storage), load, refresh_s=30, title="runs")
    try:
        assert view.title.value.startswith('<b>runs</b> <span class="rtnb-runs-read">')
        assert "live: now, re-read every 30 s, last at " in view.title.value
        _run(tmp_path, "now", {0: [9.0, 8.0, 7.0]}, "stopped", 400.0)
        view.refresh()
        assert view.title.value == "<b>runs</b>", "a finished run is not re-read"
    finally:
        view.close()
