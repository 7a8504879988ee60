"""The open channel: each rank's cell starts and long-polls cross one connection the
kernel keeps open, with Ray's calls as the path it falls back to on its own.

Without Ray: the channel's two ends over real sockets (a wrong key, a call let go).
Without Ray too: a cell fanned out through rank 0 (its answers in one frame, a slow
rank's late answer dropped, a peer gone answered as "ask it directly"). On Ray: a
rank killed mid-cell is recovered onto a rebuilt group with its own
channel, a cut link goes on through Ray without running the cell twice, and a scaled
group opens its channel to every rank. (A detached group's host opens its channel
too: ``test_detached.py`` checks it after a rank was killed and another kernel
attached.)"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

import rtnb
from rtnb.core._channel import CHANNEL_ENV, ChannelClosed, recv_frame, verify_peer
from rtnb.core._messages import CellState, RankUpdate, from_wire, to_wire
from rtnb.driver.ranks._channel import OpenChannel
from rtnb.worker._channel import ChannelServer
from tests.conftest import CLUSTER_CPUS, wait_for_free_cpus

KEY = b"k" * 32


def _update(step: int, state: CellState = CellState.DONE) -> bytes:
    return to_wire(RankUpdate(rank=0, cell=1, state=state, step=step))


def _serving(
    run, poll, start=None, rank: int = 0
) -> tuple[ChannelServer, dict[int, tuple[str, int]]]:
    server = ChannelServer(run, poll, start or (lambda request, wait_s: None), KEY, rank)
    return server, {rank: ("127.0.0.1", server.open("127.0.0.1"))}


def test_a_connection_without_the_key_is_refused_and_the_rank_still_serves_its_kernel():
    ran: list[int] = []

    def run(request: bytes) -> bytes:
        ran.append(from_wire(request))
        return _update(7)

    server, address = _serving(run, lambda wait_s, batch_s: _update(0))
    try:
        intruder = OpenChannel.connect(address, b"x" * 32)
        assert intruder.ranks == [], "a wrong key opened the channel"
        intruder.close()
        channel = OpenChannel.connect(address, KEY)
        assert channel.ranks == [0]
        call = channel.run(0, to_wire(RankUpdate(rank=0, cell=3, state=CellState.RUNNING, step=1)))
        assert channel.take_ready([call], 10.0) == [call]
        assert call.answer.step == 7
        assert len(ran) == 1 and ran[0].cell == 3, "only the kernel with the key ran a call"
        channel.close()
    finally:
        server.close()


def test_a_call_let_go_has_its_late_answer_dropped_not_taken_for_the_next():
    steps = iter(range(1, 100))
    gate = threading.Event()

    def poll(wait_s: float, batch_s: float) -> bytes:
        gate.wait(wait_s)  # the first poll holds until the gate opens
        return _update(next(steps), CellState.RUNNING)

    server, address = _serving(lambda request: _update(0), poll)
    channel = OpenChannel.connect(address, KEY)
    try:
        first = channel.poll(0, 30.0, 0.1)
        assert channel.take_ready([first], 0.05) == [], "the poll is held"
        # A Ctrl-C landed here: the kernel let the first poll go and polls again.
        second = channel.poll(0, 30.0, 0.1)
        gate.set()
        assert channel.take_ready([second], 10.0) == [second]
        assert second.answer.step == 2, "the first poll's answer was taken for the second"
        assert not first.done
        # The connection goes on answering in order.
        third = channel.poll(0, 0.0, 0.0)
        assert channel.take_ready([third], 10.0) == [third] and third.answer.step == 3
    finally:
        channel.close()
        server.close()


def test_a_rank_whose_process_ends_breaks_its_call_at_once():
    listener = socket.create_server(("127.0.0.1", 0))

    def rank_that_dies() -> None:
        conn, _ = listener.accept()
        verify_peer(conn, KEY)
        recv_frame(conn)  # the kernel's poll arrives, and the process is gone
        conn.close()

    dying = threading.Thread(target=rank_that_dies, daemon=True)
    dying.start()
    channel = OpenChannel.connect({0: ("127.0.0.1", listener.getsockname()[1])}, KEY)
    try:
        assert channel.ranks == [0]
        call = channel.poll(0, 30.0, 0.1)
        started = time.monotonic()
        assert channel.take_ready([call], 30.0) == []
        assert call.broken and time.monotonic() - started < 10.0
        assert not channel.has(0), "a broken connection is not used again"
    finally:
        channel.close()
        listener.close()
        dying.join(10)


# ---- on Ray ------------------------------------------------------------------------------

GATED_LOOP = (
    "import os, time, rtnb\n"
    "for s in range(40):\n"
    "    rtnb.report({'s': s}, step=s)\n"
    "    while s == 20 and not os.path.exists(GATE):\n"
    "        time.sleep(0.02)\n"
    "runs += 1\n"
    "s"
)


def _calls(session) -> list[str]:
    return [r.calls for r in session.status().ranks]


def _until(what: str, check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_rank_a_cut_link_and_a_scale_each_keep_cells_running_once(ray_cluster, tmp_path):
    gate = tmp_path / "gate"
    with rtnb.Session(
        workers=2,
        cpus_per_worker=0.5,
        storage=str(tmp_path / "runs"),
        max_failures=1,
        stop_grace_s=1.0,
    ) as session:
        assert _calls(session) == ["channel", "channel"]
        assert "channel" in str(session.status())
        session.run(f"runs = 0\nGATE = {str(gate)!r}")

        # A link cut mid-cell: rank 0's connection ends while its cell waits at the
        # gate. Its calls go on through Ray; the cell ends once on every rank.
        handle = session.run_background(GATED_LOOP)
        _until("both ranks at the gate", lambda: min(handle.steps.get(r, -1) for r in (0, 1)) >= 20)
        session.group._channel._socks[0].shutdown(socket.SHUT_RDWR)
        gate.touch()
        assert handle.wait(120) == {0: 39, 1: 39}
        assert session.run("runs") == {0: 1, 1: 1}, "the cell ran twice on the cut rank"
        assert _calls(session) == ["Ray", "channel"]
        assert session.failures == 0, "a cut link alone is not a lost rank"

        # A rank killed mid-cell: found at once (its connection ends), the group is
        # rebuilt with a channel to every rank, and the cell is run again there.
        gate.unlink()
        handle = session.run_background(GATED_LOOP)
        _until("the ranks at the gate", lambda: handle.steps.get(1, -1) >= 20)
        os.kill(session.status().ranks[1].pid, signal.SIGKILL)
        _until("the rebuilt group", lambda: session.failures == 1)
        gate.touch()
        assert handle.wait(180) == {0: 39, 1: 39}
        assert _calls(session) == ["channel", "channel"]

        # A scale: the new group opens its channel to each of its ranks.
        session.scale(3)
        assert _calls(session) == ["channel"] * 3
        assert session.run("import torch.distributed as dist\ndist.get_world_size()") == {
            r: 3 for r in range(3)
        }
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS


@pytest.mark.ray
@pytest.mark.slow
def test_with_the_channel_off_cells_go_through_rays_calls_on_ranks_that_ask_no_cpu(
    ray_cluster, tmp_path, monkeypatch
):
    monkeypatch.setenv(CHANNEL_ENV, "0")
    with rtnb.Session(workers=2, cpus_per_worker=0, storage=str(tmp_path)) as session:
        assert _calls(session) == ["Ray", "Ray"]
        lines: list[str] = []
        value = session.run(
            "import rtnb\nfor s in range(30):\n    rtnb.report({'s': s})\nprint('done')\ns",
            output=lambda rank, stream, text: lines.append(text),
        )
        assert value == {0: 29, 1: 29}
        assert "".join(lines).count("done") == 2
        assert session.metrics.count(0) == 30 and session.metrics.count(1) == 30


def test_a_channel_closed_under_a_waiting_call_answers_it_as_gone():
    gate = threading.Event()
    server, address = _serving(
        lambda request: _update(0), lambda wait_s, batch_s: gate.wait(wait_s) and _update(1)
    )
    channel = OpenChannel.connect(address, KEY)
    try:
        call = channel.poll(0, 30.0, 0.1)
        taken: list = []
        waiter = threading.Thread(target=lambda: taken.extend(channel.take_ready([call], 30.0)))
        waiter.start()
        time.sleep(0.1)  # the waiter is in its select
        channel.close()  # the group is shut down meanwhile (a stop)
        waiter.join(10)
        assert not waiter.is_alive(), "a wait on a closed channel did not end"
        assert taken == [call] and isinstance(call.answer, ChannelClosed)
        later = channel.poll(0, 1.0, 0.1)
        assert channel.take_ready([later], 1.0) == [later], "a call after the close waits"
    finally:
        gate.set()
        server.close()


def test_a_cell_fanned_out_through_rank_0_answers_for_every_rank_in_one_frame():
    """Rank 0 starts the cell on the others over its own connections: the quick ranks'
    final updates come back with its own; a rank still busy past the wait, or one
    whose connection is gone, is answered as None (the kernel asks it directly), and
    a late answer is never taken for the next cell's."""
    slow = threading.Event()  # rank 2 answers the first cell only once this is set
    started: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def starter(rank: int):
        def start(request: bytes, wait_s: float) -> bytes | None:
            cell = from_wire(request).cell
            started[rank].append(cell)
            if rank == 2 and cell == 1:
                slow.wait(10)
                return to_wire(RankUpdate(rank=2, cell=1, state=CellState.DONE, step=-1))
            return to_wire(RankUpdate(rank=rank, cell=cell, state=CellState.DONE, step=cell))

        return start

    servers, addresses = [], {}
    for rank in range(3):
        server, address = _serving(lambda r: b"", lambda w, b: b"", starter(rank), rank)
        servers.append(server)
        addresses.update(address)
    try:
        assert servers[0].reach_peers({1: addresses[1], 2: addresses[2]}, 5.0) == [1, 2]
        channel = OpenChannel.connect(addresses, KEY)

        def fan(cell: int, ranks: list[int]) -> dict:
            request = to_wire(RankUpdate(rank=0, cell=cell, state=CellState.RUNNING, step=0))
            call = channel.fan_out(request, ranks, 0.3)
            assert channel.take_ready([call], 10.0) == [call]
            return call.answer

        first = fan(1, [0, 1, 2])
        assert {r: u and u.step for r, u in first.items()} == {0: 1, 1: 1, 2: None}
        slow.set()  # rank 2's late answer to cell 1 arrives while cell 2 fans out
        second = fan(2, [0, 1, 2])
        assert {r: u.step for r, u in second.items()} == {0: 2, 1: 2, 2: 2}
        assert fan(3, [1]) == {1: RankUpdate(rank=1, cell=3, state=CellState.DONE, step=3)}
        assert started == {0: [1, 2], 1: [1, 2, 3], 2: [1, 2]}, "each rank started each cell once"
        servers[1].close()  # rank 1's process is gone: its connection from rank 0 ends
        servers[0]._fanout._socks[1].shutdown(socket.SHUT_RDWR)
        fourth = fan(4, [0, 1, 2])
        assert fourth[1] is None and fourth[0].step == 4 and fourth[2].step == 4
        channel.close()
    finally:
        slow.set()
        for server in servers:
            server.close()


def test_an_update_that_crossed_the_wire_is_the_rank_s_and_its_empty_fields_cannot_be_changed():
    """The kernel's copy of a rank's answer equals what the rank sent, field by
    field, whether it crossed once or was passed on by rank 0's fan-out; the empty
    fields it shares with every other answer refuse a change instead of taking it
    into every update at once."""
    sent = RankUpdate(
        rank=3,
        cell=7,
        state=CellState.DONE,
        step=12,
        output=[("stdout", "hi\n")],
        controls_applied=[("lr", 0.1, 4)],
    )
    once = from_wire(to_wire(sent))
    passed_on = from_wire(to_wire({3: once}))[3]
    plain = from_wire(to_wire(RankUpdate(rank=1, cell=7, state=CellState.DONE, step=0)))
    for got in (once, passed_on):
        assert got == sent and got.output == [("stdout", "hi\n")] and got.checkpoints == []
        assert got.controls_applied == [("lr", 0.1, 4)] and got.controls_declared == {}
    assert len(to_wire(plain)) == len(
        to_wire(RankUpdate(rank=1, cell=7, state=CellState.DONE, step=0))
    )
    for change in (
        lambda: plain.output.append(("stdout", "x")),
        lambda: plain.checkpoints.extend([1]),
        lambda: plain.data_waits.update(data=1.0),
        lambda: plain.controls_declared.__setitem__("lr", 0.1),
    ):
        with pytest.raises(TypeError, match="read-only"):
            change()
    other = from_wire(to_wire(RankUpdate(rank=2, cell=7, state=CellState.DONE, step=0)))
    assert other.output == [] and other.data_waits == {} and other.controls_declared == {}
