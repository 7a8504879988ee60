"""Many reports and many ranks: nothing dropped, a 32-rank group end to end."""

from __future__ import annotations

import os

import pytest
import torch

import rtnb
from rtnb.storage._result import Result
from tests.conftest import CLUSTER_CPUS, wait_for_free_cpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _quiet(*_args) -> None:
    pass


def test_every_report_arrives_when_ranks_report_as_fast_as_they_can(ray_cluster, tmp_path):
    reports = 300_000
    with rtnb.Session(workers=2, storage=str(tmp_path), name="flood") as session:
        first = session.run("import rtnb\nrtnb.report({'loss': 1.0})\n1", output=_quiet)
        assert first == {0: 1, 1: 1}
        sent = session.run(
            "import rtnb\n"
            f"for i in range({reports}):\n"
            "    rtnb.report({'loss': 1.0 / (i + 1), 'lr': 0.1, 'epoch': i // 1000})\n"
            f"{reports}",
            output=_quiet,
        )
        assert sent == {0: reports, 1: reports}
        assert session.metrics.count(0) == session.metrics.count(1) == reports + 1
        session.metrics.flush()
        frame = Result.from_path(str(tmp_path / "flood")).metrics_dataframe
    for rank in (0, 1):
        rows = frame[frame["rank"] == rank]
        assert rows["step"].tolist() == list(range(reports + 1)), "every step, in order"
        assert rows["loss"].iloc[-1] == pytest.approx(1.0 / reports)
        assert rows["epoch"].iloc[-1] == (reports - 1) // 1000


def test_a_32_rank_group_runs_end_to_end(ray_cluster, tmp_path):
    from rtnb.widgets import CheckpointBrowser, LiveMetrics

    world = 32
    with rtnb.Session(
        workers=world, cpus_per_worker=0.06, storage=str(tmp_path), name="wide", keep=2
    ) as session:
        lines: list[tuple[int, str]] = []
        total = session.run(
            "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
            "print('hello from', dist.get_rank())\nint(t.item())",
            output=lambda rank, stream, text: lines.append((rank, text)),
        )
        assert total == {rank: world for rank in range(world)}
        assert sorted(r for r, text in lines if "hello from" in text) == list(range(world))
        handle = session.run_background(
            "import torch, rtnb, torch.distributed as dist\n"
            "for i in range(6):\n"
            "    shard = {'w': torch.full((256,), float(dist.get_rank()))}\n"
            "    rtnb.report({'loss': 1.0 / (i + 1) + dist.get_rank() / 1000},\n"
            "                checkpoint=rtnb.Checkpoint.from_state(shard))\n"
            "i",
            output=_quiet,
        )
        view = LiveMetrics(session.metrics, handle)
        try:
            assert handle.wait(180) == {rank: 5 for rank in range(world)}
            view.redraw()
            names = [trace.name for trace in view.figure.data]
            assert names[:2] == ["min–max over ranks"] * 2 and names[-1] == "mean"
            assert len(names) <= 2 + 3 + 1, "a few outlier ranks, not 32 lines"
            # After the cell: the controls still work (the redraw thread has ended).
            view._log_y.value = True
            assert view.figure.layout.yaxis.type == "log"
        finally:
            view.close()
        latest = session.checkpoints.latest()
        assert latest is not None and latest.ranks == list(range(world))
        assert len(session.checkpoints.list()) == 2, "--keep 2 holds at 32 ranks too"
        checkpoint = session.checkpoints.get(latest.id)
        checkpoint.verify(full=True)
        with checkpoint.as_directory() as folder:
            shard = torch.load(os.path.join(folder, "state-rank31.pt"), weights_only=True)
        assert shard["w"][0].item() == 31.0
        status = session.status()
        assert len(status.ranks) == world and "31" in status._repr_html_()
        browser = CheckpointBrowser(session.checkpoints.list)
        assert any(row["cells"]["step"] == f"step {latest.step}" for row in browser.table.rows)
        browser.close()
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS
