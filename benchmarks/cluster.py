"""A notebook on a machine that is not a Ray node, on the simulated cluster of
``tests/_cluster.py`` (machines as namespaces on this host: a head with no ranks,
worker machines with one CPU each, an object store machine, a notebook machine).

Per join form, from the notebook machine (a Python driver there, as a kernel is):
start to the first result of a DDP cell on two worker machines, and the warm
trivial cell (median of 200). Against the same on one machine: a driver whose Ray
is embedded on its own machine, its 2 ranks beside it. And a DDP step across two
worker machines in an rtnb cell against torchrun run the same way across the same
two machines (``--nnodes 2``, a c10d rendezvous on the first), the loop of
``ddp_throughput.py``. Sides alternate from round to round.

    .venv/bin/python benchmarks/cluster.py [--rounds 1] [--window-s 10] [--quick]

``benchmarks/run.py`` runs it once per round (a fresh cluster each time), sides
alternating. Every side keeps its run directory on the notebook machine's disk (the
object store machine's server would take CPU from the ranks' cores on this host).

Needs root and iproute2 (machines are namespaces).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]

from ddp_throughput import _loop_source  # noqa: E402

from tests._cluster import Cluster  # noqa: E402
from tests._machines import DISK, why_not  # noqa: E402

TRIVIAL_CELLS = 200

DRIVER = """
import json, statistics, sys, time
t0 = time.perf_counter()
import rtnb
address, storage, loop = sys.argv[1], sys.argv[2], sys.argv[3]
# The run directory on the notebook machine's disk on every side, as one machine has
# it: the object store machine's server would take CPU from the ranks' two cores.
kwargs = {{"storage": "/machine/work/runs", "allow_local_storage": True}}
if address != "embedded":
    kwargs["address"] = address
session = rtnb.Session(workers=2, name="bench-" + str(int(t0 * 1000)), **kwargs).start()
where = session.run(
    "import socket, torch, torch.distributed as dist\\nt = torch.ones(1)\\n"
    "dist.all_reduce(t)\\n(socket.gethostname(), t.item())"
)
first_s = time.perf_counter() - t0
for _ in range(20):
    session.run("1")
cells = []
for _ in range({cells}):
    began = time.perf_counter()
    session.run("1")
    cells.append(time.perf_counter() - began)
if loop == "hold":  # idle beside the peer's run, until told to stop
    print("HOLDING", flush=True)
    import os
    while not os.path.exists("/machine/work/release"):
        time.sleep(0.2)
    session.stop()
    sys.exit(0)
step = None
if loop != "-":
    step = session.run("import rtnb\\n" + open(loop).read() + "\\n(step_s, STEPS)")[0]
session.stop()
print("RESULT " + json.dumps({{"first_s": first_s, "trivial_ms": 1000 * statistics.median(cells),
    "hosts": sorted(h for h, _ in where.values()), "step": step}}), flush=True)
"""

TORCHRUN = """
import json, os, torch.distributed as dist
dist.init_process_group("gloo")
exec(compile(open(os.environ["LOOP"]).read(), "<loop>", "exec"))
if dist.get_rank() == 0:
    print("RESULT " + json.dumps({"step_s": step_s, "steps": STEPS}), flush=True)
os._exit(0)
"""


def _result(text: str, what: str) -> dict:
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{what} printed no result:\n{text[-3000:]}")


def driver(cluster: Cluster, address: str, loop: bool) -> dict:
    nb = cluster.nb
    (nb.work / "driver.py").write_text(DRIVER.format(cells=TRIVIAL_CELLS))
    done = nb.run(
        [
            sys.executable,
            "driver.py",
            address,
            cluster.storage,
            f"{DISK}/work/loop.py" if loop else "-",
        ],
        env=cluster.env(nb, OMP_NUM_THREADS="1"),
        cwd=f"{DISK}/work",
        timeout=900,
    )
    return _result(done.stdout + done.stderr, f"the driver by {address}")


ECHO = """
import socket, sys, time
if sys.argv[1] == "serve":
    server = socket.create_server((sys.argv[2], 29555))
    print("LISTENING", flush=True)
    conn, _ = server.accept()
    while data := conn.recv(64):
        conn.sendall(data)
else:
    conn = socket.create_connection((sys.argv[2], 29555))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(2000):
        began = time.perf_counter()
        conn.sendall(b"x" * 64)
        got = 0
        while got < 64:
            got += len(conn.recv(64))
        times.append(time.perf_counter() - began)
    times.sort()
    print("RESULT {\\"rtt_us\\": %f}" % (1e6 * times[len(times) // 2]), flush=True)
"""


def round_trip_us(cluster: Cluster, server_machine, host: str) -> float:
    """Median TCP round trip of 64 bytes from the notebook machine to ``host``."""
    nb = cluster.nb
    for machine in {nb, server_machine}:
        (machine.work / "echo.py").write_text(ECHO)
    server = server_machine.popen(
        [sys.executable, "echo.py", "serve", "0.0.0.0"],
        cwd=f"{DISK}/work",
        log=server_machine.disk / "echo.log",
    )
    try:
        time.sleep(1.0)
        done = nb.run([sys.executable, "echo.py", "ask", host], cwd=f"{DISK}/work", timeout=120)
        return _result(done.stdout + done.stderr, "the echo")["rtt_us"]
    finally:
        server.kill()
        server.wait()


def torchrun(cluster: Cluster, hosts: list[str]) -> float:
    """One DDP window under torchrun on the two machines named ``hosts``, while the
    notebook machine holds an idle rtnb session (its driver and its node): in this
    simulation every machine shares the host's cores, so both sides run beside the
    same notebook machine."""
    nb = cluster.nb
    release = nb.work / "release"
    release.unlink(missing_ok=True)
    holder = nb.popen(
        [sys.executable, "driver.py", cluster.gcs, cluster.storage, "hold"],
        env=cluster.env(nb, OMP_NUM_THREADS="1"),
        cwd=f"{DISK}/work",
        log=nb.disk / "holder.log",
    )
    try:
        from tests._machines import wait_until

        wait_until(
            "the idle session",
            lambda: "HOLDING" in (nb.disk / "holder.log").read_text() or holder.poll() is not None,
            300,
        )
        return _torchrun(cluster, hosts)
    finally:
        release.write_text("")
        holder.wait(timeout=120)


def _torchrun(cluster: Cluster, hosts: list[str]) -> float:
    machines = [next(w for w in cluster.workers if w.name == h) for h in hosts]
    procs = []
    for rank, machine in enumerate(machines):
        (machine.work / "loop.py").write_text(_loop_source("cpu", "lambda metrics: None"))
        (machine.work / "run.py").write_text(TORCHRUN)
        log = machine.disk / "torchrun.log"
        log.write_text("")
        procs.append(
            (
                machine.popen(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--nnodes",
                        "2",
                        "--nproc-per-node",
                        "1",
                        "--node-rank",
                        str(rank),
                        "--rdzv-backend",
                        "c10d",
                        "--rdzv-endpoint",
                        f"{machines[0].name}:29400",
                        f"{DISK}/work/run.py",
                    ],
                    env=cluster.env(
                        machine,
                        OMP_NUM_THREADS="1",
                        LOOP=f"{DISK}/work/loop.py",
                        # A torchrun user on machines whose names resolve to loopback
                        # must name the interface too; rtnb does it for its ranks.
                        GLOO_SOCKET_IFNAME="eth0",
                    ),
                    cwd=f"{DISK}/work",
                    log=log,
                ),
                log,
            )
        )
    for proc, _ in procs:
        proc.wait(timeout=900)
    return _result(procs[0][1].read_text(), "torchrun")["step_s"]


def one_round(cluster: Cluster, round_: int, order: list[str]) -> dict:
    forms = {
        "node": cluster.gcs,
        "client": f"ray://{cluster.head.name}:10001",
        "one": "embedded",
    }
    seen: dict[str, dict] = {}
    step = None
    if order[0] != "node":  # the peers first: torchrun on two of the worker machines
        step = _torchrun_on(cluster, [w.name for w in cluster.workers[:2]], round_)
    for form in order:
        began = time.monotonic()
        seen[form] = driver(cluster, forms[form], loop=form == "node")
        print(f"round {round_} {form}: {seen[form]} ({time.monotonic() - began:.0f} s)", flush=True)
    if step is None:  # on the machines the rtnb cell ran on
        step = _torchrun_on(cluster, seen["node"]["hosts"], round_)
    return {"seen": seen, "torchrun_step": step}


def _torchrun_on(cluster: Cluster, hosts: list[str], round_: int) -> float:
    step = torchrun(cluster, hosts)
    print(f"round {round_} torchrun on {hosts}: {step * 1000:.2f} ms/step", flush=True)
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="a 5 s DDP window, 50 cells")
    args = parser.parse_args()
    why = why_not()
    if why is not None:
        sys.exit(f"benchmarks/cluster.py: {why}")
    global TRIVIAL_CELLS
    if args.quick:
        args.window_s, TRIVIAL_CELLS = 5.0, 50
    import ddp_throughput
    from _common import emit, peer_first

    ddp_throughput.WINDOW_S = args.window_s
    cluster = Cluster()
    try:
        (cluster.nb.work / "loop.py").write_text(_loop_source("cpu", "rtnb.report"))
        (cluster.nb.work / "driver.py").write_text(DRIVER.format(cells=TRIVIAL_CELLS))
        worker = cluster.workers[1]
        rtt_remote = round_trip_us(cluster, worker, worker.name)
        rtt_local = round_trip_us(cluster, cluster.nb, "127.0.0.1")
        print(
            f"TCP round trip: notebook machine -> {worker.name} {rtt_remote:.0f} us, "
            f"loopback {rtt_local:.0f} us",
            flush=True,
        )
        rounds = []
        for round_ in range(1, args.rounds + 1):
            # run.py alternates which side goes first from one invocation to the next;
            # rounds within one invocation alternate too.
            first_peer = peer_first() != (round_ % 2 == 0)
            order = ["one", "client", "node"] if first_peer else ["node", "client", "one"]
            rounds.append(one_round(cluster, round_, order))

        def median(form: str, key: str) -> float:
            return statistics.median(r["seen"][form][key] for r in rounds)

        one = median("one", "trivial_ms")
        rtnb_step = statistics.median(r["seen"]["node"]["step"][0] for r in rounds)
        peer_step = statistics.median(r["torchrun_step"] for r in rounds)
        figures = {
            "node_trivial_ratio": median("node", "trivial_ms") / one,
            "client_trivial_ratio": median("client", "trivial_ms") / one,
            "node_trivial_ms": median("node", "trivial_ms"),
            "one_trivial_ms": one,
            "node_first_s": median("node", "first_s"),
            "client_first_s": median("client", "first_s"),
            "one_first_s": median("one", "first_s"),
            "ddp_vs_torchrun": peer_step / rtnb_step,
            "rtt_ratio": rtt_remote / rtt_local,
        }
        for name, value in figures.items():
            print(f"{name:24s} {value:10.3f}")
        emit(**figures)
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
