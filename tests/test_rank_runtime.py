"""A rank's runtime without Ray: cells, tracebacks, stops, interrupts, output, triggers, the relay's waits and the debugger channel (worker/)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from rtnb.core._messages import CellRequest, CellState, RankUpdate
from rtnb.core._reports import ReportBatch
from rtnb.core._values import from_portable
from rtnb.worker._runtime import RankContext, RankRuntime


@pytest.fixture
def runtime():
    saved = sys.stdout, sys.stderr
    rt = RankRuntime(RankContext(world_rank=0, world_size=1))
    yield rt
    rt.close()
    sys.stdout, sys.stderr = saved


def _run(
    rt: RankRuntime, code: str, cell_id: int = 1, timeout: float = 10.0, label: str | None = None
) -> RankUpdate:
    """Run a cell to its end; one RankUpdate with every poll's output and reports."""
    rt.start_cell(CellRequest(cell_id, code, label=label))
    deadline = time.monotonic() + timeout
    output, reports = [], []
    while time.monotonic() < deadline:
        update = rt.wait(0.2, 0.0)
        output += update.output
        reports += update.reports.rows() if update.reports else []
        if update.state is not CellState.RUNNING:
            update.output, update.reports = output, ReportBatch.from_records(reports)
            return update
    raise AssertionError("cell did not finish")


def test_runtime_keeps_namespace_and_returns_last_expression(runtime):
    assert _run(runtime, "x = 40").state is CellState.DONE
    update = _run(runtime, "print('hi')\nx + 2", cell_id=2)
    assert from_portable(update.value) == 42
    assert "".join(text for _s, text in update.output) == "hi\n"


def test_runtime_traceback_shows_user_code_only(runtime):
    update = _run(runtime, "def f():\n    raise ValueError('boom')\nf()")
    summary, tb = update.error
    assert summary == "ValueError: boom"
    assert "Cell rtrain-cell-1, line 2, in f()" in tb
    assert "----> 2     raise ValueError('boom')" in tb and "Cell rtrain-cell-1, line 3\n" in tb
    assert tb.rstrip().endswith("ValueError: boom") and "_runtime.py" not in tb


def test_a_notebook_cells_traceback_names_it_as_jupyter_does(runtime):
    update = _run(runtime, "x = 1\nraise KeyError('k')", cell_id=3, label="[8]")
    shown = update.error[1]
    # As IPython shows its own cells' tracebacks: the lines up to the one that raised.
    assert "Cell In[8], line 2\n      1 x = 1\n----> 2 raise KeyError('k')\n" in shown, shown


def test_a_cell_run_again_is_named_by_its_new_number_in_tracebacks(runtime):
    # The rank reuses the first run's compiled code: its functions' frames too must
    # carry the new name, or tracebacks would show the old cell's lines.
    code = "def f():\n    raise ValueError('again')\nf()"
    first = _run(runtime, code, cell_id=4, label="[4]")
    again = _run(runtime, code, cell_id=5, label="[5]")
    assert "Cell In[4], line 2, in f()" in first.error[1], first.error[1]
    assert "In[4]" not in again.error[1], again.error[1]
    assert "Cell In[5], line 2, in f()" in again.error[1], again.error[1]
    assert "raise ValueError('again')" in again.error[1]


def test_report_pauses_on_stop_and_leaves_at_the_target_step(runtime):
    runtime.start_cell(
        CellRequest(
            1,
            "import time\nfrom rtnb.worker._runtime import current_runtime as c\nwhile True:\n    c().reports.report({'v': 1})\n    time.sleep(0.001)",
        )
    )
    time.sleep(0.1)
    runtime.request_stop()
    deadline = time.monotonic() + 5
    update = runtime.wait(2.0, 0.0)
    while update.paused_at is None and time.monotonic() < deadline:
        update = runtime.wait(2.0, 0.0)
    assert update.paused_at is not None, "a rank must pause at its next report()"
    paused = update.paused_at
    runtime.set_stop_target(paused + 3)
    while update.state is CellState.RUNNING:
        update = runtime.wait(2.0, 0.0)
    assert update.state is CellState.INTERRUPTED
    assert runtime.step == paused + 3


def test_interrupt_breaks_a_pure_python_loop(runtime):
    runtime.start_cell(CellRequest(1, "n = 0\nwhile True:\n    n += 1"))
    time.sleep(0.2)
    assert runtime.interrupt()
    update = runtime.wait(5.0, 0.0)
    assert update.state is CellState.INTERRUPTED
    assert runtime.namespace["n"] > 0


def test_a_cell_run_by_the_relay_listener_in_its_own_thread_can_be_interrupted(runtime):
    code = "n = 0\nwhile True:\n    n += 1"

    def listener():  # what a listening rank does with a relayed cell
        request = CellRequest(1, code, token=7)
        if runtime.start_cell(request, in_caller=True):
            runtime.execute(request)

    thread = threading.Thread(target=listener)
    thread.start()
    while runtime.namespace.get("n", 0) == 0:
        time.sleep(0.01)
    assert not runtime.start_cell(CellRequest(1, code, token=7)), "a direct call: not again"
    assert runtime.interrupt()
    thread.join(5)
    assert not thread.is_alive(), "the interrupt reached the thread running the cell"
    assert runtime.wait(5.0, 0.0).state is CellState.INTERRUPTED


@pytest.mark.parametrize("first", ["c().reports.report({'v': 1})", "print('first line')"])
def test_the_relays_first_wait_gives_way_at_a_cells_first_report_or_line(runtime, first):
    # The relay answers for a rank only when its cell ended with nothing to deliver;
    # a cell that reports or prints is handed to the long-poll at once rather than
    # at its end, so the first points of a live plot are not held back.
    runtime.start_cell(
        CellRequest(
            1,
            "import time\nfrom rtnb.worker._runtime import current_runtime as c\n"
            f"{first}\nfor _ in range(500):\n    time.sleep(0.01)",
        )
    )
    assert runtime.final_update(60.0) is None
    assert runtime.state is CellState.RUNNING, "it gave way before the cell's 5 s ended"
    assert runtime.interrupt()
    while runtime.wait(5.0, 0.0).state is CellState.RUNNING:
        pass
    runtime.start_cell(CellRequest(2, "x = 1"))
    assert runtime.final_update(60.0).state is CellState.DONE, "a quiet cell is answered"


def test_output_from_other_threads_is_captured(runtime):
    update = _run(
        runtime,
        "import threading\nt = threading.Thread(target=lambda: print('from thread'))\nt.start(); t.join()",
    )
    assert "from thread" in "".join(text for _s, text in update.output)


def test_rank_api_outside_a_rank_says_where_to_call_it(monkeypatch):
    import rtnb
    from rtnb.worker import _reporting, _runtime

    monkeypatch.setattr(_runtime, "_CURRENT", None)
    monkeypatch.setattr(_reporting, "_CURRENT", None)
    with pytest.raises(rtnb.SessionError, match="%%rtrain"):
        rtnb.report({"x": 1})
    assert threading.current_thread() is threading.main_thread()


def test_the_relay_closes_a_missing_answer_at_the_shorter_of_two_waits():
    """Rank 0 gives way (a short wait) right after a cell that waited long: the
    listener's missing answer is closed at the short deadline, not the long one, and
    once disarmed nothing is closed any more (a real TCPStore, in this process)."""
    from datetime import timedelta

    import torch.distributed as dist

    from rtnb.worker._actor import _AnswerCloser

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
    closer = _AnswerCloser(
        dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    )
    closer.arm(["kept"], 120.0)
    closer.disarm()
    closer.arm(["long"], 120.0)
    while closer._idle:  # woken by that arm; it holds the lock until it sleeps again
        time.sleep(0.001)
    with closer._cond:
        pass  # now it sleeps until the long deadline
    closer.arm(["short"], 0.05)  # replaces it, and must not wait for it
    client.wait(["short"], timedelta(seconds=30))  # the old code waited 120 s here
    assert client.get("short") == b"-"
    closer.disarm()
    assert not client.check(["kept", "long"]), "a disarmed wait closes nothing"


def test_a_cell_run_again_from_a_checkpoint_fires_only_the_triggers_after_it(runtime):
    """A recovery re-runs a cell with its triggers: those at steps before the
    checkpoint it goes on from fired the first time; the later ones fire at their step."""

    class Resumed:
        id = "step-000000060"
        resume = (60, 0)

    code = (
        "import rtnb\n"
        "fired = []\n"
        "rtnb.on_trigger('early', lambda: fired.append(('early', step)))\n"
        "rtnb.on_trigger('late', lambda: fired.append(('late', step)))\n"
        "rtnb.get_checkpoint()\n"
        "for step in range(61, 81):\n"
        "    rtnb.report({'i': step})\n"
    )
    runtime.set_step(150)  # where the group's last step was when the rank died
    runtime.start_cell(
        CellRequest(1, code, checkpoint=Resumed(), triggers=((50, "early"), (70, "late")))
    )
    deadline = time.monotonic() + 10
    while runtime.wait(0.2, 0.0).state is CellState.RUNNING:
        assert time.monotonic() < deadline
    assert runtime.namespace["fired"] == [("late", 70)]


def test_an_answered_debugger_prompt_is_never_asked_again_before_pdb_reads_it():
    """The driver polls right after sending a line; pdb's thread may not have woken
    to read it yet (a busy machine). That poll must not show the answered prompt
    again: the notebook would open a second input box nobody answers, and hang."""
    from rtnb.worker._debug import DebugChannel

    cond = threading.Condition()
    channel = DebugChannel(1, cond, stopping=lambda: False)
    channel.open("cell [3] line 2")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(channel.readline()), daemon=True)
    reader.start()
    assert channel.poll(30.0).prompt == "(Pdb rank 1) "
    with cond:  # pdb's thread cannot take the line while this holds the lock
        channel.give("c")
        state = channel.poll(0.0)
    assert state.prompt is None and state.active
    reader.join(30.0)
    assert lines == ["c\n"]
