"""The worker group on a real local Ray cluster with real torch.distributed (gloo)."""

from __future__ import annotations

import time

import pytest

import rtnb

pytestmark = pytest.mark.ray


def test_torch_distributed_is_ready_in_the_first_cell(group):
    value = group.run(
        "import torch, torch.distributed as dist\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "(dist.get_rank(), dist.get_world_size(), dist.get_backend(), t.item())"
    )
    assert value == {0: (0, 2, "gloo", 3.0), 1: (1, 2, "gloo", 3.0)}


def test_variables_persist_across_cells(group):
    group.run("import torch.distributed as dist\nkept = dist.get_rank() * 10")
    group.run("kept += 1")
    assert group.pull("kept") == [1, 11]


def test_context_matches_ray_train_names(group):
    value = group.run(
        "import rtnb\nc = rtnb.get_context()\n"
        "(c.world_rank, c.get_world_rank(), c.world_size, c.local_rank, c.node_rank, str(rtnb.get_device()), c.run_name)"
    )
    assert value[0] == (0, 0, 2, 0, 0, "cpu", group.run_name)
    assert value[1] == (1, 1, 2, 1, 0, "cpu", group.run_name)


def test_prints_stream_while_the_cell_is_still_running(group):
    seen: list[tuple[float, int, str]] = []
    start = time.monotonic()
    group.run(
        "import time\nprint('first', flush=True)\ntime.sleep(1.5)\nprint('second')",
        output=lambda rank, stream, text: seen.append((time.monotonic() - start, rank, text)),
    )
    end = time.monotonic() - start
    firsts = [t for t, _r, text in seen if "first" in text]
    assert {r for _t, r, text in seen if "first" in text} == {0, 1}
    assert max(firsts) < end - 1.0, f"'first' arrived at {firsts}, cell ended at {end:.2f}s"


def test_ranks_option_limits_the_cell(group):
    assert group.run("import torch.distributed as dist\ndist.get_rank()", ranks="1") == {1: 1}
    with pytest.raises(rtnb.ConfigError, match="rank 7"):
        group.run("1", ranks="7")


def test_remote_error_names_the_rank_and_the_group_stays_usable(group):
    group.run("import torch.distributed as dist\nbefore_error = 'kept'")
    with pytest.raises(rtnb.CellError) as info:
        group.run(
            "def check(r):\n    if r == 1:\n        raise ValueError('bad value on one rank')\ncheck(dist.get_rank())"
        )
    err = info.value
    assert err.ranks == [1] and err.exc_type == "ValueError"
    tb = err.failures[1]
    assert "raise ValueError('bad value on one rank')" in tb and "check(dist.get_rank())" in tb
    assert "rtnb/" not in tb and "ray/" not in tb, "the traceback must show user code only"
    assert group.pull("before_error") == ["kept", "kept"]
    assert group.run("import torch\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == {
        0: 2.0,
        1: 2.0,
    }


def test_syntax_error_is_caught_before_dispatch(group):
    group.run("marker = 'untouched'")
    with pytest.raises(rtnb.CellError, match="not sent to the ranks") as info:
        group.run("marker = 'changed'\nx = (")
    assert "SyntaxError" in str(info.value)
    assert group.pull("marker") == ["untouched", "untouched"]


def test_background_cell_allows_status_and_pull_while_it_runs(group):
    handle = group.run_background(
        "import time, rtnb\nfor i in range(30):\n    rtnb.report({'i': i})\n    time.sleep(0.05)\n'finished'"
    )
    assert not handle.done()
    time.sleep(0.5)
    status = group.status()
    assert status.state == "running" and "background" in status.cell
    progress = group.pull("i")
    assert all(isinstance(v, int) and 0 <= v < 30 for v in progress)
    with pytest.raises(rtnb.SessionError, match="still running"):
        group.run("1")
    assert group.wait(30) == {0: "finished", 1: "finished"}
    assert group.status().state == "ready"
    assert group.metrics.last[1].step == 29, "30 reports: steps 0..29"


def test_reports_are_recorded_per_rank(group):
    before = group.metrics.count()
    group.run(
        "import rtnb, torch.distributed as dist\nfor s in range(5):\n    rtnb.report({'per_rank_loss': 1.0 / (s + 1) + dist.get_rank()})"
    )
    assert group.metrics.count() - before == 10
    frame = group.result().metrics_dataframe
    mine = frame.dropna(subset=["per_rank_loss"])
    for rank in (0, 1):
        rows = mine[mine["rank"] == rank]
        assert rows["per_rank_loss"].tolist() == [
            1.0 + rank,
            0.5 + rank,
            1 / 3 + rank,
            0.25 + rank,
            0.2 + rank,
        ]
        assert rows["step"].diff().dropna().tolist() == [1, 1, 1, 1]


def test_push_sends_notebook_values_to_every_rank(group):
    group.push({"lr": 0.25, "layers": [3, 4]})
    assert group.run("lr * 4, layers") == {0: (1.0, [3, 4]), 1: (1.0, [3, 4])}
    with pytest.raises(rtnb.ConfigError):
        group.push({"not a name": 1})
    with pytest.raises(rtnb.SessionError, match="not defined"):
        group.pull("never_defined_anywhere")


def test_run_accepts_a_function_like_train_loop_per_worker(group):
    def train_loop(config):
        import rtnb

        return config["x"] * (rtnb.get_context().world_rank + 1)

    assert group.run(train_loop, config={"x": 5}) == {0: 5, 1: 10}


def test_prepare_model_and_data_loader_train_ddp_in_sync(group):
    value = group.run(
        "import torch, rtnb\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "torch.manual_seed(0)\n"
        "data = TensorDataset(torch.arange(64, dtype=torch.float32).unsqueeze(1), torch.randn(64, 1))\n"
        "loader = rtnb.prepare_data_loader(DataLoader(data, batch_size=8, shuffle=True))\n"
        "torch.manual_seed(1 + rtnb.get_context().world_rank)  # different init per rank; DDP syncs it\n"
        "model = rtnb.prepare_model(torch.nn.Linear(1, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=1e-4)\n"
        "seen = []\n"
        "for x, y in loader:\n"
        "    seen += x.squeeze(1).tolist()\n"
        "    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()\n"
        "(type(model).__name__, len(loader), sorted(seen), [p.detach().clone() for p in model.parameters()])"
    )
    (name0, len0, seen0, params0), (name1, len1, seen1, params1) = value[0], value[1]
    assert name0 == name1 == "DistributedDataParallel"
    assert len0 == len1 == 4
    assert not set(seen0) & set(seen1) and len(seen0) + len(seen1) == 64
    for a, b in zip(params0, params1):
        assert a.equal(b), "DDP must keep the ranks' weights identical"


@pytest.mark.slow
def test_ray_train_loop_code_runs_unchanged(group):
    value = group.run(
        "import ray.train, ray.train.torch, torch\n"
        "from ray.train import report\n"
        "model = ray.train.torch.prepare_model(torch.nn.Linear(2, 1))\n"
        "ctx = ray.train.get_context()\n"
        "report({'from_ray_train': ctx.get_world_rank()})\n"
        "(type(model).__name__, ctx.get_world_size(), ray.train.get_checkpoint())"
    )
    assert value == {
        0: ("DistributedDataParallel", 2, None),
        1: ("DistributedDataParallel", 2, None),
    }
    frame = group.result().metrics_dataframe
    assert sorted(frame.dropna(subset=["from_ray_train"])["rank"].tolist()) == [0, 1]


@pytest.mark.slow
def test_ray_train_submodules_as_attributes_the_form_of_rays_examples(group):
    """``from ray import train`` then ``train.torch.prepare_model(...)`` (Ray's examples)
    and ``import ray.train as train`` then ``train.huggingface.transformers``: on a Ray
    Train worker TorchTrainer imported them already; on a rank they import on first use."""
    value = group.run(
        "import sys, torch\n"
        "from ray import train\n"
        "model = train.torch.prepare_model(torch.nn.Linear(2, 1))\n"
        "import ray.train as rt\n"
        "callback = rt.huggingface.transformers.RayTrainReportCallback\n"
        "try:\n    rt.no_such_name\nexcept AttributeError as exc:\n    missing = str(exc)\n"
        "(type(model).__name__, callback.__module__, missing)"
    )
    assert (
        value[0]
        == value[1]
        == (
            "DistributedDataParallel",
            "rtnb.worker._hf",
            "module 'ray.train' has no attribute 'no_such_name'",
        )
    )


def test_a_rank_process_holds_no_driver_code(group):
    value = group.run(
        "import sys, rtnb\nrtnb.report; rtnb.get_checkpoint\n"
        "sorted(m for m in sys.modules if m.startswith(('rtnb.driver', 'rtnb.batch', 'rtnb.magics', 'rtnb.widgets')))"
    )
    assert value == {0: [], 1: []}


def test_the_driver_takes_a_finished_poll_without_waiting_for_the_others(ray_cluster, tmp_path):
    """Two ranks whose batches fell out of step each waited for the other's poll up
    to a tick (live reports every ~300 ms instead of 100 ms): a finished poll is
    taken as soon as it is ready, the others stay in flight."""
    import ray

    from rtnb.core._config import SessionConfig
    from rtnb.driver.ranks._group import WorkerGroup

    release = tmp_path / "release"

    @ray.remote(num_cpus=0)
    def held(path: str) -> str:
        import os
        import time as _time

        while not os.path.exists(path):
            _time.sleep(0.05)
        return "held"

    @ray.remote(num_cpus=0)
    def finished() -> str:
        return "finished"

    slow, fast = held.remote(str(release)), finished.remote()
    ray.get(fast)
    # A tick far longer than the test may take: only a wait for all would use it.
    group = WorkerGroup(SessionConfig(), "unstarted", str(tmp_path))
    try:
        started = time.monotonic()
        ready, values = group.take_ready([slow, fast], 120.0)
        waited = time.monotonic() - started
    finally:
        release.touch()
    assert (ready, values) == ([fast], ["finished"])
    assert waited < 60, "it waited for the poll still in flight"
    assert ray.get(slow, timeout=60) == "held"
