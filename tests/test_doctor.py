"""See inside a running group: every rank's stack (``%rtnb stacks``), and the hang
doctor, which shows them unasked once a cell has been quiet for ``--hang-after``."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from tests._margins import until

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Rank 1 skips step 2's all_reduce and waits for a file instead: rank 0 is left in
# the collective (the classic hang) until the test writes the file.
SKIPS_ALL_REDUCE = """\
import os, time, torch, torch.distributed as dist, rtnb
rank = rtnb.get_context().world_rank
for step in range(4):
    t = torch.ones(1)
    if rank == 1 and step == 2:
        while not os.path.exists(FLAG): time.sleep(0.05)
    dist.all_reduce(t)
    rtnb.report({"total": float(t)})
"""


@pytest.fixture(scope="module")
def session(ray_cluster, tmp_path_factory):
    import rtnb

    session = rtnb.Session(
        workers=2,
        stop_grace_s=1.0,
        hang_after_s=3.0,
        storage=str(tmp_path_factory.mktemp("runs")),
    )
    session.start()
    yield session
    session.stop()


def _wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    return until(what, predicate, timeout, poll_s=0.1)


def test_a_rank_that_skips_an_all_reduce_is_named_with_the_cell_line_each_rank_waits_at(
    session, tmp_path
):
    flag = tmp_path / "go"
    session.push({"FLAG": str(flag)})
    notes: list[str] = []
    handle = session.run_background(SKIPS_ALL_REDUCE, label="[7]")
    handle.add_sink(lambda rank, stream, text: notes.append(text) if rank < 0 else None)
    try:
        hang = _wait_for(lambda: handle.hang, 30, "the hang doctor")
        assert hang.stalled_s >= 3.0
        sets = {s.ranks: s for s in hang.sets}
        assert set(sets) == {(0,), (1,)}
        # Rank 1 is the odd one: rank 0 waits inside the collective for it.
        assert sets[(1,)].odd and not sets[(0,)].odd
        assert hang.odd_ranks == [1]
        rank0, rank1 = hang.stacks[0], hang.stacks[1]
        assert rank0.cell_frame.where == "cell [7] line 7"  # dist.all_reduce(t)
        assert rank0.innermost.function == "all_reduce"
        assert "torch/distributed" in rank0.innermost.filename
        assert rank1.cell_frame.where == "cell [7] line 6"  # the while loop
        assert rank1.cell_frame.text == "while not os.path.exists(FLAG): time.sleep(0.05)"
        headline = hang.headline()
        assert headline.startswith("rank 1: in <module> at cell [7] line 6; rank 0: in all_reduce")
        assert "at cell [7] line 7" in headline
        # rtnb's own frames (the exec machinery, the actor) are not shown.
        assert not any("rtnb/" in f.filename for s in hang.stacks.values() for f in s.frames)
        _wait_for(lambda: any("reported and printed nothing" in n for n in notes), 10, "the note")
        note = next(n for n in notes if "reported and printed nothing" in n)
        assert "rank 1: in <module> at cell [7] line 6" in note
        # The full stacks outlast the kernel: in each rank's log, which the note names.
        kept = re.search(r"kept in (\S+rank-0\.log) and the other ranks' logs", note)
        assert kept, note
        for rank, line in ((0, "cell [7] line 7"), (1, "cell [7] line 6")):
            log = Path(kept.group(1)).with_name(f"rank-{rank}.log").read_text()
            assert "[rtnb] hang doctor" in log and f"{line} in <module>" in log, log[-2000:]
        # Asked again from the notebook while the cell still hangs: the same answer,
        # each stack taken by the rank itself.
        began = time.monotonic()
        asked = session.stacks()
        assert time.monotonic() - began < 2.0
        assert asked.stalled_s is None
        assert {r: s.cell_frame.where for r, s in asked.stacks.items()} == {
            0: "cell [7] line 7",
            1: "cell [7] line 6",
        }
        assert all(str(m) == "python" for m in asked.methods.values())
        assert "rank 1" in asked.html() and "differs" in asked.text()
    finally:
        flag.touch()
    handle.wait(60)
    assert handle.steps == {0: 3, 1: 3}
    # The cell went on: the diagnosis is gone with the quiet.
    assert handle.hang is None
    idle = session.stacks()
    assert all(not s.running for s in idle.stacks.values())
    assert idle.headline() == "ranks 0-1: no cell running"


def test_a_rank_stuck_in_native_code_holding_the_gil_is_read_with_py_spy(session, tmp_path):
    from rtnb.driver.tools._hang_doctor import py_spy_path

    if py_spy_path() is None:
        pytest.skip("py-spy is not installed here")
    # ctypes.PyDLL keeps the GIL through the call: the rank's actor cannot answer.
    entered = tmp_path / "entered"
    code = (
        "import ctypes, rtnb\n"
        "if rtnb.get_context().world_rank == 1:\n"
        f"    open({str(entered)!r}, 'w').close()\n"
        "    ctypes.PyDLL(None).sleep(6)\n"
    )
    handle = session.run_background(code, label="[9]")
    deadline = time.monotonic() + 60
    while not entered.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert entered.exists(), "rank 1 never reached the native call"
    stacks = session.stacks()
    rank1 = stacks.stacks[1]
    if str(rank1.method) == "none" and "ptrace" in rank1.note:
        pytest.skip(f"this machine forbids py-spy: {rank1.note}")
    assert str(rank1.method) == "py-spy", rank1.note
    assert rank1.cell_frame.where == "cell [9] line 4"
    assert "did not answer" in rank1.note
    assert "[py-spy]" in stacks.text()
    assert not stacks.stacks[0].running  # rank 0 finished its (empty) part
    handle.wait(30)
    # Its stack call, queued while the GIL was held, was answered since: asked
    # again, rank 1 answers for itself.
    again = session.stacks()
    assert str(again.stacks[1].method) == "python"


def test_stacks_in_a_real_kernel_the_magic_the_live_views_hang_panel_and_its_button(
    ray_cluster, tmp_path
):
    from tests._kernel import Kernel

    flag = tmp_path / "go"
    kernel = Kernel(cwd=str(tmp_path), env={**os.environ, "RTNB_LIVE": "1"})
    try:
        start = kernel.execute(
            "%load_ext rtnb\n"
            f"%rtnb start --workers 2 --cpus-per-worker 0.5 --hang-after 2 --storage {tmp_path}\n"
            f"FLAG = {str(flag)!r}\n"
            "%rtnb push FLAG",
            timeout=180,
        )
        assert start.status == "ok", start.text + start.evalue
        cell = kernel.execute("%%rtrain --background\n" + SKIPS_ALL_REDUCE, timeout=60)
        assert cell.status == "ok", cell.text + cell.evalue
        # The hang doctor fills the live view's panel unasked.
        panel = kernel.execute(
            "import time\n"
            "view = get_ipython().magics_manager.registry['RtnbMagics'].last_view\n"
            "deadline = time.monotonic() + 30\n"
            "while 'rtnb-stacks' not in view._stacks_view.value and time.monotonic() < deadline:\n"
            "    time.sleep(0.2)\n"
            "print(view._stacks_view.value)",
            timeout=60,
        )
        assert panel.status == "ok", panel.text + panel.evalue
        assert "no report or output for" in panel.text
        # The while loop, line 6 of the code: line 7 of the cell as the editor numbers
        # it (`%%rtrain` is line 1).
        assert "rank 1" in panel.text and "line 7" in panel.text, panel.text
        # %rtnb stacks from another cell, while the background cell hangs.
        asked = kernel.execute("%rtnb stacks", timeout=60)
        assert asked.status == "ok", asked.text + asked.evalue
        shown = asked.results[0]
        assert "rank 1: in <module> at cell" in shown["text/plain"]
        assert "rank 0: in all_reduce" in shown["text/plain"]
        assert "differs" in shown["text/plain"] and "rtnb-stacks" in shown["text/html"]
        # One rank, as --ranks takes it everywhere.
        one = kernel.execute("%rtnb stacks --ranks 1", timeout=60)
        assert one.status == "ok", one.text + one.evalue
        assert one.results[0]["text/plain"].startswith("rank 1: in <module> at cell")
        assert "rank 0" not in one.results[0]["text/plain"]
        # The view's Stacks button asks the same.
        button = kernel.execute(
            "view._stacks_view.value = ''\n"
            "view._stacks_button.click()\n"
            "print(view._stacks_view.value.count('rtnb-stack-set'))",
            timeout=60,
        )
        assert button.status == "ok", button.text + button.evalue
        assert button.text.strip().endswith("2")
        flag.touch()
        done = kernel.execute("%rtnb wait --timeout 60\n%rtnb stop", timeout=120)
        assert done.status == "ok", done.text + done.evalue
    finally:
        kernel.shutdown()


def test_each_ranks_cpu_and_memory_reach_the_header_and_the_system_record_not_the_metrics(
    session,
):
    from rtnb.widgets import format_header

    from rtnb.storage._metricslog import read_metrics
    from rtnb.storage._rundir import RunDirectory

    code = (
        "import time, rtnb\n"
        "kept = []\n"
        "busy = rtnb.get_context().world_rank == 1\n"
        "for step in range(25):\n"
        "    kept.append(bytearray(2_000_000))\n"
        "    rtnb.report({'loss': 1.0 / (step + 1)})\n"
        "    until = time.perf_counter() + 0.1\n"
        "    while busy and time.perf_counter() < until:\n"
        "        pass  # rank 1 computes, rank 0 sleeps\n"
        "    time.sleep(0 if busy else 0.1)\n"
    )
    began = time.time()
    session.run(code, output=lambda *_: None)
    took = time.time() - began
    latest = session.metrics.system_latest()
    assert sorted(latest) == [0, 1]
    assert all(s.rss_bytes > 50 * 2**20 for s in latest.values())
    header = format_header(session.metrics.progress(), "running", resources=latest, climbing=[1])
    assert "CPU " in header and " MB" in header and "memory climbing: rank 1" in header
    session.metrics.flush()
    run_dir = RunDirectory(session.config.storage, session.run_name)
    system = read_metrics(run_dir, system=True)
    assert {r["rank"] for r in system} == {0, 1}
    assert all({"sys/cpu", "sys/rss_mb"} <= set(r) for r in system)
    # One sample a second per rank at most (the cell takes 2.5 s or, busy, longer).
    during = [r for r in system if r["timestamp"] >= began]
    assert 1 <= sum(1 for r in during if r["rank"] == 0) <= took + 1, (took, during)
    # The busy rank's CPU shows: well above the sleeping rank's.
    cpu = {rank: max(r["sys/cpu"] for r in during if r["rank"] == rank) for rank in (0, 1)}
    assert cpu[1] >= 30 and cpu[1] > cpu[0] + 20, cpu
    # The training metrics stay as reported: no sys/ column, 25 steps per rank.
    trained = [r for r in read_metrics(run_dir) if "loss" in r]
    assert not any(k.startswith("sys/") for r in read_metrics(run_dir) for k in r)
    assert len(trained) >= 50


TRIGGERED = """\
import time, rtnb
evals, index = [], 0
rtnb.on_trigger("eval", lambda: evals.append(index))
rtnb.on_save(lambda: {"index": index})
for index in range(300):
    rtnb.report({"index": index})
    time.sleep(0.01)
"""


def test_a_trigger_and_save_now_run_on_every_rank_at_one_step_and_the_save_is_committed(
    session,
):
    import rtnb
    from rtnb.storage._metricslog import read_metrics
    from rtnb.storage._rundir import RunDirectory

    with pytest.raises(rtnb.SessionError, match="none is running"):
        session.trigger("eval")
    lines: list[str] = []
    handle = session.run_background(TRIGGERED, output=lambda r, s, t: lines.append(t))
    start = session.metrics.count(0)
    _wait_for(lambda: session.metrics.count(0) - start >= 50, 60, "50 reports")
    evaluated = session.trigger("eval")
    saved = session.save_now()
    unknown = session.trigger("nobody_listens")
    handle.wait(60)
    # Asked one after the other, they may share a step (no rank had reported since).
    assert evaluated <= saved <= unknown
    session.metrics.flush()
    rows = read_metrics(RunDirectory(session.config.storage, session.run_name))
    index_at = {(r["rank"], r["step"]): r["index"] for r in rows if "index" in r}
    # Each rank ran its handler once, in the report of that step, before recording it.
    evals = session.pull("evals")
    assert evals == [[index_at[(0, evaluated)]], [index_at[(1, evaluated)]]]
    assert evals[0] == evals[1]
    # save-now: that step's checkpoint, both ranks' state, committed.
    info = next(c for c in session.list_checkpoints() if c.step == saved)
    assert info.ranks == [0, 1]
    state = session.load(info.id).load_state()
    assert state == {"index": index_at[(0, saved)]}
    assert any("nothing handles trigger 'nobody_listens'" in line for line in lines)
    assert session.metrics.markers[-3:] == [
        (evaluated, "trigger eval"),
        (saved, "save-now"),
        (unknown, "trigger nobody_listens"),
    ]


# The interactive session's notebook: a background training cell, a change made
# from the next cell while it runs, then what the ranks saw.
SET_WHILE_RUNNING = [
    "%load_ext rtnb\n%rtnb start --workers 2 --cpus-per-worker 0.5 --storage {runs}",
    "%%rtrain --background\n"
    "import time, rtnb\n"
    "seen = []\n"
    "for step in range(150):\n"
    "    lr = rtnb.control('lr', 0.1)\n"
    "    seen.append(lr)\n"
    "    rtnb.report({'lr': lr})\n"
    "    time.sleep(0.02)\n",
    "import time\n"
    "cell = get_ipython().magics_manager.registry['RtnbMagics'].session.active_cell\n"
    "while min(cell.steps.values()) < 20:\n"
    "    time.sleep(0.05)\n",
    "%rtnb set lr=0.5",
    "%rtnb wait\n"
    "seen = %rtnb pull seen\n"
    "print('SEEN', seen[0].index(0.5), seen[0] == seen[1], len(seen[0]))",
    "%rtnb stop",
]


def _seen_line(nb) -> str:
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            for line in str(output.get("text", "")).splitlines():
                if line.startswith("SEEN "):
                    return line
    raise AssertionError("no SEEN line in the notebook")


def test_rtnb_run_of_the_saved_notebook_makes_the_live_change_again_at_the_same_step(
    ray_cluster, tmp_path
):
    import subprocess
    import sys

    import nbformat
    from nbclient import NotebookClient

    from rtnb.core._changes import CHANGES_MIME
    from tests._kernel import new_notebook

    nb = new_notebook([c.replace("{runs}", str(tmp_path / "runs")) for c in SET_WHILE_RUNNING])
    before = os.environ.get("RTNB_LIVE")
    os.environ["RTNB_LIVE"] = "1"  # the live view, as in JupyterLab
    try:
        NotebookClient(
            nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    finally:
        if before is None:
            os.environ.pop("RTNB_LIVE", None)
        else:
            os.environ["RTNB_LIVE"] = before
    interactive = _seen_line(nb)
    switched = int(interactive.split()[1])
    assert switched >= 20 and interactive.endswith("True 150"), interactive
    # The saved notebook keeps the change with the training cell's output.
    records = [
        o["data"][CHANGES_MIME] for o in nb.cells[1].outputs if CHANGES_MIME in o.get("data", {})
    ]
    assert len(records) == 1 and records[0]["controls"][0][:2] == ["lr", 0.5]
    saved = tmp_path / "session.ipynb"
    nbformat.write(nb, saved)
    out = tmp_path / "batch.ipynb"
    proc = subprocess.run(
        [sys.executable, "-m", "rtnb.batch.cli", "run", str(saved), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The re-run switched at the same step, and the %rtnb set cell did not switch again.
    assert _seen_line(nbformat.read(out, as_version=4)) == interactive
    said = "".join(o.get("text", "") for o in nbformat.read(out, as_version=4).cells[3].outputs)
    assert "lr = 0.5 from step" in said


def test_a_breakpoint_on_rank_1_is_answered_in_the_notebook_and_a_failed_rank_is_debugged_after(
    ray_cluster, tmp_path
):
    from tests._kernel import Kernel

    kernel = Kernel(cwd=str(tmp_path))
    try:
        start = kernel.execute(
            f"%load_ext rtnb\n%rtnb start --workers 2 --cpus-per-worker 0.5 --storage {tmp_path}",
            timeout=180,
        )
        assert start.status == "ok", start.text + start.evalue
        # rtnb.breakpoint(rank=1): only rank 1 stops; the test types `p x` and `c`.
        stopped = kernel.execute(
            "%%rtrain\n"
            "import rtnb\n"
            "x = 40 + rtnb.get_context().world_rank\n"
            "rtnb.breakpoint(rank=1)\n"
            "y = x + 1\n"
            "y",
            timeout=120,
            stdin=["p x", "c"],
        )
        assert stopped.status == "ok", stopped.text + stopped.evalue
        assert [p for p, _ in stopped.prompts] == ["(Pdb rank 1) ", "(Pdb rank 1) "]
        # Where it stopped was shown before the first prompt; `p x` printed rank 1's x.
        assert "y = x + 1" in stopped.prompts[0][1]
        assert "41" in stopped.prompts[1][1]
        assert "42" in "".join(str(r) for r in stopped.results)  # both ranks went on
        # A cell that fails on rank 1, then a post-mortem on it with its locals.
        failed = kernel.execute(
            "%%rtrain\n"
            "import rtnb\n"
            "def step(batch):\n"
            "    scale = 7\n"
            "    return batch / (rtnb.get_context().world_rank - 1)\n"
            "step(3.0)",
            timeout=120,
        )
        assert failed.ename, failed.text
        post = kernel.execute("%rtnb debug 1", timeout=120, stdin=["p scale, batch", "q"])
        assert post.status == "ok", post.text + post.evalue
        assert post.prompts and post.prompts[0][0] == "(Pdb rank 1) "
        assert "post-mortem of rank 1" in post.prompts[0][1]
        assert "(7, 3.0)" in post.prompts[1][1]
        # Rank 0 did not fail: nothing to debug there, in one line.
        none = kernel.execute("%rtnb debug 0", timeout=60)
        assert none.stderr.startswith("UsageError: rank 0 has no failed cell"), none.text
        done = kernel.execute("%rtnb stop", timeout=60)
        assert done.status == "ok"
    finally:
        kernel.shutdown()


def test_under_papermill_a_breakpoint_is_skipped_with_one_line_never_a_hang(ray_cluster, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    from tests._kernel import new_notebook

    nb = new_notebook(
        [
            f"%load_ext rtnb\n%rtnb start --workers 2 --cpus-per-worker 0.5 --storage {tmp_path}",
            "%%rtrain\nhits = 0\nfor i in range(3):\n    breakpoint()\n    hits += 1\nhits",
            "%rtnb stop",
        ]
    )
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    text = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert text.count("skipped") == 2, text  # one line per rank
    assert "nobody can answer a debugger prompt" in text
    shown = "".join(str(o.get("data", {})) for o in nb.cells[1].outputs)
    assert "3" in shown
    nbformat.write(nb, tmp_path / "out.ipynb")


def test_interrupt_at_a_ranks_prompt_stops_the_cell_and_a_background_breakpoint_is_attached_to(
    ray_cluster, tmp_path
):
    from tests._kernel import Kernel

    kernel = Kernel(cwd=str(tmp_path))
    try:
        start = kernel.execute(
            "%load_ext rtnb\n"
            f"%rtnb start --workers 2 --cpus-per-worker 0.5 --stop-grace 1 --storage {tmp_path}",
            timeout=180,
        )
        assert start.status == "ok", start.text + start.evalue
        # Nobody types a command (empty lines) until Kernel -> Interrupt.
        stuck = kernel.execute(
            "%%rtrain\nimport rtnb\nrtnb.breakpoint(rank=0)\nprint('not reached')",
            timeout=120,
            stdin=[],
            interrupt_after=4.0,
        )
        assert stuck.ename == "CellInterrupted", stuck.text + stuck.evalue
        assert "[rank 0] not reached" not in stuck.text and "[rank 1] not reached" in stuck.text
        again = kernel.execute("%%rtrain\n21 * 2", timeout=60)
        assert again.status == "ok" and "42" in str(again.results), again.text + again.evalue
        # A background cell's breakpoint waits for %rtnb debug from another cell.
        background = kernel.execute(
            "%%rtrain --background\n"
            "import rtnb\n"
            "z = 7 * (rtnb.get_context().world_rank + 1)\n"
            "rtnb.breakpoint(rank=1)\n"
            "z",
            timeout=60,
        )
        assert background.status == "ok", background.text + background.evalue
        attached = kernel.execute(
            "import time\n"
            "cell = get_ipython().magics_manager.registry['RtnbMagics'].session.active_cell\n"
            "while not cell.debugging:\n"
            "    time.sleep(0.05)\n"
            "%rtnb debug 1",
            timeout=60,
            stdin=["p z", "c"],
        )
        assert attached.status == "ok", attached.text + attached.evalue
        assert [p for p, _ in attached.prompts] == ["(Pdb rank 1) ", "(Pdb rank 1) "]
        assert "14" in attached.prompts[1][1]
        waited = kernel.execute("%rtnb wait --timeout 30", timeout=60)
        assert waited.status == "ok" and "14" in str(waited.results), waited.text
        kernel.execute("%rtnb stop", timeout=60)
    finally:
        kernel.shutdown()


# 2-rank DDP; rank 1 spends 20 ms more per step outside torch (a slow input
# pipeline written in Python): the others wait for it in the all-reduce.
DDP_STEPS = """\
import time, torch, rtnb
torch.manual_seed(0)
model = rtnb.prepare_model(torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 256)
rank = rtnb.get_context().world_rank
for i in range(30):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if rank == 1:
        time.sleep(0.02)
    rtnb.report({"loss": loss.item()})
"""


def test_a_profile_of_20_ddp_steps_gives_one_trace_a_row_per_rank_and_parts_that_add_up(
    session,
):
    import json

    step_before = max(
        session.run("import rtnb\nrtnb.get_context()", output=lambda *_: None).values(), key=id
    )
    assert step_before is not None
    assert session.profile(steps=20) is None  # armed for the next cell
    session.run(DDP_STEPS, output=lambda *_: None)
    report = session.last_profile
    assert report is not None and report.steps == 20
    assert sorted(report.ranks) == [0, 1]
    for prof in report.ranks.values():
        assert not prof.error, prof.error
        assert prof.parts["compute"] > 0 and prof.parts["rtnb"] > 0
    # Where each rank's time went, in ms per step: rank 1's 20 ms of Python outside
    # torch is idle time on rank 1 and, on rank 0, time waiting in the all-reduce.
    per = {
        rank: {part: 1e3 * s / prof.steps for part, s in prof.parts.items()}
        for rank, prof in report.ranks.items()
    }
    assert per[1]["idle"] >= 15, per
    assert per[0]["idle"] < per[1]["idle"] - 10, per
    assert per[0]["communication"] > per[1]["communication"], per
    assert report.straggler == 1 and report.cause == "idle"
    # Its lead is about the 20 ms it sleeps; at least half of it, and a busy machine
    # may stretch it (the precise figure is the doctor benchmark's, not a test's).
    assert 10 <= report.lead_ms <= 200, report.lead_ms
    assert "straggler: rank 1" in report.summary()
    # One Chrome/Perfetto trace: one process per rank, named, on one clock.
    with open(report.trace) as src:
        trace = json.load(src)
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    spans = {}
    for e in events:
        if e.get("ph") == "X":
            lo, hi = spans.get(e["pid"], (e["ts"], e["ts"]))
            spans[e["pid"]] = (min(lo, e["ts"]), max(hi, e["ts"] + e.get("dur", 0)))
    # The ranks profiled the same steps: their spans overlap on the shared clock.
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]
