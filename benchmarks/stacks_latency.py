"""How long ``%rtnb stacks`` takes on 2 ranks while a training cell runs (goal ≤ 200 ms).

One run of this script, an embedded 2-CPU Ray: a 2-rank group runs a loop of
matrix products, an ``all_reduce`` and a ``report()`` per step in a background
cell; ``session.stacks()`` is timed 40 times (p50, p95, max). The peer is what
users are told to do for a stuck distributed job: ``py-spy dump`` of every rank's
process, the two dumps started at once and `--nonblocking` (the peer at its fastest; the same two
processes, timed the same way; the two sides' reads alternate between rounds). Also: the
loop's step time with stacks read twice a second against without, so reading them
is shown not to slow the training.

    .venv/bin/python benchmarks/stacks_latency.py [--quick]
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time

LOOP = """
import time, torch, torch.distributed as dist, rtnb
torch.set_num_threads(1)
a = torch.randn(128, 128)
def train(steps):
    # A count of steps, never a deadline: ranks that stop on their own clocks leave
    # a peer in its next all_reduce (the hang %rtnb stacks is for).
    t0 = time.perf_counter()
    for _ in range(steps):
        t = torch.tanh(a @ a)
        dist.all_reduce(t)
        rtnb.report({"loss": float(t[0, 0])})
    return (time.perf_counter() - t0) / steps
"""


def _percentiles(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    return (
        statistics.median(ordered) * 1e3,
        ordered[int(0.95 * (len(ordered) - 1))] * 1e3,
        ordered[-1] * 1e3,
    )


def main() -> None:
    import sys

    from _common import embedded_ray, emit, in_order, quiet

    quick = "--quick" in sys.argv

    import rtnb
    from rtnb.driver.tools._hang_doctor import py_spy_path

    embedded_ray()
    session = rtnb.Session(workers=2, storage=tempfile.mkdtemp(prefix="rtnb-bench-")).start()
    try:
        session.run(LOOP, output=quiet)
        per_step = max(session.run("train(500)", output=quiet).values())  # warm up
        handle = session.run_background(f"train({int(60 / per_step)})", output=quiet)
        time.sleep(1.0)
        pids = [info.pid for info in session.group.ranks]
        spy = py_spy_path()
        if spy is None:
            raise SystemExit("py-spy is not installed: it is the peer of this benchmark")
        ours, theirs = [], []
        peer_failed: str | None = None
        reads = 20 if quick else 40
        for side in in_order("rtnb", "py-spy"):
            for _ in range(reads if side == "rtnb" else reads // 4):
                if side == "py-spy" and peer_failed:
                    break
                began = time.perf_counter()
                if side == "rtnb":
                    stacks = session.stacks()
                    ours.append(time.perf_counter() - began)
                    assert all(s.cell_frame is not None for s in stacks.stacks.values()), (
                        stacks.text()
                    )
                else:
                    # The peer at its fastest: every rank's dump started at once, and
                    # --nonblocking (the process is read without pausing it).
                    dumps = [
                        subprocess.Popen(
                            [spy, "dump", "--nonblocking", "--pid", str(pid)],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE,
                        )
                        for pid in pids
                    ]
                    failed = [dump for dump in dumps if dump.wait() != 0]
                    if failed:
                        # Reading a running process without pausing it can race
                        # (py-spy: "Bad address"): the peer's failure, this round's.
                        peer_failed = _first_error(failed[0].stderr.read().decode())
                        continue
                    theirs.append(time.perf_counter() - began)
                time.sleep(0.1)
        handle.stop()
        try:
            handle.wait(30)
        except rtnb.CellInterrupted:
            pass
        # The training loop's step time with stacks read twice a second, and without.
        without, reading = [], []
        for _ in range(1 if quick else 3):
            steps = int(3 / per_step)
            without.append(max(session.run(f"train({steps})", output=quiet).values()))
            handle = session.run_background(f"train({steps})", output=quiet)
            while not handle.done():
                session.stacks()
                time.sleep(0.5)
            reading.append(max(handle.wait(30).values()))
    finally:
        session.stop()
    p50, p95, worst = _percentiles(ours)
    print(
        f"%rtnb stacks on 2 ranks during training: p50 {p50:.1f} ms, p95 {p95:.1f} ms, max {worst:.1f} ms (goal ≤ 200 ms)"
    )
    stacks_ratio: float | None = None
    if peer_failed:
        print(f"py-spy dump --nonblocking failed after {len(theirs)} reads: {peer_failed}")
    else:
        t50, t95, tmax = _percentiles(theirs)
        stacks_ratio = p50 / t50
        print(
            f"py-spy dump --nonblocking of both ranks' processes at once: p50 {t50:.1f} ms, "
            f"p95 {t95:.1f} ms, max {tmax:.1f} ms; ratio rtnb/py-spy (p50): {stacks_ratio:.2f}x"
        )
    ratio = statistics.median(reading) / statistics.median(without)
    print(
        f"step time with stacks read every 0.5 s vs without: {statistics.median(reading) * 1e3:.2f} "
        f"vs {statistics.median(without) * 1e3:.2f} ms ({ratio:.3f}x)"
    )
    emit(
        peer_failed={"stacks_ratio": peer_failed} if peer_failed else None,
        stacks_ratio=stacks_ratio,
        stacks_ms=p50,
    )


def _first_error(stderr: str) -> str:
    """py-spy's own line of why (its backtrace follows it)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith("Error")), lines[0] if lines else "")
    return f"py-spy dump failed: {said[:200]}"


if __name__ == "__main__":
    main()
