"""Metrics without Ray: bounded series, the store, the on-disk record, Result, views."""

from __future__ import annotations

import json
import re

import pytest

from rtnb.metrics._series import BoundedSeries
from rtnb.metrics._store import MetricsStore
from rtnb.storage._metricslog import MetricsLog, read_metrics
from rtnb.storage._result import Result, list_runs
from rtnb.storage._rundir import RunDirectory
from tests.conftest import require


def test_bounded_series_keeps_few_evenly_spread_points_and_the_latest():
    series = BoundedSeries(capacity=100)
    for step in range(1, 100_001):
        series.append(step, float(step), step * 2.0)
    steps, _times, values = series.snapshot()
    assert len(steps) <= 101
    assert steps[0] == 1 and steps[-1] == 100_000 and values[-1] == 200_000.0
    gaps = {b - a for a, b in zip(steps[:-2], steps[1:-1])}
    assert len(gaps) == 1, "points are evenly spaced"
    assert len(series.snapshot(max_points=10)[0]) <= 11


def _store(tmp_path, name="run-a"):
    run_dir = RunDirectory(str(tmp_path), name)
    run_dir.ensure_writable()
    run_dir.write_json(
        "run.json", {"run_name": name, "status": "ready", "config": {"workers": 2}, "updated": 1.0}
    )
    return MetricsStore(log=MetricsLog(run_dir), capacity=64), run_dir


def test_store_keeps_per_rank_series_the_mean_and_writes_every_report(tmp_path, monkeypatch):
    store, run_dir = _store(tmp_path)
    store.begin([0, 1])
    for step in range(1, 501):
        store.add(0, [(step, 1000.0 + step, {"loss": 1.0, "note": "text"})])
        store.add(1, [(step, 1000.0 + step, {"loss": 3.0})])
    store.flush()
    assert store.metric_names() == ["loss"], "non-numeric values are not plotted"
    steps, _t, values = store.series("loss", 1)
    assert len(steps) <= 65 and set(values) == {3.0}
    assert set(store.mean_series("loss")[2]) == {2.0}
    result = Result.from_path(run_dir.uri)
    frame = result.metrics_dataframe
    assert len(frame) == 1000 and list(frame.columns[:3]) == ["rank", "step", "timestamp"]
    assert frame[frame["rank"] == 0]["step"].tolist() == list(range(1, 501))
    assert result.metrics["loss"] == 2.0 and result.metrics_per_rank[1]["loss"] == 3.0
    # As the runs folder is shown (relative to the notebook's folder), and as a user
    # types a run's folder name alone from inside the runs folder.
    for where, path in ((tmp_path.parent, f"{tmp_path.name}/run-a"), (tmp_path, "run-a")):
        monkeypatch.chdir(where)
        again = Result.from_path(path)
        assert again.run_name == "run-a" and again.metrics == result.metrics
        assert RunDirectory(path.rpartition("/")[0] or ".", "run-a").path == run_dir.path
    assert [r.name for r in list_runs(str(tmp_path)).runs] == ["run-a"]


def test_progress_flags_a_rank_clearly_slower_than_the_median(tmp_path):
    store, _ = _store(tmp_path)
    store.begin([0, 1, 2], total_steps=1000)
    now = 5000.0
    for i in range(50):
        t = now - 4 + i * 0.08
        store.add(0, [(i, t, {"x": 1})])
        store.add(1, [(i, t, {"x": 1})])
        if i % 3 == 0:  # rank 2 reports a third as often
            store.add(2, [(i // 3, t, {"x": 1})])
    progress = store.progress(now=now)
    assert progress.stragglers == [2]
    assert progress.step == 17 and progress.total_steps == 1000 and progress.eta_s is not None


def test_the_header_counts_the_steps_of_this_cell_not_of_the_run(tmp_path):
    from rtnb.widgets import format_header

    store, _ = _store(tmp_path)
    store.begin([0, 1], total_steps=500)
    for step in range(1, 501):
        store.add(0, [(step, float(step), {"loss": 1.0})])
        store.add(1, [(step, float(step), {"loss": 1.0})])
    store.begin([0, 1], total_steps=300)  # the next %%rtrain --steps 300 cell
    for step in range(501, 801):
        store.add(0, [(step, float(step), {"loss": 1.0})])
        store.add(1, [(step, float(step), {"loss": 1.0})])
    progress = store.progress(now=800.0)
    assert progress.step == 300 and progress.run_step == 800
    header = format_header(progress, "done", label="[5]")
    assert "step 800 · 300/300 done" in header and header.startswith("[5]"), header


def test_reports_with_tensors_and_non_finite_values_are_kept_readably(tmp_path):
    torch = pytest.importorskip("torch")
    store, run_dir = _store(tmp_path, "run-b")
    store.begin([0])
    store.add(0, [(1, 1.0, {"loss": torch.tensor(0.5), "bad": float("nan"), "obj": object()})])
    store.flush()
    [row] = read_metrics(run_dir)
    assert row["loss"] == 0.5 and row["bad"] == "nan" and row["obj"].startswith("<object")
    assert store.series("loss", 0)[2] == [0.5]


def test_live_widget_draws_one_trace_per_rank_plus_mean_and_stays_bounded(tmp_path):
    from rtnb.widgets import LiveMetrics

    store, _ = _store(tmp_path)
    store.begin([0, 1])
    view = LiveMetrics(store, max_points=200)
    try:
        for step in range(1, 5001):
            store.add(0, [(step, float(step), {"loss": 1.0 / step, "acc": 0.5})])
            store.add(1, [(step, float(step), {"loss": 2.0 / step, "acc": 0.7})])
        view.redraw()
        names = [(t.name, t.yaxis) for t in view.figure.data]
        assert sorted(names) == sorted(
            [
                ("rank 0", "y"),
                ("rank 1", "y"),
                ("mean", "y"),
                ("rank 0", "y2"),
                ("rank 1", "y2"),
                ("mean", "y2"),
            ]
        )
        for trace in view.figure.data:
            assert 2 <= len(trace.y) <= 201
        # subplots in the order the loop reports: loss (y) before acc (y2)
        loss_rank1 = next(t for t in view.figure.data if t.name == "rank 1" and t.yaxis == "y")
        assert loss_rank1.y[-1] == pytest.approx(2.0 / 5000) and loss_rank1.x[-1] == 5000
        view._log_y.value = True
        view._smoothing.value = 0.9
        view.redraw()
        assert view.figure.layout.yaxis.type == "log"
        assert "step 5000" in view._header.value
    finally:
        view.close()


def test_a_figure_the_page_says_missed_its_updates_is_drawn_anew_with_its_data(
    tmp_path, monkeypatch
):
    """anywidget gives up on a figure model whose module took over 2 s to load (a busy
    page); such a model hears nothing more. Each view of a figure asks the kernel,
    through the holder of plotly's code, to answer it; one that heard no answer says
    so (frontend messages on the holder's comm): the live view then draws a new
    figure, which opens with its traces in its opening state."""
    import comm
    from rtnb.widgets import LiveMetrics
    from rtnb.widgets._figure import _plotly_code

    store, _ = _store(tmp_path)
    store.begin([0, 1])
    opened: list[dict] = []
    create = comm.create_comm

    def seen(**kwargs):
        opened.append(kwargs.get("data", {}).get("state", {}))
        return create(**kwargs)

    monkeypatch.setattr(comm, "create_comm", seen)
    view = LiveMetrics(store, max_points=200)
    try:
        store.add(0, [(1, 1.0, {"loss": 1.0})])
        view.redraw()
        first = view.figure
        holder = _plotly_code()
        store.add(0, [(2, 2.0, {"loss": 0.5})])
        view.redraw()
        assert view.figure is first, "a redraw updates the figure it has"

        def from_the_page(content: dict) -> None:
            message = {"content": {"data": {"method": "custom", "content": content}}, "buffers": []}
            holder._handle_msg(message)

        answers: list[dict] = []
        first.send = answers.append  # what the kernel sends the figure's model
        from_the_page({"hello": first._figure_key})
        assert answers == [{"hello": first._figure_key}]
        from_the_page({"missed": "a key of no figure"})
        view.redraw()
        assert view.figure is first and not first.missed
        from_the_page({"missed": first._figure_key})
        assert first.missed
        view.redraw()
        assert view.figure is not first and not view.figure.missed
        state = next(s for s in reversed(opened) if s.get("_figure_key") == view.figure._figure_key)
        drawn = {(t["name"], tuple(t["y"])) for t in state["_widget_data"]}
        assert ("rank 0", (1.0, 0.5)) in drawn, state["_widget_data"]
    finally:
        view.close()


def test_the_figure_is_laid_out_as_plotlys_make_subplots_lays_it_out(tmp_path):
    """The live view builds its figure from plain data (make_subplots was most of a
    rebuild's cost): the subplots, their titles, the shared x axis and the marker
    lines must be those plotly's own helpers make, and a redraw after the build
    moves the points without building again."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    from rtnb.widgets import LiveMetrics

    store, _ = _store(tmp_path)
    store.begin([0, 1])
    for step in range(1, 50):
        for rank in (0, 1):
            store.add(rank, [(step, float(step), {"loss": 1.0 / step, "acc": 0.5, "lr": 0.1})])
    store.add_marker(20, "lr = 0.05")
    view = LiveMetrics(store)
    try:
        view.redraw()
        ours = view.figure.layout.to_plotly_json()
        reference = make_subplots(
            rows=3,
            cols=1,
            shared_xaxes=True,
            subplot_titles=["loss", "acc", "lr"],
            vertical_spacing=0.08,
        )
        for row in (1, 2, 3):
            reference.add_trace(go.Scatter(x=[1], y=[1]), row=row, col=1)
            reference.add_vline(
                x=20,
                line={"dash": "dot", "width": 1.5, "color": "rgba(128,128,128,0.9)"},
                annotation_text="lr = 0.05" if row == 1 else None,
                annotation_position="top right",
                row=row,
                col=1,
            )
        theirs = reference.layout.to_plotly_json()
        for axis in ("xaxis", "yaxis", "xaxis2", "yaxis2", "xaxis3", "yaxis3"):
            for key in ("anchor", "domain", "matches", "showticklabels"):
                assert ours[axis].get(key) == theirs[axis].get(key), (axis, key)
        assert ours["shapes"] == theirs["shapes"]
        texts = [a for a in theirs["annotations"] if a.get("text")]
        assert ours["annotations"] == texts, "the titles, then the marker's text, once"
        assert [t.yaxis for t in view.figure.data if t.name == "mean"] == ["y", "y2", "y3"]
        builds = view.builds
        for rank in (0, 1):
            store.add(rank, [(50, 50.0, {"loss": 0.25, "acc": 0.5, "lr": 0.1})])
        view.redraw()
        rank1 = next(t for t in view.figure.data if t.name == "rank 1" and t.yaxis == "y")
        assert (rank1.x[-1], rank1.y[-1]) == (50, 0.25) and view.builds == builds
    finally:
        view.close()


def test_static_figure_is_plain_plotly_json_with_few_points(tmp_path):
    from rtnb.widgets import static_figure_bundle

    store, _ = _store(tmp_path)
    store.begin([0, 1])
    for step in range(1, 20001):
        store.add(0, [(step, float(step), {"loss": 1.0})])
        store.add(1, [(step, float(step), {"loss": 2.0})])
    bundle = static_figure_bundle(store, max_points=300)
    figure = bundle["application/vnd.plotly.v1+json"]
    assert [t["name"] for t in figure["data"]] == ["rank 0", "rank 1", "mean"]
    assert all(len(t["y"]) <= 301 for t in figure["data"])
    assert len(json.dumps(bundle)) < 100_000


def test_mean_survives_ranks_that_deliver_whole_runs_in_one_batch(tmp_path):
    store, _ = _store(tmp_path, "run-skew")
    store.begin([0, 1])
    store.add(0, [(s, float(s), {"v": 1.0}) for s in range(1, 50_001)])
    store.add(1, [(s, float(s), {"v": 3.0}) for s in range(1, 50_001)])
    steps, _t, values = store.mean_series("v")
    assert steps[-1] == 50_000 and set(values) == {2.0}
    assert all(
        len(waiting[0]) == 0 for mean in store._means.values() for waiting in mean._waiting.values()
    ), "nothing left pending"


def test_reports_cross_as_columns_and_come_back_as_the_rows_that_were_reported(tmp_path):
    torch = pytest.importorskip("torch")
    from rtnb.core._reports import ReportColumns

    sent = [
        (0, 10.0, {"loss": 1.5, "epoch": 0}),
        (1, 11.0, {"loss": torch.tensor(0.75), "epoch": 0, "note": "warm-up done"}),
        (2, 12.0, {"loss": float("inf"), "lr": 0.1}),
        (3, 13.0, {"epoch": 1, 'val "acc" ✓': 0.5}),
    ]
    columns = ReportColumns()
    for step, when, metrics in sent:
        columns.add(step, when, metrics)
    batch = columns.take()
    assert columns.take() is None, "taking empties the rank's buffer"
    store, run_dir = _store(tmp_path, "run-cols")
    store.begin([0])
    store.add(0, batch)
    store.flush()
    rows = read_metrics(run_dir)
    assert [(r["step"], r["timestamp"]) for r in rows] == [(s, t) for s, t, _ in sent]
    assert [
        {k: v for k, v in r.items() if k not in ("rank", "step", "timestamp")} for r in rows
    ] == [
        {"loss": 1.5, "epoch": 0},
        {"loss": 0.75, "epoch": 0, "note": "warm-up done"},
        {"loss": "inf", "lr": 0.1},
        {"epoch": 1, 'val "acc" ✓': 0.5},  # a name JSON must escape
    ]
    assert type(rows[0]["epoch"]) is int, "ints stay ints in the record"
    assert store.series("loss", 0)[0] == [0, 1, 2], "a metric a report lacked is not plotted there"
    assert store.series("epoch", 0)[2] == [0.0, 0.0, 1.0]
    assert "note" not in store.metric_names()
    assert store.last[0].step == 3 and store.last[0].metrics == {"epoch": 1, 'val "acc" ✓': 0.5}
    assert store.count(0) == 4


def test_reports_whose_keys_change_order_come_back_lined_up_with_their_steps():
    from rtnb.core._reports import ReportColumns

    sent = [
        {"loss": 1.0, "lr": 0.1},
        {"lr": 0.2, "loss": 2.0},  # the same keys in another order
        {"acc": 0.5},
        {},
        {"loss": 3.0, "lr": 0.3},  # back to the first keys
        {"loss": 4.0, "lr": 0.4, "acc": 0.9},
        {"loss": 5.0},
    ]
    columns = ReportColumns()
    for step, metrics in enumerate(sent):
        columns.add(step, float(step), metrics)
        if step == 3:
            first = columns.take()  # a poll in between: the next batch starts clean
    batches = [first, columns.take()]
    got = [row for batch in batches for row in batch.rows()]
    assert got == [(step, float(step), metrics) for step, metrics in enumerate(sent)]
    assert list(batches[1].columns["loss"]) == [3.0, 4.0, 5.0]


def test_a_tensor_is_read_when_reported_not_when_the_batch_leaves(tmp_path):
    torch = pytest.importorskip("torch")
    from rtnb.core._reports import ReportColumns

    running = torch.zeros(())
    columns = ReportColumns()
    for step in range(3):
        running += 1  # changed in place after each report, as loops do
        columns.add(step, float(step), {"running": running})
    assert list(columns.take().columns["running"]) == [1.0, 2.0, 3.0]


def test_the_mean_covers_the_steps_every_rank_reported(tmp_path):
    store, _ = _store(tmp_path, "run-gaps")
    store.begin([0, 1, 2])
    store.add(0, [(s, float(s), {"v": 0.0}) for s in range(1, 11)])
    store.add(1, [(s, float(s), {"v": 3.0}) for s in range(1, 11) if s != 4])
    store.add(2, [(s, float(s), {"v": 6.0}) for s in range(1, 8)])
    steps, _t, values = store.mean_series("v")
    assert steps == [1, 2, 3, 5, 6, 7] and set(values) == {3.0}
    store.add(2, [(s, float(s), {"v": 6.0}) for s in range(8, 13)])
    assert store.mean_series("v")[0] == [1, 2, 3, 5, 6, 7, 8, 9, 10]


def test_records_written_one_report_per_line_are_still_read(tmp_path):
    run_dir = RunDirectory(str(tmp_path), "old")
    run_dir.ensure_writable()
    (tmp_path / "old" / "metrics").mkdir(parents=True, exist_ok=True)
    (tmp_path / "old" / "metrics" / "rank-0.jsonl").write_text(
        '{"loss": 0.5, "rank": 0, "step": 1, "timestamp": 1.0}\n'
        '{"rank": 0, "step": [2, 3], "timestamp": [2.0, 3.0], "metrics": {"loss": [0.25, null]}}\n'
    )
    assert read_metrics(run_dir) == [
        {"loss": 0.5, "rank": 0, "step": 1, "timestamp": 1.0},
        {"loss": 0.25, "rank": 0, "step": 2, "timestamp": 2.0},
        {"rank": 0, "step": 3, "timestamp": 3.0},
    ]


def test_many_ranks_are_drawn_as_mean_band_and_outliers_with_any_rank_selectable(tmp_path):
    from rtnb.widgets import LiveMetrics
    from rtnb.widgets._plot import RANK_COLORS

    store, _ = _store(tmp_path, "run-wide")
    ranks = list(range(12))
    store.begin(ranks)
    for rank in ranks:
        last = 36 if rank == 7 else 40  # rank 7 is behind
        value = 10.0 if rank == 5 else 1.0 + rank / 100  # rank 5 is far off
        store.add(rank, [(s, float(s), {"loss": value}) for s in range(1, last + 1)])
    steps, _t, low, high = store.band_series("loss")
    assert steps == list(range(1, 37)), "the band covers the steps every rank reported"
    assert set(low) == {1.0} and set(high) == {10.0}
    # 7 is behind; 5 is furthest from the mean (1.8, which 5 pulls up), then 0 (1.0)
    assert store.outlier_ranks("loss") == [0, 5, 7]
    view = LiveMetrics(store, max_points=200)
    try:
        view.redraw()
        names = [t.name for t in view.figure.data]
        assert names == ["min–max over ranks"] * 2 + ["rank 0", "rank 5", "rank 7", "mean"]
        assert view.figure.data[1].fill == "tonexty"
        assert list(view._ranks.options) == ranks and view._ranks.value == []
        assert view._ranks.colors[5] == RANK_COLORS[5], "each chip in its trace's colour"
        view._ranks.value = [2]  # the user adds a rank of their choice (a chip)
        view.redraw()
        shown = [t.name for t in view.figure.data][2:]
        assert shown == ["rank 0", "rank 2", "rank 5", "rank 7", "mean"]
    finally:
        view.close()


def test_after_the_cell_ends_redraws_and_controls_neither_hang_nor_go_dead(tmp_path):
    import threading

    from rtnb.widgets import LiveMetrics

    store, _ = _store(tmp_path, "run-end")
    store.begin([0, 1])
    view = LiveMetrics(store)
    try:
        store.add(0, [(1, 1.0, {"loss": 1.0})])
        view._finish()  # what the cell's done-callback calls
        store.add(1, [(1, 1.0, {"loss": 2.0})])  # a new rank: the ranks control changes
        finished = threading.Event()

        def redraw_then_tick():
            view.redraw()
            view._log_y.value = True
            finished.set()

        threading.Thread(target=redraw_then_tick, daemon=True).start()
        assert finished.wait(20), "a redraw after the end deadlocked on its own controls"
        assert view.figure.layout.yaxis.type == "log"
        assert list(view._ranks.options) == [0, 1]
    finally:
        view.close()


def _spiky_store(tmp_path):
    store, _ = _store(tmp_path, "spiky")
    store.begin([0, 1])
    for rank in (0, 1):
        store.add(
            rank,
            [(s, float(s), {"loss": 100.0 if s < 3 else 1.0 / s + rank}) for s in range(1, 301)],
        )
    return store


def test_y_ranges_leave_out_early_outliers_unless_asked(tmp_path):
    from rtnb.widgets import LiveMetrics
    from rtnb.widgets._plot import robust_range

    assert robust_range([[1.0] * 50]) is None, "nothing to leave out: autorange"
    assert robust_range([[None, 2.0, float("nan")]]) is None
    # A training curve's normal start is no outlier, however steep.
    assert robust_range([[1.0 / s for s in range(1, 200)]]) is None
    assert robust_range([[2.3 * 0.97**s for s in range(200)]]) is None
    noisy = [2.3 * 0.98**s + 0.05 * ((s * 7919) % 13 - 6) / 6 for s in range(300)]
    assert robust_range([noisy]) is None, "SGD noise is no outlier"
    spike = [1.0 / s for s in range(1, 200)]
    spike[120] = 50.0
    low, high = robust_range([spike])
    assert high < 2.0 and low < 0.01, "a spike mid-run is out, the steep start stays in"
    rising = [float(s) for s in range(100)]
    assert robust_range([rising]) is None, "no early outlier: everything stays in"
    spiky = [100.0, 90.0] + [1.0 / s for s in range(1, 50)]
    low, high = robust_range([spiky, [x + 1 for x in spiky]])
    assert 1.0 < high < 3.0 and low < min(spiky[5:]), "the spike is out, every later point in"
    # The live view hands its traces as float arrays (read without a Python loop):
    # the same range, NaN left out as None is.
    import numpy as np

    as_arrays = [np.asarray(spiky + [float("nan")]), np.asarray([x + 1 for x in spiky])]
    assert robust_range(as_arrays) == [low, high]
    view = LiveMetrics(_spiky_store(tmp_path))
    try:
        view._finish()
        layout = view.figure.layout
        assert layout.yaxis.range[1] < 100.0 and layout.yaxis.autorange is False
        view._outliers.value = False  # after the cell ended: the control still works
        assert layout.yaxis.autorange is True and layout.yaxis.range is None
        view._outliers.value = True
        view._log_y.value = True  # log y: plotly's own range over every point
        assert layout.yaxis.type == "log" and layout.yaxis.autorange is True
    finally:
        view.close()


def test_the_lasting_figure_has_its_own_controls_and_an_svg_of_the_same_curves(tmp_path):
    from rtnb.widgets import static_figure_bundle

    bundle = static_figure_bundle(_spiky_store(tmp_path), title="cell [4] done")
    figure = bundle["application/vnd.plotly.v1+json"]
    assert figure["layout"]["yaxis"]["range"][1] < 100.0
    buttons = {b["label"]: b for menu in figure["layout"]["updatemenus"] for b in menu["buttons"]}
    assert buttons["log y"]["args"][0]["yaxis.type"] == "log"
    assert buttons["fit all"]["args"][0]["yaxis.autorange"] is True
    raw = buttons["raw"]["args"][0]["y"]
    ema = buttons["EMA 0.9"]["args"][0]["y"]
    assert [len(y) for y in raw] == [len(t["y"]) for t in figure["data"]] == [len(y) for y in ema]
    assert raw[0] == figure["data"][0]["y"] and ema[0] != raw[0]
    svg = bundle["image/svg+xml"]
    assert svg.startswith("<svg") and svg.count("<polyline") == 3, "rank 0, rank 1, the mean"
    assert "cell [4] done" in svg and ">loss<" in svg
    assert len(json.dumps(bundle)) < 300_000


REPORTS_OF_A_LOOP = [
    {"loss": 1.0, "lr": 0.1},
    {"lr": 0.2, "loss": 2.0},
    {"loss": 3, "lr": None},
    {"loss": "warming up", "lr": 0.3},
    {"loss": "TENSOR", "lr": 0.4},
    {"acc": 0.5},
    {"acc": 0.6, "step": 40},
    {"acc": 0.7},
    {},
    {"loss": float("nan"), "lr": 0.5},
    {"loss": True, "lr": 0.6},
    {"loss": 1.5, "lr": 0.7},
]


def _a_rank(monkeypatch):
    """A rank's runtime in this process, what rtnb.report() records into until the
    test ends."""
    from rtnb.worker import _reporting, _runtime
    from rtnb.worker._runtime import RankContext, RankRuntime

    monkeypatch.setattr(_runtime, "_CURRENT", None)
    monkeypatch.setattr(_reporting, "_CURRENT", None)
    return RankRuntime(RankContext(world_rank=0, world_size=1), capture_output=False)


def _report_through_the_api(monkeypatch, report) -> tuple[list, int]:
    import torch

    runtime = _a_rank(monkeypatch)
    for metrics in REPORTS_OF_A_LOOP:
        if metrics.get("loss") == "TENSOR":
            metrics = {**metrics, "loss": torch.tensor(4.0)}
        report(metrics)
    rows = [
        (step, metrics) for step, _when, metrics in runtime.reports.take_locked()[0].take().rows()
    ]
    return rows, runtime.step


def test_reports_recorded_in_c_are_exactly_those_of_the_python_path(monkeypatch):
    native = require(
        "rtnb.worker._fastreport", "report()'s hot path in C; pip install -e . builds it"
    )
    from rtnb.worker import _api, _reporting

    # Built, rtnb.report is the C builtin; report_in_python is what it falls back to.
    assert _api.report is not _api.report_in_python
    answers = []

    def add_then_python(metrics):
        reports = _reporting.current_reports()
        answers.append(native.add(reports, metrics))
        if answers[-1] == 2:
            reports.after_plain_report()
        elif not answers[-1]:
            _api.report_in_python(metrics)

    in_c = _report_through_the_api(monkeypatch, _api.report)
    assert in_c == _report_through_the_api(monkeypatch, _api.report_in_python)
    assert in_c == _report_through_the_api(monkeypatch, add_then_python)
    rows, last_step = in_c
    assert [step for step, _ in rows] == [0, 1, 2, 3, 4, 5, 40, 41, 42, 43, 44, 45]
    assert rows[1][1] == {"loss": 2.0, "lr": 0.2} and rows[4][1]["loss"] == 4.0
    assert last_step == 45
    # Reports with the keys of the one before went through C; new keys, a tensor, a
    # "step" metric, an empty report and a bool took the Python path.
    assert answers == [0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1]


def test_a_fast_loops_reports_set_off_no_garbage_collection(monkeypatch):
    """At 40 kHz an object the collector tracks per report (a tuple of values, as
    before) set off a young collection every few hundred steps and now and then a
    full one of the whole torch process (~140 ms here): reports in C allocate none."""
    import gc

    native = require(
        "rtnb.worker._fastreport", "report()'s hot path in C; pip install -e . builds it"
    )
    from rtnb.worker import _api

    assert _api.report is not _api.report_in_python, native
    runtime = _a_rank(monkeypatch)
    metrics = {"loss": 0.5, "lr": 0.1, "tokens": 0}
    _api.report(metrics)  # the first report of a run of keys takes the Python path
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        for i in range(50_000):
            metrics["loss"] = i * 0.5
            metrics["tokens"] = i
            _api.report(metrics)
            if i == 25_000:
                first = runtime.reports.take_locked()[0].take()
    finally:
        gc.callbacks.remove(count)
    assert collections == []
    rest = runtime.reports.take_locked()[0].take()
    assert len(first) + len(rest) == 50_001
    assert list(rest.columns["tokens"])[-1] == 49_999 and rest.numbers("loss")[2][-1] == 24_999.5


def test_reports_from_two_threads_while_polled_stay_whole_and_in_order(monkeypatch):
    """Two threads report at once (C and Python paths mixed: one changes keys every
    report) while a third takes batches: every report arrives once, whole."""
    import threading

    from rtnb.worker import _api

    runtime = _a_rank(monkeypatch)
    n = 20_000
    done = threading.Event()
    taken = []

    def poll():
        while not done.is_set():
            batch, _offers = runtime.reports.take_locked()  # what a poll takes
            taken.append(batch.take())

    def steady():
        for i in range(n):
            _api.report({"a": float(i), "b": 1.0})

    def changing():
        for i in range(n):
            _api.report({"c": float(i)} if i % 2 else {"c": float(i), "d": 0.0})

    threads = [threading.Thread(target=f) for f in (steady, changing)]
    poller = threading.Thread(target=poll)
    poller.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    poller.join()
    taken.append(runtime.reports.take_locked()[0].take())
    rows = [metrics for batch in taken if batch for _s, _t, metrics in batch.rows()]
    assert len(rows) == 2 * n
    steady_rows = [m for m in rows if "a" in m]
    changing_rows = [m for m in rows if "c" in m]
    assert [m["a"] for m in steady_rows] == [float(i) for i in range(n)]
    assert all(m == {"a": m["a"], "b": 1.0} for m in steady_rows), "no report mixed with another"
    assert [m["c"] for m in changing_rows] == [float(i) for i in range(n)]
    assert all(("d" in m) == (m["c"] % 2 == 0) for m in changing_rows)


def test_report_keeps_its_signature_help_and_errors_when_built_in_c(monkeypatch):
    import inspect

    import rtnb
    from rtnb.errors import SessionError
    from rtnb.worker import _reporting, _runtime

    # Outside a rank (other tests here leave a runtime of theirs behind).
    monkeypatch.setattr(_runtime, "_CURRENT", None)
    monkeypatch.setattr(_reporting, "_CURRENT", None)

    assert list(inspect.signature(rtnb.report).parameters) == [
        "metrics",
        "checkpoint",
        "checkpoint_dir_name",
        "checkpoint_upload_mode",
        "delete_local_checkpoint_after_upload",
        "checkpoint_upload_fn",
        "validation",
        "step",
    ]
    assert "cheap enough to call every step" in inspect.getdoc(rtnb.report)
    with pytest.raises(SessionError, match="inside a %%rtrain cell"):
        rtnb.report({"loss": 1.0})
    with pytest.raises(SessionError, match="inside a %%rtrain cell"):
        rtnb.report({"loss": 1.0}, step=3)


def test_lasting_figures_drawn_before_the_page_said_its_theme_take_a_dark_pages_colours(
    tmp_path, monkeypatch
):
    """Run All in a dark notebook: the next cells ran before the page's answer reached
    the kernel, so their lasting figures took the light theme's grey (2.8:1 on dark);
    they are drawn again once the page answers, and only then."""
    from rtnb.widgets import _theme, static_figure_bundle

    monkeypatch.setattr(_theme, "_light", True)
    monkeypatch.setattr(_theme, "_answered", False)
    monkeypatch.setattr(_theme, "_unthemed", [])
    store = _spiky_store(tmp_path)
    drawn: list[str] = []

    def redraw() -> None:
        figure = static_figure_bundle(store)["application/vnd.plotly.v1+json"]
        drawn.append(figure["layout"]["font"]["color"])

    redraw()
    _theme.redraw_when_theme_known(redraw)
    probe = _theme.theme_probe()
    assert probe is not None, "anywidget is installed with rtnb"
    assert drawn == [_theme.TEXT_ON_LIGHT]
    probe.set_state({"light": False, "seen": True})  # what the page sends
    assert drawn == [_theme.TEXT_ON_LIGHT, _theme.TEXT_ON_DARK]
    _theme.redraw_when_theme_known(redraw)  # drawn once the theme is known: kept as is
    probe.set_state({"light": True})
    assert len(drawn) == 2


def _descents() -> list[list[float]]:
    """Losses of real training runs whose descent is steep and bumpy: a small
    regression trained with SGD, Adam and momentum over minibatches (the shape of a
    loss that falls from ~5 to ~1e-5 in 60 steps)."""
    torch = pytest.importorskip("torch")
    curves = []
    for seed in range(12):
        for make in (
            lambda p: torch.optim.SGD(p, lr=0.3),
            lambda p: torch.optim.Adam(p, lr=0.1),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        ):
            torch.manual_seed(seed)
            x = torch.randn(64, 8)
            y = x @ (torch.randn(8, 1) * 1.6)
            model = torch.nn.Linear(8, 1)
            opt = make(model.parameters())
            losses = []
            for _ in range(100):
                i = torch.randint(0, 64, (16,))
                loss = torch.nn.functional.mse_loss(model(x[i]), y[i])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            curves.append(losses)
    return curves


def test_a_curves_whole_story_stays_in_view_and_only_a_spike_is_left_out(tmp_path):
    """The default y range over a corpus of curves: a falling loss keeps its first
    steps (steep, bumpy, exponential), a plateau its noise, an accuracy its rise; a
    NaN is never drawn; only a spike that would flatten the rest is left out."""
    import math

    from rtnb.widgets import static_figure_bundle
    from rtnb.widgets._plot import robust_range

    def shows(curve, span) -> bool:
        finite = [v for v in curve if v is not None and math.isfinite(v)]
        return span is None or (span[0] <= min(finite) and span[1] >= max(finite))

    exponential = [5.3 * (2e-5 / 5.3) ** (s / 60) for s in range(120)]
    plateau = [0.7 + 0.01 * ((s * 7919) % 13 - 6) / 6 for s in range(300)]
    rising = [1 - 0.9 * 0.95**s + 0.005 * ((s * 31) % 7 - 3) for s in range(200)]
    for name, curve in [("exponential", exponential), ("plateau", plateau), ("accuracy", rising)]:
        assert shows(curve, robust_range([curve])), name
    descents = _descents()
    for i, curve in enumerate(descents):
        assert shows(curve, robust_range([curve])), f"descent {i} lost its first steps"
    assert shows(descents[0], robust_range(descents[:2])), "two ranks' descents alike"

    with_nan = list(exponential)
    with_nan[30] = float("nan")
    with_nan[31] = float("inf")
    assert shows(with_nan, robust_range([with_nan]))

    spike = list(plateau)
    spike[150] = 40.0  # one bad batch mid-run
    low, high = robust_range([spike])
    assert high < 1.0 and low < min(plateau), "the spike is out, every other point in"
    twin = list(plateau)
    twin[150:152] = [40.0, 38.0]
    assert robust_range([twin])[1] < 1.0, "a spike two points wide is one too"
    excursion = list(plateau)
    excursion[150:160] = [40.0] * 10  # ten steps up there: part of the story
    assert robust_range([excursion]) is None
    small = list(plateau)
    small[150] = 0.725  # a bump that does not flatten anything
    assert robust_range([small]) is None
    first = [1000.0] + [1.0 / s for s in range(1, 100)]
    assert robust_range([first])[1] < 2.0, "a first loss of 1000 before 1.0, 0.5, ..."

    # The lasting figure (plotly and its SVG) of a run whose loss is such a descent.
    store, _ = _store(tmp_path, "descent")
    store.begin([0, 1])
    for rank in (0, 1):
        store.add(rank, [(s, float(s), {"loss": v}) for s, v in enumerate(descents[rank])])
    bundle = static_figure_bundle(store, title="descent")
    axis = bundle["application/vnd.plotly.v1+json"]["layout"]["yaxis"]
    assert "range" not in axis or axis["range"][1] >= max(descents[0][:2] + descents[1][:2])
    tops = [float(v) for v in re.findall(r">(-?[0-9.]+)</text>", bundle["image/svg+xml"])]
    assert tops and max(tops) >= 0.5 * max(descents[0][0], descents[1][0]), (
        "the SVG's y axis reaches the first losses"
    )
