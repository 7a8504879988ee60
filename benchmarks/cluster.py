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

    .venv/bin/python benchmarks/cluster.py [--rounds 3] [--window-s 10]

Needs root and iproute2 (machines are namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
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
kwargs = {{}} if address == "embedded" else {{"address": address, "storage": storage}}
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


def torchrun(cluster: Cluster, hosts: list[str]) -> float:
    """One DDP window under torchrun on the two machines named ``hosts``."""
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=10.0)
    args = parser.parse_args()
    why = why_not()
    if why is not None:
        sys.exit(f"benchmarks/cluster.py: {why}")
    os.environ["RTNB_BENCH_WINDOW_S"] = str(args.window_s)
    import ddp_throughput

    ddp_throughput.WINDOW_S = args.window_s
    cluster = Cluster()
    try:
        (cluster.nb.work / "loop.py").write_text(_loop_source("cpu", "rtnb.report"))
        forms = {
            "node": cluster.gcs,
            "client": f"ray://{cluster.head.name}:10001",
            "one machine": "embedded",
        }
        seen: dict[str, list[dict]] = {k: [] for k in forms}
        torchrun_steps: list[float] = []
        for round_ in range(args.rounds):
            order = list(forms) if round_ % 2 == 0 else list(reversed(forms))
            for form in order:
                began = time.monotonic()
                seen[form].append(driver(cluster, forms[form], loop=form == "node"))
                print(
                    f"round {round_ + 1} {form}: {seen[form][-1]} ({time.monotonic() - began:.0f} s)",
                    flush=True,
                )
            hosts = seen["node"][-1]["hosts"]
            torchrun_steps.append(torchrun(cluster, hosts))
            print(
                f"round {round_ + 1} torchrun on {hosts}: {torchrun_steps[-1] * 1000:.2f} ms/step",
                flush=True,
            )
        one = statistics.median(r["trivial_ms"] for r in seen["one machine"])
        figures: dict[str, float] = {}
        for form in forms:
            figures[f"{form} first result s"] = statistics.median(r["first_s"] for r in seen[form])
            figures[f"{form} trivial ms"] = statistics.median(r["trivial_ms"] for r in seen[form])
            figures[f"{form} trivial / one machine"] = (
                statistics.median(r["trivial_ms"] for r in seen[form]) / one
            )
        rtnb_step = statistics.median(r["step"][0] for r in seen["node"])
        peer_step = statistics.median(torchrun_steps)
        figures["DDP step rtnb ms"] = rtnb_step * 1000
        figures["DDP step torchrun ms"] = peer_step * 1000
        figures["DDP throughput rtnb / torchrun"] = peer_step / rtnb_step
        print()
        for name, value in figures.items():
            print(f"{name:36s} {value:10.3f}")
        print("FIGURES " + json.dumps(figures), flush=True)
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
