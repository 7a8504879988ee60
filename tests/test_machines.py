"""A cluster of machines the notebook does not share (``tests/_machines.py``): a head
that runs no ranks, three worker machines (two whose own names resolve to loopback,
as Debian's and many images' ``/etc/hosts`` say, one to its own address; one of the
three is spare), an object store machine (moto's S3 server) and two notebook
machines that are not Ray nodes. Every machine has its own address, host name,
disk, ``/tmp`` and ``HOME``; the cluster runs Ray's token authentication with one
token that every machine of it holds.

One cluster is shared by the module; each test leaves it as it found it (a machine
a test takes down is booted again and rejoins).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import sys
import time
import uuid
from pathlib import Path

import pytest
from jupyter_client.manager import KernelManager
from jupyter_client.provisioning import local_provisioner as _provisioner

from tests._cluster import BUCKET, Cluster, answers
from tests._kernel import Kernel
from tests._machines import DISK, Machine, wait_until, why_not

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

_KERNELS = Path("/var/tmp") / f"rtnb-kernels-{os.getpid()}"
_WHY_NOT = why_not()
if _WHY_NOT is not None and os.environ.get("CI") == "true":
    raise RuntimeError(f"CI must run the simulated cluster: {_WHY_NOT}")
if _WHY_NOT is not None:
    pytest.skip(_WHY_NOT, allow_module_level=True)


@pytest.fixture(scope="module")
def cluster():
    made = Cluster()
    try:
        yield made
    finally:
        made.close()
        shutil.rmtree(_KERNELS, ignore_errors=True)


def _also_machines(is_local_ip):
    # jupyter_client starts kernels on this host's interfaces only; a machine's kernel
    # listens on the machine's address, which this host reaches over the bridge.
    def local_or_a_machine(ip: str) -> bool:
        return ip.startswith("10.") or is_local_ip(ip)

    return local_or_a_machine


_provisioner.is_local_ip = _also_machines(_provisioner.is_local_ip)


class MachineKernel(Kernel):
    """A real Jupyter kernel on ``machine``: its process in the machine's namespaces,
    listening on the machine's address (this test reaches it over the bridge)."""

    def __init__(self, machine: Machine, env: dict[str, str], cwd: str = f"{DISK}/work") -> None:
        runtime = _KERNELS  # seen by this host and by the machine alike
        runtime.mkdir(exist_ok=True)
        wrap = machine.command([sys.executable], cwd=cwd)[:-1]

        class OnMachine(KernelManager):
            def format_kernel_cmd(self, extra_arguments=None):
                return [*wrap, *super().format_kernel_cmd(extra_arguments)]

        km = OnMachine(
            kernel_name="python3",
            ip=machine.address,
            transport="tcp",
            connection_file=str(runtime / f"kernel-{uuid.uuid4().hex}.json"),
            cache_ports=False,
        )
        km.kernel_spec.interrupt_mode = "message"  # SIGINT would reach nsenter only
        self.km = km
        for attempt in range(3):
            # The machine's own ports (jupyter_client would look for free ones on this
            # host). Below Linux's ephemeral range (32768+), where the machine's Ray node
            # takes its own ports, and above Ray's worker ports (10002-19999).
            base = 20000 + secrets.randbelow(12000)
            km.shell_port, km.iopub_port, km.stdin_port, km.hb_port, km.control_port = range(
                base, base + 5
            )
            km.start_kernel(env=env)
            self.kc = km.client()
            self.kc.start_channels()
            try:
                self.kc.wait_for_ready(timeout=120)
                return
            except RuntimeError:  # a port taken after all: the kernel died binding it
                self.kc.stop_channels()
                km.cleanup_resources()
                if attempt == 2:
                    raise


def _refusal(run) -> str:
    """What a refused magic said: a UsageError's line (on stderr), or an error's value."""
    assert run.status == "error", f"not refused: {run.text[-2000:]}"
    said = (run.evalue or run.text).strip()
    assert "Traceback" not in run.text and len(run.traceback) <= 3, run.traceback
    return said.removeprefix("UsageError: ")


@contextlib.contextmanager
def kernel_on(cluster: Cluster, machine: Machine, **env: str):
    """A kernel on ``machine`` with rtnb's magics loaded."""
    kernel = MachineKernel(machine, cluster.env(machine, **env))
    try:
        _checked(kernel.execute("%load_ext rtnb"), "load")
        yield kernel
    finally:
        kernel.shutdown()


def _start(kernel, cluster: Cluster, run: str, flags: str = "", what: str = "start"):
    """``%rtnb start`` of ``run`` on the cluster by HOST:PORT, its runs in S3."""
    return _checked(
        kernel.execute(
            f"%rtnb start --address {cluster.gcs} --storage {cluster.storage} --name {run} {flags}",
            timeout=300,
        ),
        what,
    )


def _checked(run, what: str):
    print(f"{what}: {run.status} in {run.elapsed_s:.1f} s", flush=True)
    assert run.status == "ok", f"{what}: {run.ename}: {run.evalue}\n{run.text[-3000:]}"
    return run


def _shown(run) -> str:
    """Everything a cell showed: its streams and each display's text, updates too."""
    shown = [d.get("text/plain", "") for d in (*run.results, *run.updates)]
    return "\n".join([run.text, *shown, f"{run.ename}: {run.evalue}" if run.ename else ""])


def _value(run) -> str:
    return run.results[-1]["text/plain"] if run.results else ""


def test_a_notebook_machine_that_is_no_node_trains_ddp_across_two_machines(cluster: Cluster):
    """The join form the deploy page gives (HOST:PORT, a name from /etc/hosts) from a
    machine that is not a Ray node; ranks on two machines with different addresses,
    whose names resolve to loopback or not; the notebook's own module; checkpoints
    that only the object store holds; the browser and resume."""
    work = cluster.nb.work
    (work / "model.py").write_text("VALUE = 1\n")
    with kernel_on(cluster, cluster.nb) as kernel:
        refused = kernel.execute(
            f"%rtnb start --address {cluster.gcs} --storage {DISK}/work/runs", timeout=150
        )
        assert "is a local path" in _refusal(refused)

        start = _start(kernel, cluster, "across")
        assert f"joined from nb ({cluster.nb.address}), a node with no CPUs" in _shown(start)

        where = _checked(
            kernel.execute(
                "%%rtrain\nimport socket, ray, torch, torch.distributed as dist\n"
                "t = torch.ones(1)\ndist.all_reduce(t)\n"
                "(socket.gethostname(), ray.util.get_node_ip_address(), t.item())",
                timeout=120,
            ),
            "DDP cell",
        )
        placed = re.findall(r"\('(w\d)', '([\d.]+)', 2\.0\)", _value(where))
        assert len(placed) == 2 and placed[0][1] != placed[1][1], _value(where)
        workers = {w.name: w for w in cluster.workers}
        assert all(workers[name].address == ip for name, ip in placed), placed
        assert any(workers[name].loopback_name for name, _ in placed), placed

        # The notebook's folder reaches ranks on machines that do not see it.
        seen = _checked(kernel.execute("%%rtrain\nimport model\nmodel.VALUE"), "import")
        assert _value(seen) == "[rank 0] 1\n[rank 1] 1", _value(seen)
        (work / "model.py").write_text("VALUE = 2\n")
        seen = _checked(kernel.execute("%rtrain model.VALUE"), "edit")
        assert _value(seen) == "[rank 0] 2\n[rank 1] 2", _value(seen)

        _checked(
            kernel.execute(
                "%%rtrain\nimport rtnb\nck = rtnb.get_checkpoint()\n"
                "started_at = 0 if ck is None else ck.load_state()['step'] + 1\n"
                "for step in range(started_at, 3):\n"
                "    rtnb.report({'loss': 1.0 / (step + 1)},\n"
                "                checkpoint=rtnb.Checkpoint.from_state({'step': step}))",
                timeout=180,
            ),
            "checkpoints",
        )
        keys = {
            o["Key"]
            for o in cluster.s3.list_objects_v2(Bucket=BUCKET, Prefix="runs/across/")["Contents"]
        }
        assert "runs/across/checkpoints/step-000000001/_manifest.json" in keys, sorted(keys)
        assert not list(work.rglob("_manifest.json")), "a checkpoint on the notebook's disk"

        browser = _checked(kernel.execute("%rtnb checkpoints"), "browser")
        listed = re.findall(r"^(step-\d+) ", _shown(browser), re.M)
        assert listed == [f"step-{n:09d}" for n in range(3)], _shown(browser)
        _checked(kernel.execute("%rtnb resume step-000000000", timeout=180), "resume")
        resumed = _checked(kernel.execute("%rtrain started_at"), "resumed")
        assert _value(resumed) == "[rank 0] 1\n[rank 1] 1", _value(resumed)
        _checked(kernel.execute("%rtnb stop"), "stop")
    # The node the kernel started on its machine ends with the kernel.
    wait_until("the notebook machine's node to end", lambda: cluster.raylets(cluster.nb) == 0, 60)


def test_a_machine_without_the_clusters_token_gets_one_line(cluster: Cluster):
    with kernel_on(cluster, cluster.nb2, HOME=f"{DISK}/work") as kernel:  # no ~/.ray there
        said = _refusal(kernel.execute(f"%rtnb start --address {cluster.gcs}", timeout=120))
        assert "RAY_AUTH_TOKEN" in said and "(nb2)" in said and "\n" not in said, said
        alive = _checked(kernel.execute("1 + 1"), "after")
        assert _value(alive) == "2"
    assert cluster.raylets(cluster.nb2) == 0


_WHERE = (
    "%rtrain (__import__('socket').gethostname(), __import__('ray').util.get_node_ip_address())"
)


def _places(kernel) -> dict[int, tuple[str, str]]:
    """Each rank's machine: {rank: (host name, address)}."""
    run = _checked(kernel.execute(_WHERE), "where")
    return {
        int(rank): (name, ip)
        for rank, name, ip in re.findall(r"\[rank (\d+)\] \('([\w-]+)', '([\d.]+)'\)", _value(run))
    }


def _training(steps: int, pause_s: float) -> str:
    return (
        "%%rtrain --background\nimport time, socket, rtnb\nck = rtnb.get_checkpoint()\n"
        "first = 0 if ck is None else ck.load_state()['step'] + 1\n"
        f"for step in range(first, {steps}):\n"
        f"    time.sleep({pause_s})\n"
        "    rtnb.report({'step': step}, checkpoint=rtnb.Checkpoint.from_state({'step': step}))\n"
        "(first, socket.gethostname())"
    )


def _committed(cluster: Cluster, run: str) -> int:
    """How many checkpoints of ``run`` the object store holds (their manifests)."""
    listed = cluster.s3.list_objects_v2(Bucket=BUCKET, Prefix=f"runs/{run}/checkpoints/")
    return sum(1 for o in listed.get("Contents", ()) if o["Key"].endswith("_manifest.json"))


def test_a_lost_worker_machine_ends_the_cell_in_one_line_or_is_replaced_by_the_spare(
    cluster: Cluster,
):
    """(a) Every process of the machine under rank 1 killed mid-cell: without failures
    to spend the cell ends with one line naming the rank and the machine; with
    ``--max-failures 1`` the cell finishes on the spare machine from its last
    checkpoint."""
    workers = {w.name: w for w in cluster.workers}
    with kernel_on(cluster, cluster.nb) as kernel:
        _start(kernel, cluster, "lost1")
        lost = workers[_places(kernel)[1][0]]
        _checked(kernel.execute(_training(200, 0.2)), "background")
        wait_until("a checkpoint", lambda: _committed(cluster, "lost1") >= 2, 120)
        killed_at = time.monotonic()
        lost.kill()
        ended = kernel.execute("%rtnb wait", timeout=180)
        took = time.monotonic() - killed_at
        print(f"the cell ended {took:.1f} s after the machine was lost", flush=True)
        said = _shown(ended)
        assert ended.status == "error", said
        assert took < 60, f"{took:.1f} s"
        assert "rank 1" in said and (lost.name in said or lost.address in said), said
        cluster.reboot(lost)
        _checked(kernel.execute("%rtnb stop"), "stop")

        _start(kernel, cluster, "lost2", "--max-failures 1", what="start again")
        before = _places(kernel)
        lost = workers[before[1][0]]
        spare = next(w for w in cluster.workers if w.name not in {n for n, _ in before.values()})
        _checked(kernel.execute(_training(12, 0.3)), "background")
        wait_until("a checkpoint", lambda: _committed(cluster, "lost2") >= 3, 120)
        killed_at = time.monotonic()
        lost.kill()
        done = _checked(kernel.execute("%rtnb wait", timeout=300), "wait")
        print(f"finished {time.monotonic() - killed_at:.1f} s after the machine was lost")
        after = _places(kernel)
        assert spare.name in {name for name, _ in after.values()}, (before, after)
        resumed_from = re.findall(r"\[rank \d\] \((\d+), '", _value(done))
        assert resumed_from and all(int(n) >= 2 for n in resumed_from), _shown(done)
        _checked(kernel.execute("%rtnb stop"), "stop")
    cluster.reboot(lost)


def _ddp_on_two_machines(kernel) -> set[str]:
    run = _checked(
        kernel.execute(
            "%%rtrain\nimport socket, torch, torch.distributed as dist\nt = torch.ones(1)\n"
            "dist.all_reduce(t)\n(socket.gethostname(), t.item())",
            timeout=120,
        ),
        "DDP",
    )
    hosts = re.findall(r"\('(w\d)', 2\.0\)", _value(run))
    assert len(hosts) == 2, _value(run)
    return set(hosts)


def test_every_join_form_from_a_machine_that_is_no_node(cluster: Cluster):
    """RAY_ADDRESS=HOST:PORT (as a KubeRay notebook pod sets it), then ray:// in the
    same kernel; each says how it joined."""
    with kernel_on(cluster, cluster.nb2, RAY_ADDRESS=cluster.gcs) as kernel:
        start = _checked(
            kernel.execute(f"%rtnb start --storage {cluster.storage} --name envjoin", timeout=300),
            "start by RAY_ADDRESS",
        )
        assert f"joined from nb2 ({cluster.nb2.address}), a node with no CPUs" in _shown(start)
        assert len(_ddp_on_two_machines(kernel)) == 2
        _checked(kernel.execute("%rtnb stop"), "stop")
        start = _checked(
            kernel.execute(
                f"%rtnb start --address ray://{cluster.head.name}:10001 "
                f"--storage {cluster.storage} --name clientjoin",
                timeout=300,
            ),
            "start by ray://",
        )
        assert len(_ddp_on_two_machines(kernel)) == 2
        _checked(kernel.execute("%rtnb stop"), "stop")


def test_a_worker_machine_cut_off_mid_collective_ends_the_cell_and_the_session_goes_on(
    cluster: Cluster,
):
    """(b) The link of rank 1's machine taken down while rank 0 waits in an
    all-reduce (rank 1's processes alive): the cell ends in one line, never a silent
    wait; once the link is back the session runs cells again."""
    workers = {w.name: w for w in cluster.workers}
    with kernel_on(cluster, cluster.nb) as kernel:
        _start(kernel, cluster, "cut")
        cut = workers[_places(kernel)[1][0]]
        _checked(
            kernel.execute(
                "%%rtrain --background\nimport time, torch, torch.distributed as dist, rtnb\n"
                "for step in range(100000):\n    t = torch.ones(1)\n    dist.all_reduce(t)\n"
                "    rtnb.report({'step': step})\n    time.sleep(0.05)"
            ),
            "background",
        )
        wait_until("steps", lambda: "step" in _shown(kernel.execute("%rtnb status")), 60)
        cut_at = time.monotonic()
        cut.link(False)
        try:
            ended = kernel.execute("%rtnb wait", timeout=180)
            took = time.monotonic() - cut_at
        finally:
            cut.link(True)
        print(f"the cell ended {took:.1f} s after the link went down", flush=True)
        said = _shown(ended)
        assert ended.status == "error" and "rank 1" in said, said
        assert took < 60, f"{took:.1f} s"
        cluster.reboot(cut)  # its raylet was declared dead: it ends once it hears so
        again = kernel.execute("%rtrain 1 + 1", timeout=120)
        if again.status != "ok":  # at worst, start again
            _checked(kernel.execute("%rtnb stop"), "stop")
            _start(kernel, cluster, "cut2", what="start again")
        assert len(_ddp_on_two_machines(kernel)) == 2
        _checked(kernel.execute("%rtnb stop"), "stop")


def test_the_heads_link_cut_for_ten_seconds_leaves_the_kernel_alive_and_saying_so(
    cluster: Cluster,
):
    """(c) The head unreachable for 10 s while a group is up: the kernel lives, says
    what it lost, and starts again once the head is back."""
    with kernel_on(cluster, cluster.nb) as kernel:
        _start(kernel, cluster, "headcut")
        _checked(kernel.execute("%rtrain x = 41"), "state")
        cluster.head.link(False)
        try:
            time.sleep(10)  # the cut itself is what this test is about
            during = kernel.execute("%rtnb status", timeout=60)
        finally:
            cluster.head.link(True)
        said = _shown(during)
        print(f"status while cut: {said.strip()[:300]}", flush=True)
        assert "gone" in said or "lost" in said, said
        alive = _checked(kernel.execute("6 * 7"), "alive")
        assert _value(alive) == "42"
        wait_until("the head", lambda: answers(f"http://{cluster.head.address}:8265"), 60)
        _checked(kernel.execute("%rtnb stop"), "stop")
        _start(kernel, cluster, "headback", what="start again")
        assert len(_ddp_on_two_machines(kernel)) == 2
        _checked(kernel.execute("%rtnb stop"), "stop")


def test_a_detached_group_trains_on_while_the_notebook_machine_is_cut_off(cluster: Cluster):
    """(d) A group detached from one notebook machine trains on while that machine's
    link is down, and another notebook machine attaches afterwards: the cell's value,
    and every report of it once in the run's record."""
    steps = 60
    with kernel_on(cluster, cluster.nb) as kernel:
        _start(kernel, cluster, "far", "--detached", what="start detached")
        _checked(
            kernel.execute(
                "%%rtrain --background\nimport time, rtnb\n"
                f"for step in range({steps}):\n    time.sleep(0.25)\n"
                "    rtnb.report({'step': step})\n'trained'"
            ),
            "background",
        )
        wait_until("steps", lambda: "step" in _shown(kernel.execute("%rtnb status")), 60)
        cluster.nb.link(False)
        time.sleep(8)  # the cut itself is what this test is about
        cluster.nb.link(True)
    with kernel_on(cluster, cluster.nb2) as other:
        _checked(
            other.execute(f"%rtnb attach far --take --address {cluster.gcs}", timeout=300), "attach"
        )
        done = _checked(other.execute("%rtnb wait", timeout=180), "wait")
        assert "trained" in _value(done), _shown(done)
        path = cluster.storage.replace("/runs?", "/runs/far?")
        record = _checked(
            other.execute(
                f"import rtnb\n_f = rtnb.Result.from_path({path!r}).metrics_dataframe\n"
                "print([sorted(_f[_f['rank'] == r]['step'].tolist()) for r in (0, 1)])"
            ),
            "record",
        )
        every = list(range(steps))
        assert record.stdout.strip() == repr([every, every]), record.stdout
        _checked(other.execute("%rtnb stop"), "stop")


def test_a_notebook_submitted_from_the_notebook_machine_runs_on_the_cluster(cluster: Cluster):
    """`rtnb submit` from a machine that is not a node, to the head's dashboard (the
    deploy page opens it with --dashboard-host), with the notebook's folder; its DDP
    cell runs on two worker machines; `rtnb jobs` lists it and `rtnb ps` reaches the
    cluster from outside."""
    import nbformat

    from tests._kernel import new_notebook

    work = cluster.nb.work / "job"
    work.mkdir()
    (work / "helper.py").write_text("ANSWER = 42\n")
    nbformat.write(
        new_notebook(
            [
                "%load_ext rtnb",
                "%rtnb start --name submitted",
                "%%rtrain\nimport socket, helper, torch, torch.distributed as dist\n"
                "t = torch.ones(1)\ndist.all_reduce(t)\n"
                "print('ranks at', socket.gethostname(), helper.ANSWER, t.item())",
                "%rtnb stop",
            ]
        ),
        work / "job.ipynb",
    )
    dashboard = f"http://{cluster.head.name}:8265"
    submitted = cluster.nb.run(
        [
            "rtnb",
            "submit",
            "job.ipynb",
            "--working-dir",
            ".",
            "--address",
            dashboard,
            "--storage",
            cluster.storage,
            "--wait",
        ],
        env=cluster.env(cluster.nb),
        cwd=f"{DISK}/work/job",
        timeout=600,
    )
    said = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0, said[-4000:]
    hosts = set(re.findall(r"ranks at (w\d) 42 2\.0", said))
    assert len(hosts) == 2, said[-4000:]
    listed = cluster.nb.run(["rtnb", "jobs", "--address", dashboard], env=cluster.env(cluster.nb))
    assert listed.returncode == 0 and "job.ipynb" in listed.stdout, listed.stdout + listed.stderr
    ps = cluster.nb.run(
        ["rtnb", "ps", "--address", cluster.gcs], env=cluster.env(cluster.nb), timeout=300
    )
    assert ps.returncode == 0, ps.stdout + ps.stderr
    wait_until("the CLI's node to end", lambda: cluster.raylets(cluster.nb) == 0, 60)
