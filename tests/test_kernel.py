"""The magics in a real Jupyter kernel: what a notebook user types and sees."""

from __future__ import annotations

import re
import time

import pytest

from tests._kernel import one_line_error
from tests.conftest import CLUSTER_CPUS, wait_for_free_cpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_user_mistakes_before_start_give_one_clear_line(kernel):
    assert "%rtnb start" in one_line_error(kernel.execute("%%rtrain\nx = 1"))
    assert "subcommand" in one_line_error(kernel.execute("%rtnb"))
    assert "no subcommand 'launch'" in one_line_error(kernel.execute("%rtnb launch"))
    assert "unrecognized arguments: --bogus" in one_line_error(
        kernel.execute("%rtnb start --bogus 1")
    )
    assert "--strategy" in one_line_error(kernel.execute("%rtnb start --strategy DIAGONAL"))
    assert "need 200 CPUs" in one_line_error(kernel.execute("%rtnb start --workers 200"))


def _complete(kernel, code: str) -> list[str]:
    msg_id = kernel.kc.complete(code, len(code))
    while True:
        reply = kernel.kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]["matches"]


def test_help_completion_and_did_you_mean(kernel):
    subcommands = _complete(kernel, "%rtnb st")
    assert {"start", "status", "stop"} <= set(subcommands), subcommands
    assert not any("store" in m for m in subcommands), "IPython's own %store is not offered"
    assert "--max-failures" in _complete(kernel, "%rtnb start --max")
    assert "--background" in _complete(kernel, "%%rtrain --back")
    assert "--timeout" in _complete(kernel, "%rtrain --time")
    shown = kernel.execute("%rtnb start --help")
    assert shown.status == "ok" and "--max-failures" in shown.stdout and "Example:" in shown.stdout
    assert "usage: %rtnb start" in shown.stdout
    assert "did you mean `%rtnb status`" in one_line_error(kernel.execute("%rtnb statsu"))


def test_start_run_pull_push_status_in_a_notebook(kernel):
    run = kernel.execute("%rtnb start --workers 2 --stop-grace 1")
    assert run.status == "ok", run.text + "\n".join(run.traceback)
    shown = str(run.results)
    assert "ready" in shown and "gloo" in shown and "rank" in shown
    # What the start did, as it went, then what each phase cost.
    lines = [update.get("text/plain", "") for update in run.updates]
    assert any("joining Ray at" in line for line in lines), lines
    assert any("placing 2 ranks" in line for line in lines), lines
    assert any("joining the gloo process group" in line for line in lines), lines
    assert re.search(r"ready in [\d.]+ s \(Ray [\d.]+ s · placement .* process group", lines[-1])
    assert "INFO" not in run.text and "auth" not in run.text.lower(), (
        f"Ray noise in the cell: {run.text}"
    )
    assert "already running" in one_line_error(kernel.execute("%rtnb start"))

    run = kernel.execute(
        "%%rtrain\nimport torch, torch.distributed as dist\nt = torch.ones(2) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\nprint('sum', t.tolist())\ndist.get_rank() * 100"
    )
    assert run.status == "ok", run.text
    assert "[rank 0] sum [3.0, 3.0]" in run.stdout and "[rank 1] sum [3.0, 3.0]" in run.stdout
    assert "[rank 0] 0\n[rank 1] 100" in run.results[-1]["text/plain"]

    assert kernel.execute("%rtrain t = t * 2").status == "ok"
    pulled = kernel.execute("%rtnb pull t")
    assert "tensor([6., 6.])" in pulled.results[-1]["text/plain"]
    assert kernel.execute("factor = 7\n%rtnb push factor").status == "ok"
    assert "[rank 1] 7" in kernel.execute("%rtrain --ranks 1 factor").results[-1]["text/plain"]
    assert "ranks 0-1" in one_line_error(kernel.execute("%rtrain --ranks 3 factor"))
    assert "list like" in one_line_error(kernel.execute("%rtrain --ranks x factor"))

    status = kernel.execute("%rtnb status")
    assert "ready" in status.results[-1]["text/plain"]


def test_remote_error_and_syntax_error_show_rank_and_user_code(kernel):
    run = kernel.execute(
        "%%rtrain\nimport torch.distributed as dist\nif dist.get_rank() == 0:\n    {}['missing']"
    )
    shown = "\n".join(run.traceback)
    assert run.status == "error" and run.ename == "CellError"
    assert "rank 0" in shown and "KeyError: 'missing'" in shown and "{}['missing']" in shown
    assert "/rtnb/" not in shown and "ray/_private" not in shown
    # As IPython shows its own: the cell, the line as the editor numbers it (the
    # magic's own line is 1), the lines above it, then the error.
    label = re.search(r"Cell (In\[\d+\]), line 4\n", shown)
    assert label and "----> 4     {}['missing']" in shown and "      3 if dist" in shown, shown
    assert shown.index("----> 4") < shown.index("cell failed on rank 0"), shown
    # A rank that raised while the others wait for it in a collective: they cannot
    # stop, the group is rebuilt, and the rank's traceback still leads the error.
    run = kernel.execute(
        "%%rtrain\nimport torch, torch.distributed as dist\nif dist.get_rank() == 1:\n"
        "    raise RuntimeError('boom')\ndist.all_reduce(torch.ones(1))",
        timeout=120,
    )
    shown = "\n".join(run.traceback)
    assert run.ename == "CellError" and "----> 4     raise RuntimeError('boom')" in shown, shown
    assert shown.index("RuntimeError: boom") < shown.index("rebuilt with fresh ranks"), shown
    assert "/rtnb/" not in shown and "ray/_private" not in shown
    run = kernel.execute("%%rtrain\ndef broken(:\n    pass")
    assert run.status == "error" and "SyntaxError" in "\n".join(run.traceback)
    assert "not sent" in "\n".join(run.traceback)
    assert kernel.execute("%rtrain 1 + 1").results[-1]["text/plain"] == "[rank 0] 2\n[rank 1] 2"


def test_background_cell_runs_while_other_cells_work(kernel):
    run = kernel.execute(
        "%%rtrain --background\nimport time, rtnb\nfor i in range(40):\n    rtnb.report({'i': i})\n    time.sleep(0.05)\n'done'"
    )
    assert run.status == "ok" and run.elapsed_s < 5
    assert any("application/vnd.jupyter.widget-view+json" in r for r in run.results), (
        "no live widget shown"
    )
    waited = None
    try:
        assert kernel.execute("x_in_notebook = 1 + 1").status == "ok"
        status = kernel.execute("%rtnb status").results[-1]["text/plain"]
        assert "running" in status and "background" in status
        # Both ranks in the loop (each reported): a busy machine starts the cell late.
        entered = kernel.execute(
            "import time\n"
            "deadline = time.monotonic() + 120\n"
            "session = get_ipython().magics_manager.registry['RtnbMagics'].session\n"
            "while min(r.step for r in session.status().ranks) < 1:\n"
            "    assert time.monotonic() < deadline, 'no rank reported in 120 s'\n"
            "    time.sleep(0.05)"
        )
        assert entered.status == "ok", entered.evalue
        # The running loop's own variable, read while it runs: one value per rank.
        pull = kernel.execute("%rtnb pull i")
        assert pull.status == "ok", pull.evalue
        pulled = pull.results[-1]["text/plain"]
        values = eval(pulled)
        assert isinstance(values, list) and len(values) == 2, pulled
        assert all(isinstance(v, int) and 0 <= v < 40 for v in values), pulled
        waited = kernel.execute("%rtnb wait --timeout 120")
        assert waited.results[-1]["text/plain"] == "[rank 0] 'done'\n[rank 1] 'done'"
    finally:
        if waited is None:  # the module's next tests share this kernel: leave it free
            kernel.execute("%rtnb wait --timeout 120")


PLOTLY = "application/vnd.plotly.v1+json"


def test_a_background_cell_ending_between_cells_leaves_its_figure_in_the_next(kernel, tmp_path):
    """A background cell that ends while no cell runs sends its lasting figure with the
    finished cell's parent, which nbclient (papermill, `rtnb run`) drops, so the saved
    notebook kept the widget: the same update comes again as the next cell starts."""
    go = tmp_path / "go"
    # The live view, as JupyterLab gets it (this client is no widget frontend).
    assert kernel.execute("import os\nos.environ['RTNB_LIVE'] = '1'").status == "ok"
    back_to_detection = "os.environ.pop('RTNB_LIVE', None)"
    following = None
    try:
        run = kernel.execute(
            "%%rtrain --background\nimport os, time, rtnb\n"
            f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.02)\n"
            "for i in range(3):\n    rtnb.report({'loss': 1.0 / (i + 1)})"
        )
        assert run.status == "ok", run.text
        go.touch()  # the kernel is idle: the cell ends between cells
        deadline = time.monotonic() + 120
        while True:
            msg = kernel.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["msg_type"] == "update_display_data" and PLOTLY in msg["content"]["data"]:
                break
        following = kernel.execute(back_to_detection)  # the next cell
    finally:
        if following is None:
            kernel.execute(back_to_detection)
    assert following.status == "ok", following.text
    again = [u for u in following.updates if PLOTLY in u]
    assert again and again[-1] == msg["content"]["data"], (
        "the lasting figure did not come again under the next cell"
    )
    assert not [u for u in kernel.execute("x_after = 1").updates if PLOTLY in u], (
        "sent again a second time"
    )


def test_interrupt_stops_a_reporting_loop_at_the_same_step_on_every_rank(kernel):
    code = (
        "%%rtrain\nimport time, torch, rtnb, torch.distributed as dist\nstep = 0\n"
        "while True:\n    step += 1\n    t = torch.ones(1)\n    dist.all_reduce(t)\n"
        "    rtnb.report({'step_value': step})\n    time.sleep(0.01 * (dist.get_rank() + 1))"
    )
    run = kernel.execute(code, interrupt_after=3.0, timeout=60)
    assert run.ename == "CellInterrupted", run.traceback
    shown = "\n".join(run.traceback)
    assert "every rank stopped at step" in shown and "intact" in shown
    steps = kernel.execute("%rtnb pull step").results[-1]["text/plain"]
    first, second = eval(steps)  # noqa: S307 - our own list of ints
    assert first == second > 10
    # The group is usable: a collective works right after.
    assert (
        "[rank 0] 2.0"
        in kernel.execute("%rtrain t = torch.ones(1); dist.all_reduce(t); t.item()").results[-1][
            "text/plain"
        ]
    )


def test_interrupt_stops_a_pure_python_loop_and_keeps_the_namespace(kernel):
    kernel.execute("%rtrain kept_before = 'yes'")
    run = kernel.execute(
        "%%rtrain\nn = 0\nwhile True:\n    n += 1", interrupt_after=2.0, timeout=60
    )
    assert run.ename == "CellInterrupted"
    assert "inside the cell code" in "\n".join(run.traceback)
    assert run.elapsed_s < 2.0 + 10
    assert "'yes'" in kernel.execute("%rtnb pull kept_before").results[-1]["text/plain"]


def test_interrupt_of_a_rank_stuck_in_a_collective_rebuilds_the_group(kernel):
    pids_before = kernel.execute("%rtrain import os; os.getpid()").results[-1]["text/plain"]
    run = kernel.execute(
        "%%rtrain\nimport torch.distributed as dist, time\nif dist.get_rank() == 0:\n    dist.barrier()\nelse:\n    time.sleep(0.1)",
        interrupt_after=2.0,
        timeout=90,
    )
    shown = "\n".join(run.traceback)
    assert (
        run.ename == "CellInterrupted" and "rank 0 did not stop" in shown and "rebuilt" in shown
    ), shown
    assert run.elapsed_s < 2.0 + 30
    after = kernel.execute(
        "%rtrain import os, torch, torch.distributed as dist; t = torch.ones(1); dist.all_reduce(t); (os.getpid(), t.item())"
    )
    assert after.status == "ok", after.traceback
    assert after.results[-1]["text/plain"] != pids_before
    assert "2.0" in after.results[-1]["text/plain"]


def test_stop_frees_the_cpus(kernel):
    assert kernel.execute("%rtnb stop").status == "ok"
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS
    assert "%rtnb start" in one_line_error(kernel.execute("%rtnb status"))
