"""Local mode (``--workers 0``): the training code runs in the kernel's own process,
with the same API, and leaves for Ray ranks without a code change."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import nbformat
import pytest

from tests._kernel import new_notebook

pytestmark = [pytest.mark.slow]

TRAIN = (
    "import torch, rtnb, torch.distributed as dist\n"
    "torch.manual_seed(0)\n"
    "model = rtnb.prepare_model(torch.nn.Linear(4, 1))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "data = torch.randn(64, 4)\n"
    "target = data.sum(dim=1, keepdim=True)\n"
    "start = 0\n"
    "ckpt = rtnb.get_checkpoint()\n"
    "if ckpt:\n"
    "    state = ckpt.load_state()\n"
    "    model.load_state_dict(state['model'])\n"
    "    start = state['epoch'] + 1\n"
    "for epoch in range(start, start + 5):\n"
    "    loss = torch.nn.functional.mse_loss(model(data), target)\n"
    "    opt.zero_grad(); loss.backward(); opt.step()\n"
    "    dist.all_reduce(loss.detach())\n"
    "    rtnb.report({'loss': loss.item()}, checkpoint=rtnb.Checkpoint.from_state("
    "{'model': model.state_dict(), 'epoch': epoch}))\n"
    "epoch"
)


def test_local_mode_has_the_ranks_api_checkpoints_journal_and_stop(tmp_path):
    """A Session with workers=0 starts no Ray, runs cells in this process's rank
    (world size 1, a process group of one), reports, commits checkpoints that the
    next cell resumes from, journals every cell, and a stop mid-loop keeps the
    variables; stopping gives the process its streams and Ray Train's names back."""
    import ray

    # Cell threads of runtimes other tests of this process made are not this rank's.
    before = {t.ident for t in threading.enumerate() if t.name == "rtnb-cell"}

    import rtnb

    ray_before = ray.is_initialized()
    stdout_before = sys.stdout
    session = rtnb.Session(workers=0, storage=str(tmp_path), stop_grace_s=1.0)
    session.start()
    try:
        assert session.connection is None and ray.is_initialized() == ray_before, (
            "local mode starts or joins no Ray"
        )
        status = session.status()
        assert status.world_size == 1 and status.ranks[0].pid == os.getpid()
        assert "local mode" in str(status)
        lines: list[tuple[int, str]] = []
        value = session.run(TRAIN, output=lambda rank, _stream, text: lines.append((rank, text)))
        assert value[0] == 4
        assert [c.step for c in session.list_checkpoints()] == [0, 1, 2, 3, 4]
        assert session.run(TRAIN)[0] == 9, "the next cell resumed from the latest checkpoint"
        losses = session.result().metrics_dataframe["loss"].tolist()
        assert len(losses) == 10 and losses[-1] < losses[0]
        # The API a ranks' cell has, here: context, ray.train's names, output captured.
        probe = session.run(
            "import rtnb, threading, ray.train, ray.train.torch\n"
            "ctx = ray.train.get_context()\n"
            "print('from the rank', threading.current_thread().name)\n"
            "(ctx.get_world_rank(), ctx.get_world_size(), ray.train.report is rtnb.report,"
            " ray.train.torch.prepare_model is rtnb.prepare_model)",
            output=lambda rank, _stream, text: lines.append((rank, text)),
        )
        assert probe[0] == (0, 1, True, True)
        assert any("from the rank rtnb-cell" in text for rank, text in lines if rank == 0)
        # A stop mid-loop ends the cell at a report() and keeps its variables.
        handle = session.run_background(
            "import rtnb, time\nfor i in range(100000):\n    kept = i\n"
            "    rtnb.report({'x': i})\n    time.sleep(0.01)"
        )
        while not session.metrics.count():
            handle.wait_left(0.05)
        handle.stop()
        with pytest.raises(rtnb.CellInterrupted):
            handle.wait(30)
        assert session.pull("kept")[0] >= 0
        kinds = [e.kind.value for e in session.journal.entries()]
        assert kinds[0] == "start" and kinds.count("cell") == 4 and kinds.count("cell_end") == 4
    finally:
        session.stop()
    assert sys.stdout is stdout_before, "the process has its own streams back"
    import ray.train

    assert ray.train.report is not rtnb.report, "Ray Train's own names are back"
    assert not [
        t
        for t in threading.enumerate()
        if t.name == "rtnb-cell" and t.is_alive() and t.ident not in before
    ]
    import torch.distributed as dist

    assert not dist.is_initialized(), "the process group of one is gone with the group"


def test_local_mode_with_gpu_and_no_gpu_here_is_one_line(tmp_path):
    import torch

    import rtnb

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    session = rtnb.Session(workers=0, gpu=True, storage=str(tmp_path))
    with pytest.raises(rtnb.RtnbError) as caught:
        session.start()
    message = str(caught.value)
    assert "--gpu" in message and "torch sees none" in message and "\n" not in message
    assert session.group is None


@pytest.mark.ray
def test_breakpoint_and_debug_reach_local_code_and_scale_2_keeps_its_variables(kernel, tmp_path):
    """In a real kernel: a cell's breakpoint() stops in the training code with its
    location shown above pdb's prompt, `p x` prints the rank's value, `c` goes on;
    after a failed cell %debug opens in the cell's own frame; `%rtnb scale 2` then
    puts the same variables on two Ray ranks (the breakpoint is not replayed)."""
    start = kernel.execute(f"%rtnb start --workers 0 --storage {tmp_path}")
    assert start.status == "ok", start.text + str(start.traceback)
    shown = json.dumps(start.results)
    assert "local mode" in shown, shown
    pid = kernel.execute("import os; print(os.getpid())").stdout.strip()

    run = kernel.execute(
        "%%rtrain\nimport os, rtnb\nx = 41\nbreakpoint()\ny = x + 1\n"
        "rtnb.report({'loss': 1.0})\nprint('ran in', os.getpid())",
        stdin=["p x", "c"],
        timeout=120,
    )
    assert run.status == "ok", run.text + str(run.traceback)
    assert len(run.prompts) >= 2, run.prompts
    assert "(Pdb)" in run.prompts[0][0]
    assert "-> y = x + 1" in run.prompts[0][1], f"the location above the prompt: {run.prompts}"
    assert "41" in run.prompts[1][1].split("-> y = x + 1")[-1], run.prompts
    assert f"ran in {pid}" in run.stdout, run.stdout

    failed = kernel.execute("%%rtrain\ndef f(z):\n    return 1 / z\nf(0)")
    assert failed.status == "error" and failed.ename == "CellError"
    assert "ZeroDivisionError" in "\n".join(failed.traceback)
    debug = kernel.execute("%debug", stdin=["p z + 100", "q"], timeout=60)
    assert debug.status == "ok", debug.text
    shown = re.sub(r"\x1b\[[0-9;]*m", "", debug.stdout)  # IPython's debugger colours
    assert "return 1 / z" in shown and "\n100\n" in shown, shown

    scaled = kernel.execute("%rtnb scale 2", timeout=240)
    assert scaled.status == "ok", scaled.text + str(scaled.traceback)
    pulled = kernel.execute("ys = %rtnb pull y\nprint(ys)")
    assert "[42, 42]" in pulled.stdout, pulled.text
    where = kernel.execute("%%rtrain\nimport os\nprint('pid', os.getpid())")
    rank_pids = re.findall(r"\[rank \d\] pid (\d+)", where.stdout)
    assert where.status == "ok" and len(rank_pids) == 2 and pid not in rank_pids, where.text
    stop = kernel.execute("%rtnb stop")
    assert stop.status == "ok", stop.text


@pytest.mark.ray
def test_rtnb_run_runs_a_local_mode_notebook(tmp_path):
    """Unattended (papermill): a notebook whose group is local mode runs to the end
    and keeps its reports and checkpoint in the run directory."""
    notebook = tmp_path / "local.ipynb"
    nbformat.write(
        new_notebook(
            [
                f"%load_ext rtnb\n%rtnb start --workers 0 --name local-batch --storage {tmp_path / 'runs'}",
                "%%rtrain\n" + TRAIN,
                "%rtnb stop",
            ]
        ),
        notebook,
    )
    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "rtnb"), "run", str(notebook)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import rtnb
    from rtnb.storage._checkpoints import CheckpointStore

    result = rtnb.Result.from_path(str(tmp_path / "runs" / "local-batch"))
    assert len(result.metrics_dataframe) == 5
    saved = CheckpointStore.of_run(str(tmp_path / "runs"), "local-batch").list()
    assert [c.step for c in saved] == [0, 1, 2, 3, 4]


def test_a_cell_s_end_does_not_wait_on_storage_for_run_json_and_an_older_record_never_wins(
    tmp_path,
):
    """run.json after a training cell is written in the background, the newest
    record of those waiting: the cell returns while the write is held up, and a stop
    that follows (written before it returns) is what the file keeps, never the
    cell's older record written after it. A burst of cells then a stop leaves the
    last step and "stopped"."""
    from rtnb.driver.control._run_files import _NewestRecord
    from rtnb.storage._layout import RunRecord

    in_file: list[RunRecord] = []
    writing, release = threading.Event(), threading.Event()

    def write(record: RunRecord) -> None:
        if record.status == "cell ended":
            writing.set()
            assert release.wait(30), "the held-up write was never let go"
        in_file.append(record)

    records = _NewestRecord(write)
    records._IDLE_S = 0.05  # its thread ends soon after its last write: joined below
    records.later(RunRecord(status="cell ended", last_step=1))  # returns at once
    writer = records._thread
    assert writer is not None and writing.wait(30), "the background write never began"
    records.later(RunRecord(status="cell ended", last_step=2))  # waits behind it
    stopper = threading.Thread(target=records.now, args=(RunRecord(status="stopped"),))
    stopper.start()
    release.set()
    stopper.join(30)
    writer.join(30)
    assert not stopper.is_alive(), "the stop's record was never written"
    # The held-up write of step 1 lands, and "stopped" is the file's last word: step
    # 2 is written before it or, once the stop's record is in, never.
    written = [(r.status, r.last_step) for r in in_file]
    assert written in (
        [("cell ended", 1), ("stopped", -1)],
        [("cell ended", 1), ("cell ended", 2), ("stopped", -1)],
    ), written

    import rtnb

    session = rtnb.Session(workers=0, storage=str(tmp_path / "runs")).start()
    try:
        for _ in range(20):
            session.run("import rtnb\nrtnb.report({'x': 1.0})", output=lambda *_: None)
    finally:
        session.stop()
    record = json.loads((tmp_path / "runs" / session.run_name / "run.json").read_text())
    assert record["status"] == "stopped" and record["last_step"] == 19, record
