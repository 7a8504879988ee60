"""Groups of 4 ranks and more start cells through rank 0: on the open channel it fans a
cell out over its own connections to the others, without one (a Ray Client) it
relays it through the group's store with one Ray call. Either way nothing is lost or
run twice, and a dead rank (rank 0 too) is found and recovered as without it."""

from __future__ import annotations

import os
import signal

import pytest

import rtnb
from rtnb.core._channel import CHANNEL_ENV
from rtnb.driver.ranks import _group
from rtnb.driver.ranks._execution import Execution
from rtnb.worker._actor import RELAY_FROM_RANKS
from tests.conftest import CLUSTER_CPUS, wait_for_free_cpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RANK = "import torch.distributed as dist\nrank = dist.get_rank()\n"


@pytest.mark.parametrize("path", ["channel", "store"])
def test_relayed_cells_lose_nothing_run_once_and_find_dead_ranks(
    ray_cluster, tmp_path, monkeypatch, path
):
    world = 8
    everyone = range(world)
    if path == "store":
        # The store's relay is the path when the kernel cannot open its channel to
        # the ranks (a Ray Client): this group is made to take it.
        monkeypatch.setenv(CHANNEL_ENV, "0")
    else:
        # Fanning out starts at more ranks than this machine holds in a test: this
        # group takes it at its size.
        monkeypatch.setattr(_group, "FANOUT_FROM_RANKS", world)
    with rtnb.Session(
        workers=world, cpus_per_worker=0.2, storage=str(tmp_path), max_failures=2, stop_grace_s=1.0
    ) as session:
        assert world >= RELAY_FROM_RANKS
        assert session.group.relays, "this size goes through rank 0"
        calls = "channel" if path == "channel" else "Ray"
        assert [r.calls for r in session.status().ranks] == [calls] * world
        assert session.run(RANK + "rank") == {r: r for r in everyone}
        lines: list[tuple[int, str]] = []
        session.run(
            RANK + "print('line from', rank)",
            output=lambda rank, stream, text: lines.append((rank, text)),
        )
        said = [r for r, text in lines for _ in range(text.count("line from"))]
        assert sorted(said) == list(everyone), "every rank's output, exactly once"
        # A counter shows a relayed cell never runs twice on a rank.
        session.run("runs = 0")
        for i in range(10):
            assert session.run(f"runs += 1\n{i}") == {r: i for r in everyone}
        assert session.run("runs") == {r: 10 for r in everyone}
        assert session.run("5", ranks=[1, 6]) == {1: 5, 6: 5}
        # A cell on one rank goes through the relay too, and a token taken by a relay
        # call that never wrote its cell is skipped: the ranks keep listening, and
        # later cells are answered through the relay again (without this, every later
        # cell waited out rank 0's gather and asked each rank directly).
        asked_directly: list[int] = []
        direct = Execution._run_on

        def spied(execution, rank):
            asked_directly.append(rank)
            return direct(execution, rank)

        monkeypatch.setattr(Execution, "_run_on", spied)
        assert session.run("runs += 1\n6", ranks=[2]) == {2: 6}
        assert session.run("runs", ranks=[1, 2]) == {1: 10, 2: 11}, "only rank 2 ran it"
        session.group.next_token()
        relayed_cells = 0
        for i in range(3):
            asked_directly.clear()
            assert session.run(f"{i}") == {r: i for r in everyone}
            # (a rank may miss its first wait on a loaded machine: then it is asked)
            relayed_cells += not asked_directly
        assert relayed_cells >= 1, "the listeners never caught up with the relay"
        # Only rank 0 prints: the others' answers still come back through the relay.
        only_zero_asked = 0
        for _ in range(3):
            asked_directly.clear()
            session.run(RANK + "if rank == 0:\n    print('from rank 0 only')")
            only_zero_asked += asked_directly == [0]
        assert only_zero_asked >= 1, "a cell printing on rank 0 asked every rank directly"
        # Every cell of a rank runs in one thread, relayed or asked directly, so
        # thread-local state (torch's grad mode here) holds from cell to cell.
        session.run("import torch\ntorch.set_grad_enabled(False)")
        session.run("import time\ntime.sleep(0.5)")  # answers come directly (a long cell)
        assert session.run("torch.is_grad_enabled()", ranks=[4]) == {4: False}
        assert session.run("torch.is_grad_enabled()") == {r: False for r in everyone}
        session.run("torch.set_grad_enabled(True)")
        monkeypatch.setattr(Execution, "_run_on", direct)
        with pytest.raises(rtnb.CellError, match="bad three"):
            session.run(RANK + "if rank == 3:\n    raise ValueError('bad three')")
        handle = session.run_background("import time\ntime.sleep(1.0)\n7")
        assert handle.wait(120) == {r: 7 for r in everyone}
        reported = session.run("import rtnb\nfor s in range(50):\n    rtnb.report({'x': s})\ns")
        assert reported == {r: 49 for r in everyone}
        assert all(session.metrics.count(r) == 50 for r in everyone)

        # Rank 0, the relay itself, dies between cells: the next cell finds it (the
        # relay call fails, each rank is asked directly) and recovers.
        os.kill(session.status().ranks[0].pid, signal.SIGKILL)
        assert session.run(RANK + "rank * 2") == {r: 2 * r for r in everyone}
        assert session.group.relays, "the rebuilt group relays too"
        assert [r.calls for r in session.status().ranks] == [calls] * world
        # A rank other than 0 dies: rank 0 stops waiting for its answer, the driver
        # asks it directly, finds it dead and recovers.
        os.kill(session.status().ranks[5].pid, signal.SIGKILL)
        assert session.run("1") == {r: 1 for r in everyone}
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS
