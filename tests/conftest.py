"""Shared fixtures: one real local Ray cluster per test session.

The cluster is a real ``ray start --head --block`` on loopback, so the same
cluster serves this process (``ray.init(address=...)``), the Jupyter kernels the
tests start (through ``RAY_ADDRESS``) and the remote-connection tests. It is torn
down by process group at the end; ``ray stop`` is never used because it kills
every Ray process on the machine.
"""

from __future__ import annotations

import atexit
import importlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rtnb.core._startup import with_lazy_imports
from tests import _margins
from tests._background import Lane
from tests._heads import end_process_group
from tests._lending import GroupLoans


def _use_the_suites_own_ray_token() -> None:
    """Every Ray of the run (the session's cluster, the kernels' embedded Rays, the
    users' own heads some tests start) authenticates with one token of the suite's,
    set before anything imports Ray and inherited by every process the tests start.
    Otherwise the suite met whatever ~/.ray/auth_token the machine had: with none,
    the cluster ran without auth and a test whose kernel sends a token as on a
    user's cluster failed, and the first plain ray.init() of a test wrote one
    mid-run for the tests after it (a Ray with a token to use writes none)."""
    folder = Path(tempfile.mkdtemp(prefix="rtnb-suite-token-"))
    atexit.register(shutil.rmtree, folder, True)
    token = folder / "auth_token"
    token.write_text(secrets.token_hex(32))
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
    os.environ["RAY_AUTH_MODE"] = "token"


# Ray reads its auth mode once, when first imported: so here, before any unit test
# imports Ray (e.g. through ray.cloudpickle).
_use_the_suites_own_ray_token()
# Kernels the tests start embed their own Ray (or join the test cluster): a warm Ray
# would outlive the test that started it. tests/test_warm_ray.py turns it on itself.
os.environ["RTNB_WARM_RAY"] = "0"
# The suite's ranks stay at Ray's own niceness: the scenarios beside it run at nice 10
# (tests/_background.py), and its ranks at the kernel's priority starved them on 2
# cores (a user head's job agent never registered in 10 minutes). The default, ranks
# at the kernel's priority, is tested by tests/test_startup.py with this unset.
os.environ.setdefault("RAY_worker_niceness", "15")

REPO = Path(__file__).resolve().parent.parent
CLUSTER_CPUS = 4  # logical CPUs: two 2-rank groups may coexist (kernel + this process)
# The GCS declares a silent node dead after period x threshold (Ray's default 3 s x 5);
# the node-loss test would otherwise wait 15 s for it.
NODE_DEATH_DETECTION = {
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "4",
}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true) a skipped test fails, naming itself and why it skipped, unless
    it is marked ``gpu``: CI cannot go green by skipping (a missing tool, a plain
    ``pytest.skip`` or ``importorskip`` anywhere)."""
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and not hasattr(report, "wasxfail")
        and os.environ.get("CI") == "true"
        and item.get_closest_marker("gpu") is None
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        reason = str(reason).removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = (
            f"CI=true but {item.nodeid} skipped ({reason}): only tests marked gpu may skip in CI"
        )


_lane = Lane()
# How long a test waits for the lane to run its scenario (the scenarios before it
# included); its pytest timeout is longer.
BACKGROUND_WAIT_S = 1200


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """The background scenarios the selected tests ask for start with the run
    (tests/_background.py)."""
    if not session.config.option.collectonly:
        _lane.start([m.args[0] for item in session.items for m in item.iter_markers("background")])


def pytest_sessionfinish(session, exitstatus):
    from tests._kernel import wait_for_exits

    wait_for_exits()
    _lane.close()


@pytest.fixture
def background(request):
    """What this test's background scenario returned (``pytest.mark.background``)."""
    (marker,) = list(request.node.iter_markers("background"))
    return _lane.result(marker.args[0], timeout_s=BACKGROUND_WAIT_S)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's waits are told apart in the margins' report; a test that used over
    half of its pytest timeout is reported there too."""
    _margins.begin_test(item.nodeid)
    began = time.monotonic()
    yield
    marker = item.get_closest_marker("timeout")
    bound = (
        float(marker.args[0])
        if marker and marker.args
        else float(item.config.getini("timeout") or 0)
    )
    _margins.waited("the whole test (pytest-timeout)", time.monotonic() - began, bound)


def pytest_terminal_summary(terminalreporter, config):
    for nodeid in _wrote_machine_token:
        terminalreporter.write_line(
            f"{nodeid} wrote {_MACHINE_TOKEN} (a Ray of its own started by ray.init()); "
            "removed after it"
        )
    scenarios = _lane.took()
    if scenarios:
        terminalreporter.write_line(
            "background scenarios: "
            + ", ".join(f"{key} {took:.0f} s" for key, took in scenarios.items())
        )
    for key, whys in _lane.ran_again().items():
        line = f"background scenario {key} failed beside the suite ({whys[0]}); run again beside it"
        if len(whys) > 1:
            line += f", failed again ({whys[1]}); run a last time alone"
        terminalreporter.write_line(line)
    if _loans.started:
        terminalreporter.write_line(
            f"lent groups: {_loans.started} started, {_loans.lent_again} starts saved"
        )
    close = _margins.close_waits()
    if not close:
        return
    write = terminalreporter.write_line
    write("")
    write(
        f"waits that used over {_margins.CLOSE:.0%} of their bound (a slower machine fails them):"
    )
    for wait in sorted(close, key=lambda w: -w.used):
        write(
            f"  {wait.used:4.0%}  {wait.took_s:6.1f} s of {wait.bound_s:g} s  {wait.what}  ({wait.test})"
        )


# Ray writes this the first time a plain ray.init() starts a local Ray; from then on
# every `ray start --head` on the machine turns token auth on. A test that writes it
# mid-run changes what the tests after it meet (in a fresh clone, a Ray-Data export
# run did, and three later tests failed), so it is removed after the test that wrote
# it, and the run's summary names that test.
_MACHINE_TOKEN = Path.home() / ".ray" / "auth_token"
_machine_token_before = _MACHINE_TOKEN.exists()
_wrote_machine_token: list[str] = []


@pytest.fixture(autouse=True)
def _machine_ray_token_left_alone(request):
    yield
    if not _machine_token_before and _MACHINE_TOKEN.exists():
        _MACHINE_TOKEN.unlink()  # the machine as the suite found it, for the tests after
        _wrote_machine_token.append(request.node.nodeid)


def require(module: str, why: str):
    """Import ``module`` for a test, or skip it; in CI (CI=true) fail instead, so CI
    cannot go green without the browser, S3 and TensorBoard tests."""
    try:
        return importlib.import_module(module)
    except ImportError:
        missing(f"{module} is not installed ({why})")


def missing(what: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {what}: install it (.ci/setup, .ci/run)", pytrace=False)
    pytest.skip(what)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class HeadNode:
    def __init__(self) -> None:
        self.port = free_port()
        self.client_port = free_port()
        self.temp_dir = tempfile.mkdtemp(prefix="rtnb-ray-")
        self.address = f"127.0.0.1:{self.port}"
        self.client_address = f"ray://127.0.0.1:{self.client_port}"
        self.dashboard_port = free_port()
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.log = Path(self.temp_dir) / "head.log"
        ray_bin = Path(sys.executable).parent / "ray"
        cmd = [
            str(ray_bin),
            "start",
            "--head",
            "--block",
            f"--port={self.port}",
            f"--ray-client-server-port={self.client_port}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={CLUSTER_CPUS}",
            "--object-store-memory=300000000",
            # The dashboard hosts Ray's job server (for `rtnb submit`).
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            # Not Ray's fixed 52365: a `ray start --head` a test runs beside this
            # cluster (test_warm_neighbour's user) needs it for its job agent.
            f"--dashboard-agent-listen-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
        ]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # As on a real cluster node, the environment's scripts (rtnb, for
                # submitted jobs) are on the PATH.
                env={
                    **os.environ,
                    **NODE_DEATH_DETECTION,
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                    # As the README suggests for a cluster one starts oneself: Ray's
                    # processes skip jsonschema's unused IRI grammar (~2.5 s each).
                    "PYTHONPATH": with_lazy_imports(os.environ.get("PYTHONPATH")),
                },
            )
        deadline = time.monotonic() + 60
        for port in (self.port, self.client_port):
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"ray start failed:\n{self.log.read_text()[-3000:]}")
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                        break
                except OSError:
                    time.sleep(0.2)
            else:
                self.stop()
                raise RuntimeError(f"ray head did not open port {port} within 60 s")

    def wait_dashboard(self, timeout: float = 120.0) -> str:
        """The dashboard URL once its HTTP server answers (it starts after the GCS)."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2)
                return self.dashboard_url
            except urllib.error.HTTPError:  # 401 without a token: it is up
                return self.dashboard_url
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"the Ray dashboard did not answer within {timeout:.0f} s")

    def stop(self) -> None:
        end_process_group(self.proc)


class WorkerNode:
    """A second Ray node (its own raylet and object store) joined to the session's
    head, so a test can lose a whole node without starting another cluster."""

    def __init__(
        self,
        head: HeadNode,
        num_cpus: int,
        resources: dict[str, float],
        env: dict[str, str] | None = None,
        mask: str | None = None,
    ) -> None:
        """``mask``: a folder this node does not see (an empty tmpfs over it in the
        node's own mount namespace, as on a machine that does not share that disk)."""
        import json
        import shlex

        self.log = Path(head.temp_dir) / f"worker-{time.monotonic_ns()}.log"
        ray_bin = Path(sys.executable).parent / "ray"
        cmd = [
            str(ray_bin),
            "start",
            f"--address={head.address}",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}",
            f"--resources={json.dumps(resources)}",
            "--object-store-memory=100000000",
        ]
        if mask is not None:
            inner = f"mount -t tmpfs tmpfs {shlex.quote(mask)} && exec {shlex.join(cmd)}"
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", inner]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )

    def wait_joined(self, resource: str, timeout: float = 60.0) -> None:
        import ray

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray worker node failed:\n{self.log.read_text()[-3000:]}")
            if ray.cluster_resources().get(resource):
                return
            time.sleep(0.2)
        raise RuntimeError(f"ray worker node did not join within {timeout:.0f} s")

    def kill(self) -> None:
        """Lose the node at once: raylet, object store and every worker on it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def ray_head():
    head = HeadNode()
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = head.address
    try:
        yield head
    finally:
        from tests._kernel import wait_for_exits

        wait_for_exits()  # the kernels' drivers end before their cluster
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        finally:
            head.stop()
            if old is None:
                os.environ.pop("RAY_ADDRESS", None)
            else:
                os.environ["RAY_ADDRESS"] = old


@pytest.fixture(scope="session")
def ray_cluster(ray_head):
    """This test process connected to the session's cluster."""
    from rtnb.driver.cluster._connect import connect

    connect(ray_head.address)
    return ray_head


_loans = GroupLoans()


@pytest.fixture(scope="session")
def _group_loans(ray_cluster):
    yield _loans
    _loans.close_idle()  # before the cluster goes


@pytest.fixture
def lend(_group_loans):
    """``group_factory=lend``: the session borrows the healthy group the last
    borrowing test gave back (tests/_lending.py), for a test that needs only a fresh
    run on healthy ranks."""
    return _group_loans.lend


@pytest.fixture(autouse=True)
def _idle_loans_closed(request):
    """Any other test of the cluster (every one asks for ``ray_head``) sees its CPUs
    as a fresh suite would: the idle lent group goes before it."""
    if "ray_head" in request.fixturenames and "lend" not in request.fixturenames:
        _loans.close_idle()
    yield


def wait_for_free_cpus(expected: float, timeout: float = 30.0) -> float:
    import ray

    began = time.monotonic()
    free = 0.0
    while time.monotonic() < began + timeout:
        free = ray.available_resources().get("CPU", 0.0)
        if free >= expected:
            break
        time.sleep(0.2)
    _margins.waited(f"{expected:g} CPUs free", time.monotonic() - began, timeout)
    return free


@pytest.fixture(scope="module")
def group(ray_cluster):
    """A started 2-rank session shared by a module's tests."""
    import rtnb

    session = rtnb.Session(
        workers=2, stop_grace_s=1.0, storage=tempfile.mkdtemp(prefix="rtnb-runs-")
    )
    session.start()
    yield session
    session.stop()


@pytest.fixture(scope="module")
def kernel(ray_cluster, tmp_path_factory):
    """A real IPython kernel with rtnb loaded (a user's notebook, on the suite's
    cluster), one per module; once it shuts down every CPU its ranks held is free.
    A module that needs another kind of kernel (a newcomer's machine) defines its own."""
    from tests._kernel import kernel_with_rtnb

    with kernel_with_rtnb(str(tmp_path_factory.mktemp("nb"))) as k:
        yield k
    assert wait_for_free_cpus(CLUSTER_CPUS) >= CLUSTER_CPUS, (
        "kernel shutdown left ranks holding CPUs"
    )
