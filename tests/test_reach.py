"""Without Ray: how a machine outside a cluster judges whether it is a node, how a
group judges that a machine stopped answering, and which interface a rank's
collectives bind."""

from __future__ import annotations

import os
import socket
import time

import psutil
import pytest

from rtnb.driver.cluster._outside import ClusterView, NodeSeen, token_refused_line
from rtnb.driver.ranks import _reach
from rtnb.driver.ranks._reach import Machine, MachineWatch
from rtnb.worker._actor import _interface_of, bind_collectives_to


def _view(nodes: list[NodeSeen], local: set[str], here: str = "10.9.9.9") -> ClusterView:
    return ClusterView(nodes=tuple(nodes), this_machine=here, local_raylets=frozenset(local))


def test_a_machine_is_a_node_only_where_a_raylet_of_the_cluster_runs_at_its_address():
    head = NodeSeen("aa", "10.9.9.1", True)
    here = NodeSeen("bb", "10.9.9.9", False)
    # No raylet of this cluster on this machine (another Ray's, say the warm one's).
    assert _view([head, here], {"cc"}).node_here() is None
    assert _view([head, here], {"bb"}).node_here() == here
    # A raylet this machine can see whose node is another machine's (a shared PID
    # namespace): Ray's driver would abort the process on its socket.
    assert _view([head], {"aa"}).node_here() is None
    # A cluster on loopback (one machine): its nodes are this machine's.
    assert _view([NodeSeen("dd", "127.0.0.1", True)], {"dd"}).node_here() is not None


def test_the_token_refusal_names_the_machine_and_both_settings():
    line = token_refused_line("10.9.9.1:6379")
    assert socket.gethostname() in line and "RAY_AUTH_TOKEN " in line
    assert "RAY_AUTH_TOKEN_PATH" in line and "\n" not in line


def test_a_machine_that_stops_answering_is_cut_off_and_one_never_reached_is_not_judged(
    monkeypatch,
):
    monkeypatch.setattr(_reach, "CUT_OFF_S", 1.5)
    # A closed port on loopback refuses at once, where a cut-off machine is silent:
    # the refusal rule is set out of reach, so the silence rule is what is judged.
    monkeypatch.setattr(_reach, "REFUSED_S", 60.0)
    monkeypatch.setattr(_reach, "_KNOCK_EVERY_S", 0.1)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        never = unused.getsockname()[1]  # nothing listens there
    answering = Machine("w1", "127.0.0.1", port, (1, 3))
    watch = MachineWatch([answering, Machine("w2", "127.0.0.1", never, (2,))])
    try:
        deadline = time.monotonic() + 10
        while answering not in watch._answered and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.cut_off() == {}
        listener.close()  # the machine goes
        while not watch.cut_off() and time.monotonic() < deadline:
            time.sleep(0.05)
        lost = watch.cut_off()
        assert sorted(lost) == [1, 3], lost  # w2 never answered: Ray's to judge
        assert lost[1].startswith("on w1 (127.0.0.1): that machine accepted no connection")
    finally:
        watch.close()
        listener.close()


def test_a_node_whose_raylet_ended_is_lost_once_its_port_refuses_though_the_machine_answers(
    monkeypatch,
):
    # Its ranks may linger and still answer on the open channel: the refusal tells.
    monkeypatch.setattr(_reach, "CUT_OFF_S", 60.0)
    monkeypatch.setattr(_reach, "REFUSED_S", 0.5)
    monkeypatch.setattr(_reach, "_KNOCK_EVERY_S", 0.1)
    listener = socket.create_server(("127.0.0.1", 0))
    node = Machine("w1", "127.0.0.1", listener.getsockname()[1], (1,))
    watch = MachineWatch([node])
    try:
        deadline = time.monotonic() + 10
        while node not in watch._answered and time.monotonic() < deadline:
            time.sleep(0.05)
        listener.close()  # the raylet ends; the machine still answers (refuses)
        while not watch.cut_off() and time.monotonic() < deadline:
            time.sleep(0.05)
        lost = watch.cut_off()
        assert list(lost) == [1] and "refused every connection" in lost[1], lost
        assert lost[1].startswith("on w1 (127.0.0.1): its Ray node's port"), lost
    finally:
        watch.close()
        listener.close()


def test_collectives_bind_the_interface_that_holds_the_nodes_address(monkeypatch):
    assert _interface_of("127.0.0.1") == "lo"
    addresses = {
        a.address: name
        for name, found in psutil.net_if_addrs().items()
        for a in found
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    }
    if not addresses:
        pytest.skip("this machine has no address but loopback")
    address, name = next(iter(addresses.items()))
    assert _interface_of(address) == name
    assert _interface_of("203.0.113.77") is None  # not this machine's: gloo picks
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's own choice wins
    bind_collectives_to(name)
    assert os.environ["GLOO_SOCKET_IFNAME"] == name and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


def test_a_local_storage_inside_the_notebooks_folder_is_left_out_of_the_ranks_copy(
    tmp_path, monkeypatch
):
    from rtnb.driver.ranks._group import _storage_in_folder

    monkeypatch.chdir(tmp_path)
    assert _storage_in_folder(str(tmp_path / "runs")) == ("/runs/",)
    assert _storage_in_folder("file://" + str(tmp_path / "a" / "runs")) == ("/a/runs/",)
    assert _storage_in_folder(str(tmp_path.parent / "elsewhere")) == ()
    assert _storage_in_folder(str(tmp_path)) == ()
    assert _storage_in_folder("s3://bucket/runs?endpoint_override=h:1") == ()
