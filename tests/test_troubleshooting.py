"""The troubleshooting page's fixes, run: each **Fix** there names the tests that run
it (``<!-- tested: ... -->``), or says why none can here (``<!-- untested: ... -->``),
and the joins a cluster refuses get their line and then work the way it says."""

from __future__ import annotations

import ast
import re
import socket
import threading
from pathlib import Path

import pytest

import rtnb
from rtnb.driver.cluster._outside import look_at_cluster

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "troubleshooting.md"
_MARK = re.compile(r"<!-- (tested|untested): (.+?) -->", re.S)


def _fixes() -> list[str]:
    """Each bullet of the page that gives a **Fix**, whole (its wrapped lines too)."""
    bullets, current = [], None
    for line in PAGE.read_text().splitlines():
        if line.startswith("- "):
            current = [line]
            bullets.append(current)
        elif current is not None and line.startswith("  "):
            current.append(line)
        else:
            current = None
    return [" ".join(b) for b in bullets if "**Fix**" in " ".join(b)]


def _defined(test: str) -> bool:
    path, _, name = test.strip().partition("::")
    file = REPO / path
    if not file.exists():
        return False
    tree = ast.parse(file.read_text())
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
        for node in tree.body
    )


def test_every_fix_on_the_troubleshooting_page_names_the_tests_that_run_it():
    fixes = _fixes()
    assert len(fixes) >= 20, f"the page's fixes were not found ({len(fixes)})"
    unmarked, missing, untested = [], [], []
    for fix in fixes:
        mark = _MARK.search(fix)
        if mark is None:
            unmarked.append(fix[:90])
            continue
        kind, what = mark.groups()
        if kind == "untested":
            untested.append(what)
            assert len(what.split()) >= 4, f"an untested fix says why: {fix[:90]}"
            continue
        missing += [t for t in what.split(",") if not _defined(t)]
    assert unmarked == [], f"fixes that name no test: {unmarked}"
    assert missing == [], f"fixes name tests that do not exist: {missing}"
    assert len(untested) <= 4, f"most fixes run in a test; untested: {untested}"


class _NotAGcs:
    """A TCP port that accepts and answers nothing Ray speaks (a web server, a
    Ray Client port given without ``ray://``)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    def close(self) -> None:
        self.server.close()


def test_a_head_named_wrongly_or_a_port_that_is_no_gcs_gets_its_line_and_the_fix_joins(
    ray_cluster,
):
    with pytest.raises(rtnb.ClusterError) as raised:
        look_at_cluster("no-such-head.invalid", 6379, timeout_s=5)
    said = str(raised.value)
    assert said.startswith("cannot resolve 'no-such-head.invalid' on this machine"), said
    assert "(an IP)" in said and "/etc/hosts" in said
    web = _NotAGcs()
    try:
        with pytest.raises(rtnb.ClusterError) as raised:
            look_at_cluster("127.0.0.1", web.port, timeout_s=5)
    finally:
        web.close()
    said = str(raised.value)
    assert "did not say which nodes it has" in said and "6379 by default" in said, said
    # The fix: the head's address as an IP, at its GCS port.
    host, _, port = ray_cluster.address.rpartition(":")
    seen = look_at_cluster(socket.gethostbyname(host), int(port), timeout_s=10)
    assert any(node.is_head for node in seen.nodes), seen


SAVED_BOTH_WAYS = """
import torch, rtnb
torch.manual_seed(0)
net = torch.nn.Linear(2, 1)
model = rtnb.prepare_model(net)  # DDP at 2 ranks: its keys gain "module."
state = {"given": net.state_dict(), "wrapped": model.state_dict()}
rtnb.report({"saved": 1.0}, checkpoint=rtnb.Checkpoint.from_state(state))
"""


def test_a_model_saved_as_the_module_given_to_prepare_model_loads_into_a_plain_model(
    lend, tmp_path
):
    import torch

    with rtnb.Session(workers=2, group_factory=lend, storage=str(tmp_path), name="keys") as s:
        s.run(SAVED_BOTH_WAYS)
        state = s.checkpoints.get(s.checkpoints.latest().id).load_state()
    plain = torch.nn.Linear(2, 1)
    with pytest.raises(RuntimeError, match="module.weight"):
        plain.load_state_dict(state["wrapped"])  # the cause: keys differ by "module."
    plain.load_state_dict(state["given"])  # the fix
    assert torch.equal(plain.weight, state["given"]["weight"])


def test_a_group_that_cannot_be_placed_gets_its_line_and_fewer_cpus_start(ray_cluster, tmp_path):
    """CPUs held by something else (here a placement group of this test's own): the
    start says so within its placement timeout, frees what it took, and a group that
    asks for what is free starts."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    free = ray.available_resources().get("CPU", 0.0)
    assert free >= 1.0, f"the test cluster has {free} CPUs free"
    held = placement_group([{"CPU": free - 0.5}])
    ray.get(held.ready(), timeout=60)
    # More than all the rest, even should the groups other tests hold be let go now.
    others = ray.cluster_resources()["CPU"] - free
    too_many = (0.5 + others) / 2 + 0.25
    try:
        options = dict(workers=2, storage=str(tmp_path), placement_timeout_s=2)
        too_big = rtnb.Session(cpus_per_worker=too_many, **options)
        try:
            with pytest.raises(rtnb.ClusterError) as raised:
                too_big.start()
        finally:
            too_big.stop()  # had it started, its CPUs would starve every later test
        said = str(raised.value)
        assert said.startswith("Ray could not place 2 workers"), said
        assert "held by something else" in said and "fewer --workers / --cpus-per-worker" in said
        with rtnb.Session(cpus_per_worker=0.2, **options) as fits:
            assert fits.run("1 + 1") == {0: 2, 1: 2}
    finally:
        remove_placement_group(held)
