"""--mlflow: a run mirrored into a real MLflow store, read back with MLflow's client."""

from __future__ import annotations

import time

import pytest

import rtnb
from rtnb.metrics._compare import format_rows, runs_rows
from tests.conftest import CLUSTER_CPUS, wait_for_free_cpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TRAIN = (
    "import rtnb, torch.distributed as dist\n"
    "rank = dist.get_rank()\n"
    "for step in range(FIRST, FIRST + 6):\n"
    "    ckpt = rtnb.Checkpoint.from_state({'step': step}) if step % 3 == 2 else None\n"
    "    rtnb.report({'loss': 10.0 * rank + step, 'acc': 0.5}, checkpoint=ckpt, step=step)\n"
)


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_a_run_is_mirrored_into_mlflow_and_a_replay_carries_it_on(lend, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    # The notebook the kernel runs, as `rtnb run` (and Jupyter Server) name it.
    notebook = tmp_path / "train.ipynb"
    notebook.write_text('{"cells": []}')
    monkeypatch.setenv("RTNB_NOTEBOOK", str(notebook))

    options = dict(workers=2, cpus_per_worker=0.5, storage=str(tmp_path), name="tracked", mlflow="")
    options["group_factory"] = lend
    with rtnb.Session(**options) as session:
        session.run("FIRST = 0\n" + TRAIN)
        run_id = session.mlflow_run_id
        checkpoints = [c.id for c in session.list_checkpoints()]
    assert run_id and session.tracking_error is None
    client = MlflowClient(f"sqlite:///{tmp_path}/tracked/mlflow.db")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params["workers"] == "2" and run.data.params["cpus_per_worker"] == "0.5"
    assert _history(client, run_id, "loss/rank0") == [(s, float(s)) for s in range(6)]
    assert _history(client, run_id, "loss/rank1") == [(s, 10.0 + s) for s in range(6)]
    assert _history(client, run_id, "loss") == [(s, 5.0 + s) for s in range(6)], "the mean"
    logged = {f.path for f in client.list_artifacts(run_id, "checkpoints")}
    assert logged == {f"checkpoints/{c}" for c in checkpoints} and len(checkpoints) == 2
    files = client.list_artifacts(run_id, f"checkpoints/{checkpoints[-1]}")
    assert files, "the checkpoint's files are in MLflow"
    assert [f.path for f in client.list_artifacts(run_id, "notebook")] == ["notebook/train.ipynb"]

    # The same run carried on in a new session (--replay): the same MLflow run.
    with rtnb.Session(replay=True, **options) as again:
        assert again.mlflow_run_id == run_id
        again.run("FIRST = 6\n" + TRAIN)
    assert _history(client, run_id, "loss/rank0") == [(s, float(s)) for s in range(12)]
    assert len(client.search_runs([run.info.experiment_id])) == 1

    # `%rtnb runs` names each run's MLflow run.
    table = rtnb.list_runs(str(tmp_path))
    [summary] = table.runs
    assert summary.mlflow_link == run_id
    head, lines = format_rows(runs_rows(table.runs, {}, None), None)
    assert "mlflow run" in head and run_id in lines[0]


def test_an_unreachable_tracking_server_is_one_line_and_holds_nothing(ray_cluster, tmp_path):
    started = time.monotonic()
    with pytest.raises(rtnb.ConfigError) as info:
        rtnb.Session(
            workers=2,
            cpus_per_worker=0.5,
            storage=str(tmp_path),
            mlflow="http://tracker:hunter2@127.0.0.1:9/",
        ).start()
    message = str(info.value)
    assert "MLflow at http://***@127.0.0.1:9/ cannot be used (nothing answers there)" in message
    assert "\n" not in message and "hunter2" not in message
    assert time.monotonic() - started < 30
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS, "no rank holds a CPU"
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert b"hunter2" not in path.read_bytes(), f"the password was written to {path}"


def test_a_slow_tracking_server_holds_up_no_report_and_the_runs_end_sends_everything(tmp_path):
    """The mirror sends from a thread of its own: while MLflow's store is still busy
    with one batch, every report and the cell end's flush return at once (on the
    thread that drives a cell they would hold up stops and commits); the run's end
    waits for the rest, and every value and the mean are in MLflow."""
    import threading

    from mlflow.tracking import MlflowClient

    from rtnb.metrics._mlflow import MlflowMirror, default_tracking_uri

    uri = default_tracking_uri(str(tmp_path / "mlflow.db"))
    mirror = MlflowMirror(uri, "slow", {"workers": 2}, lambda: 2)
    inside, release = threading.Event(), threading.Event()
    send = mirror.client.log_batch

    def held(*args, **kwargs):  # the real client, made to take as long as the test says
        inside.set()
        assert release.wait(60), "the test never let the store go"
        return send(*args, **kwargs)

    mirror.client.log_batch = held
    mirror.add(0, [(0, time.time(), {"loss": 1.0})])
    mirror.flush()
    assert inside.wait(30), "the sender took the first batch"

    def cell() -> None:  # what the cell's thread does while the store is busy
        for step in range(1, 50):
            mirror.add(0, [(step, time.time(), {"loss": 1.0 + step})])
            mirror.add(1, [(step, time.time(), {"loss": 3.0 + step})])
        mirror.flush()

    driver = threading.Thread(target=cell)
    driver.start()
    driver.join(30)
    stuck = driver.is_alive()
    release.set()
    mirror.finish()
    assert not stuck, "a report or the cell's flush waited for the tracking server"
    assert mirror.error is None
    client = MlflowClient(uri)
    assert [m.step for m in client.get_metric_history(mirror.run_id, "loss/rank0")] == list(
        range(50)
    )
    means = client.get_metric_history(mirror.run_id, "loss")
    assert sorted((m.step, m.value) for m in means) == [(s, 2.0 + s) for s in range(1, 50)]
    assert client.get_run(mirror.run_id).info.status == "FINISHED"


def test_the_mean_across_ranks_keeps_its_steps_in_order_when_ranks_batches_arrive_out_of_step(
    tmp_path,
):
    # Rank 1 ran ahead (its reports stamped earlier) and its last step arrived after
    # rank 0's whole batch: MLflow lists a history by time, so the mean of a step is
    # stamped with the step's latest report, not with the one that arrived last.
    from mlflow.tracking import MlflowClient

    from rtnb.metrics._mlflow import MlflowMirror, default_tracking_uri

    uri = default_tracking_uri(str(tmp_path / "mlflow.db"))
    mirror = MlflowMirror(uri, "out-of-step", {"workers": 2}, lambda: 2)
    early, late = 1_000.0, 2_000.0
    mirror.add(1, [(s, early + s, {"loss": 10.0 + s}) for s in range(5)])
    mirror.add(0, [(s, late + s, {"loss": float(s)}) for s in range(6)])
    mirror.add(1, [(5, early + 5, {"loss": 15.0})])
    mirror.finish()
    history = MlflowClient(uri).get_metric_history(mirror.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s, 5.0 + s) for s in range(6)]
