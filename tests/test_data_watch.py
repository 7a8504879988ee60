"""What a cell says about the Ray Data pipelines feeding it (no Ray: the stats
actor's records are given as Ray Data 2.60 writes them), and the room check."""

from __future__ import annotations

import time

import pytest

from rtnb.driver.ranks._datasets import DataWatch, wait_for_data_room
from rtnb.errors import ClusterError


def _record(state: str, done: int, started: float, ended: float | None = None) -> dict:
    return {
        "state": state,
        "total_rows": 200,
        "start_time": started,
        "end_time": ended,
        "operators": {
            "Input_0": {"name": "Input", "progress": 7, "total": 7, "state": "FINISHED"},
            "ReadRange->Map(<lambda>)_1": {
                "name": "ReadRange->Map(<lambda>)",
                "progress": done,
                "total": 10,
                "state": "FINISHED" if state == "FINISHED" else "RUNNING",
            },
        },
    }


def test_a_pipeline_is_shown_starting_waiting_and_read_and_an_earlier_one_not_at_all():
    now = time.time()
    records: list[dict] = []
    free = {"CPU": 0.0}
    notes: list[str] = []
    watch = DataWatch(["train"], lambda: (records, free), notes.append, since=now - 10)
    records[:] = [
        {**_record("FINISHED", 10, now - 100, now - 90), "_tag": "train_abc_0"},  # last cell's
        {**_record("RUNNING", 0, now - 5), "_tag": "train_abc_1"},
        {**_record("RUNNING", 0, now - 5), "_tag": "other_def_0"},  # not handed to the ranks
    ]
    assert watch.check() == 1
    assert (
        notes[0] == "[rtnb] Ray Data 'train': ReadRange->Map(<lambda>) 0/10 blocks (≈0/200 rows)\n"
    )
    assert "waits: its tasks find no free CPU" in notes[1]
    assert len(notes) == 2
    watch.check()
    assert len(notes) == 2, "a running pipeline is shown again only every 10 s"
    records[1] = {**_record("FINISHED", 10, now - 5, now - 1), "_tag": "train_abc_1"}
    watch.end(settle_s=0)
    assert notes[-1] == "[rtnb] Ray Data 'train': 200 rows read in 4.0 s\n"
    watch.end(settle_s=0)
    assert len(notes) == 3, "said once"


@pytest.mark.ray
def test_data_room_is_waited_for_then_refused_in_one_line(ray_cluster):
    import ray

    ds = ray.data.from_items([{"a": 1}])  # in the object store: needs no task CPU
    full = lambda: ({"CPU": 4.0}, {})  # noqa: E731
    wait_for_data_room({"train": ds}, ranks_hold=4, resources=full, timeout_s=0.1)
    pipeline = ds.map(lambda row: row)
    started = time.monotonic()
    with pytest.raises(ClusterError) as info:
        wait_for_data_room({"train": pipeline}, ranks_hold=3, resources=full, timeout_s=0.3)
    assert time.monotonic() - started >= 0.3
    assert str(info.value).startswith(
        "the Ray Data pipeline of 'train' needs 1 free CPU for its tasks, but the ranks hold "
        "3 of the cluster's 4 CPUs, other work holds 1, and none came free within 0.3 s"
    )
    freed = iter([({"CPU": 4.0}, {}), ({"CPU": 4.0}, {"CPU": 1.0})])
    wait_for_data_room({"train": pipeline}, 3, lambda: next(freed), timeout_s=5)
