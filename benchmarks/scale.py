"""How rtnb's costs grow with the number of ranks, on one machine.

For each world size (default 2, 4, 8, 16, 32; fractional CPUs so every size fits
this 2-core machine) one fresh process with an embedded Ray measures:

- start: ``Session.start()`` without its embedded ``ray.init`` (placement, rank
  processes, gloo), with every phase's seconds;
- trivial cell: median of a warm ``1`` cell, and the kernel's CPU per such cell
  (process time over the 40 cells, all its threads: what the driver's work costs,
  apart from the ranks' CPU, which on 2 cores bounds the wall time at 32 ranks);
- stacks: ``session.stacks()`` (the hang doctor's read of every rank's stack, what
  ``%rtnb stacks`` shows) while a cell runs, median of 5;
- print cell: a cell in which every rank prints 100 lines (all of them delivered);
- ingest: the kernel's CPU (process time / wall time, all threads) while every rank
  reports 100 times a second for 5 s, first without a view, then with the live
  widget attached and redrawing; every report is counted as received;
- commit: a cell in which every rank saves a 64 kB shard and reports it (the
  driver commits it once every rank's shard landed).

Ratios are printed against the 2-rank figures of the same run.

    .venv/bin/python benchmarks/scale.py [--sizes 2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

REPORT_CELL = """
import time, rtnb
sent = 0
next_at = time.perf_counter()
stop_at = next_at + SECONDS
while next_at < stop_at:
    rtnb.report({"loss": 1.0 / (sent + 1), "lr": 0.1})
    sent += 1
    next_at += 0.01
    time.sleep(max(0.0, next_at - time.perf_counter()))
sent
"""

SAVE_CELL = """
import torch, rtnb
rtnb.report({"saved": 1.0}, checkpoint=rtnb.Checkpoint.from_state({"w": torch.zeros(16384)}))
"""


def _cpu_while(session, code: str, *, view: bool) -> tuple[float, int, int]:
    """(kernel CPU share, reports sent, reports received) while ``code`` runs."""
    from _common import quiet

    if view:
        from rtnb.widgets import LiveMetrics
    before = session.metrics.count()
    widget = None
    handle = session.run_background(code, output=quiet)
    if view:
        widget = LiveMetrics(session.metrics, handle)
    wall, cpu = time.perf_counter(), time.process_time()
    sent = handle.wait(120)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if widget is not None:
        widget.redraw()
        widget.close()
    return cpu / wall, sum(sent.values()), session.metrics.count() - before


def phase(world: int) -> dict:
    import ray
    from _common import quiet

    import rtnb

    storage = tempfile.mkdtemp(prefix="rtnb-scale-")
    # rtnb's own embedded Ray, as %rtnb start makes it; the start below excludes it.
    session = rtnb.Session(workers=world, cpus_per_worker=1.9 / world, storage=storage)
    session.start()
    start_s = session.last_start.total_s - session.last_start.seconds("Ray")
    phases = str(session.last_start)
    for _ in range(10):
        session.run("1", output=quiet)
    trivial = []
    cpu = time.process_time()
    for _ in range(40):
        t0 = time.perf_counter()
        session.run("1", output=quiet)
        trivial.append(time.perf_counter() - t0)
    trivial_cpu_s = (time.process_time() - cpu) / 40
    handle = session.run_background(
        "import time\nfor _ in range(3000):\n    time.sleep(0.01)", output=quiet
    )
    stacks = []
    for _ in range(6):
        t0 = time.perf_counter()
        got = session.stacks()
        stacks.append(time.perf_counter() - t0)
        assert len(got.stacks) == world, got.text()
    handle.stop()
    with contextlib.suppress(Exception):  # the stopped cell's own ending
        handle.wait(60)
    lines = []
    t0 = time.perf_counter()
    session.run(
        "for i in range(100):\n    print('line', i)",
        output=lambda rank, stream, text: lines.append(text) if rank >= 0 else None,
    )
    print_s = time.perf_counter() - t0
    printed = sum(text.count("\n") for text in lines)
    code = REPORT_CELL.replace("SECONDS", "5.0")
    cpu_plain, sent, got = _cpu_while(session, code, view=False)
    try:
        cpu_view, sent_v, got_v = _cpu_while(session, code, view=True)
    except ImportError:  # no ipywidgets/plotly here (a bare GPU machine): no view figure
        cpu_view, sent_v, got_v = float("nan"), 0, 0
    t0 = time.perf_counter()
    session.run(SAVE_CELL, output=quiet)
    commit_s = time.perf_counter() - t0
    committed = session.checkpoints.latest()
    session.stop()
    ray.shutdown()
    return {
        "world": world,
        "start_s": start_s,
        "phases": phases,
        "trivial_s": statistics.median(trivial),
        "trivial_cpu_s": trivial_cpu_s,
        "stacks_s": statistics.median(stacks[1:]),
        "print_s": print_s,
        "printed": printed,
        "cpu_plain": cpu_plain,
        "cpu_view": cpu_view,
        "sent": sent + sent_v,
        "received": got + got_v,
        "commit_s": commit_s,
        "committed_ranks": len(committed.ranks) if committed else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", type=int)
    parser.add_argument("--sizes", default="2,4,8,16,32")
    args = parser.parse_args()
    if args.phase:
        print("RESULT " + json.dumps(phase(args.phase)))
        return
    from _common import emit, run_phase

    sizes = [int(x) for x in args.sizes.split(",")]
    print(f"scale: rtnb's embedded Ray (2 CPUs), ranks with 1.9/N CPUs each, sizes {sizes}")
    rows = []
    for world in sizes:
        rows.append(run_phase(__file__, ["--phase", str(world)], f"{world} ranks", 1800))
        r = rows[-1]
        print(
            f"{world:3d} ranks: start {r['start_s']:6.1f} s | trivial cell {r['trivial_s'] * 1e3:6.1f} ms"
            f" (kernel CPU {r['trivial_cpu_s'] * 1e3:5.2f} ms) | stacks {r['stacks_s'] * 1e3:5.0f} ms"
            f" | 100 lines/rank {r['print_s'] * 1e3:6.0f} ms ({r['printed']} lines)"
            f" | kernel CPU at 100 reports/s/rank {r['cpu_plain'] * 100:4.1f}% "
            f"(with live view {r['cpu_view'] * 100:4.1f}%), {r['received']}/{r['sent']} received"
            f" | commit {r['commit_s'] * 1e3:5.0f} ms ({r['committed_ranks']} shards)"
            f" [{r['phases']}]",
            flush=True,
        )
    base = rows[0]
    print()
    for r in rows[1:]:
        print(
            f"{r['world']:3d} vs {base['world']} ranks: trivial cell {r['trivial_s'] / base['trivial_s']:.1f}x"
            f" (goal <= 2x at 32), the kernel's CPU per trivial cell"
            f" {r['trivial_cpu_s'] / base['trivial_cpu_s']:.1f}x, kernel CPU {r['cpu_plain'] * 100:.1f}% (goal <= 10% at 32),"
            f" stacks {r['stacks_s'] / base['stacks_s']:.1f}x, start {r['start_s'] / base['start_s']:.1f}x"
        )
    largest = rows[-1]
    emit(
        trivial_ratio_max=largest["trivial_s"] / base["trivial_s"],
        trivial_cpu_ratio_max=largest["trivial_cpu_s"] / base["trivial_cpu_s"],
        kernel_cpu_max=largest["cpu_plain"] * 100,
        stacks_ratio_max=largest["stacks_s"] / base["stacks_s"],
        stacks_ms_max=largest["stacks_s"] * 1e3,
    )


if __name__ == "__main__":
    main()
