"""Ranks that do not shout: on a Ray the user started (their own ``ray.init()``,
which streams every worker's output into the kernel, or ``--address``), a
recovery and a stop print nothing the user's cell did not print, besides rtnb's
one-line messages. What the user's code writes at the file-descriptor level
still reaches them."""

from __future__ import annotations

import os

import pytest

from tests._kernel import Kernel
from tests.conftest import CLUSTER_CPUS, wait_for_free_cpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Rank 0 dies once (its store goes with it: the survivor's store client used to
# log a warning and ~20 native stack frames; the raylet reports the dead worker).
DIES_ONCE = (
    "%%rtrain\n"
    "import os, signal, time, rtnb\n"
    "rank = rtnb.get_context().world_rank\n"
    "if rank == 1:\n"
    "    os.write(2, b'native line from the user\\n')\n"
    "print('before', rank)\n"
    "if rank == 0 and not os.path.exists(MARKER):\n"
    "    open(MARKER, 'w').close()\n"
    "    time.sleep(0.5)\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "time.sleep(1.0)\n"
    "print('after', rank)"
)


def _foreign(text: str) -> list[str]:
    """Lines neither the user's cells nor rtnb's one-line messages printed."""
    ours = ("[rank 0] ", "[rank 1] ", "[rtnb] ", "rtnb: ", "rtnb run ")
    return [
        line
        for line in text.splitlines()
        if line.strip() and not line.startswith(ours) and "native line from the user" not in line
    ]


@pytest.mark.parametrize("joined", ["users_ray_init", "address"])
def test_a_recovery_and_a_stop_print_only_what_the_user_printed(ray_cluster, tmp_path, joined):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if joined == "address":
        env.pop("RAY_AUTH_MODE", None)  # rtnb finds the cluster's token by itself
    else:
        env["RAY_AUTH_MODE"] = "token"  # the user's own ray.init needs it, as on their cluster
    kernel = Kernel(cwd=str(tmp_path), env=env)
    texts: list[str] = []
    try:
        if joined == "users_ray_init":
            setup = kernel.execute(
                f"import ray\nray.init(address={ray_cluster.address!r})", timeout=120
            )
            assert setup.status == "ok", setup.text + "\n".join(setup.traceback)
            start = "%rtnb start --cpus-per-worker 0.5 --max-failures 1"
        else:
            start = f"%rtnb start --cpus-per-worker 0.5 --max-failures 1 --address {ray_cluster.address}"
        for code in (
            f"%load_ext rtnb\n{start} --storage {tmp_path}/runs --name quiet",
            f"%rtrain MARKER = {str(tmp_path / 'died')!r}",
            DIES_ONCE,
            "%%rtrain --background\nimport time\nfor i in range(100):\n    time.sleep(0.1)",
            "import time; time.sleep(0.5)",
            "%rtnb stop",
            # Ray streams worker output asynchronously: give late lines time to land.
            "import time; time.sleep(4)",
        ):
            run = kernel.execute(code, timeout=240)
            assert run.status == "ok", f"{code!r}: {run.text}\n" + "\n".join(run.traceback)
            texts.append(run.text)
    finally:
        kernel.shutdown()
    text = "\n".join(texts)
    assert "rank 0 died during cell" in text and "worker group rebuilt" in text
    assert "[rank 1] after 1" in text
    assert _foreign(text) == [], f"lines the user did not print: {_foreign(text)}"
    if joined == "users_ray_init":
        # Their own log_to_driver Ray still brings what their code wrote natively.
        assert "native line from the user" in text
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS


def test_the_filter_drops_store_traces_and_dead_rank_reports_only(monkeypatch):
    from rtnb.driver.cluster import _ray_output

    # The ranks earlier tests in this process watched stay watched (as they would in
    # a kernel); pids wrap at 32768, so one of them may have been 777.
    monkeypatch.setattr(_ray_output, "_rank_pids", set())
    monkeypatch.setattr(_ray_output, "_in_trace", {})
    _ray_output.watch_ranks([4242])
    warning = (
        "[W1124 23:54:19.489550834 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on "
        "SocketImpl(fd=46): Failed to recv, got 0 bytes. Connection was likely closed."
    )
    trace = [
        "Exception raised from recvBytes at torch/csrc/distributed/c10d/Utils.hpp:787 (most recent call first):",
        "frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7fa890579b8d in libc10.so)",
    ]
    rest_of_trace = ["<omitting python frames>", "frame #22: <unknown function> + 0x891f5", ""]
    shown = []
    emit = _ray_output._filtered(lambda data: shown.append((data["pid"], data["lines"])))
    emit({"pid": 4242, "lines": ["mine before", warning, *trace]})
    # The trace runs on into the next batch; a line of the user's own ends it.
    emit({"pid": "4242", "lines": [*rest_of_trace, "mine after"]})
    emit({"pid": 777, "lines": [warning]})  # not a rank of rtnb's: untouched
    dead = "A worker died or was killed while executing a task ... Worker PID: {} Worker exit type"
    emit({"pid": "raylet", "lines": [dead.format(4242), dead.format(777)]})
    emit({"pid": 4242, "lines": ["[rank1]:[W1124 socket.cpp:494] [c10d] waitForInput: timed out"]})
    assert shown == [
        (4242, ["mine before"]),
        ("4242", ["mine after"]),
        (777, [warning]),
        ("raylet", [dead.format(777)]),
    ]
