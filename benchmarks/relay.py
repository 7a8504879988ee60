"""Whether going through rank 0 pays for itself, on each path a cell can take.

Without an open channel to the ranks (a Ray Client, ``RTNB_OPEN_CHANNEL=0``): a warm
trivial cell on a group whose cells go through rank 0's relay (rtnb's way there
from 4 ranks) against the same cell on a group of the same size that makes a Ray
call to every rank (its way under 4). On the open channel (rtnb's way wherever the
kernel reaches the ranks): a group whose kernel sends each rank its cell, against
one whose cells fan out through rank 0 (rtnb's way from ``FANOUT_FROM_RANKS``),
by wall time and by the kernel's CPU per cell (its main thread: the ranks' CPU on
this small machine is the rest).

For each size the groups run side by side in one process and one embedded Ray
(fractional CPUs), and cells alternate between them in blocks, so the machine's
drift hits all alike. Printed: each size's medians, relayed / direct, the channel /
the better Ray path, and fanned out / each rank directly on the channel.

    .venv/bin/python benchmarks/relay.py [--sizes 2,4,8,16] [--cells 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _started(size: int, relay: bool | None, fan: bool = False):
    """A group of ``size`` on Ray's calls, relayed or not; None: on its channel,
    its cells fanned out through rank 0 or not."""
    import os

    import rtnb
    from rtnb.driver.ranks import _group

    kept = _group.RELAY_FROM_RANKS, _group.FANOUT_FROM_RANKS
    # The group decides at its start whether it goes through rank 0 (from a number
    # of ranks): each group here is started with the threshold at its size, or out
    # of its reach.
    _group.RELAY_FROM_RANKS = size if relay else 1_000_000
    _group.FANOUT_FROM_RANKS = size if fan else 1_000_000
    if relay is not None:
        os.environ["RTNB_OPEN_CHANNEL"] = "0"
    try:
        session = rtnb.Session(workers=size, cpus_per_worker=0.45 / size).start()
    finally:
        _group.RELAY_FROM_RANKS, _group.FANOUT_FROM_RANKS = kept
        os.environ.pop("RTNB_OPEN_CHANNEL", None)
    return session


def phase(size: int, cells: int) -> dict:
    from _common import embedded_ray, quiet

    embedded_ray()
    sides = {
        "relayed": _started(size, True),
        "direct": _started(size, False),
        "channel": _started(size, None),
        "fanned": _started(size, None, fan=True),
    }
    try:
        for session in sides.values():
            for _ in range(10):
                session.run("1", output=quiet)
        times: dict[str, list[float]] = {name: [] for name in sides}
        cpu: dict[str, float] = dict.fromkeys(sides, 0.0)
        while len(times["relayed"]) < cells:
            for name, session in sides.items():
                used = time.thread_time()
                for _ in range(10):
                    t0 = time.perf_counter()
                    session.run("1", output=quiet)
                    times[name].append(time.perf_counter() - t0)
                cpu[name] += time.thread_time() - used
    finally:
        for session in sides.values():
            session.stop()
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {**medians, **{f"{name}_cpu": cpu[name] / len(times[name]) for name in sides}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", type=int, default=0)
    parser.add_argument("--sizes", default="2,4,8,16")
    parser.add_argument("--cells", type=int, default=60)
    args = parser.parse_args()
    if args.phase:
        print("RESULT " + json.dumps(phase(args.phase, args.cells)))
        return
    from _common import emit, run_phase

    figures = {}
    for size in [int(s) for s in args.sizes.split(",")]:
        got = run_phase(
            __file__,
            ["--phase", str(size), "--cells", str(args.cells)],
            f"{size} ranks",
            900,
        )
        ratio = got["relayed"] / got["direct"]
        channel = got["channel"] / min(got["relayed"], got["direct"])
        fanned = got["fanned"] / got["channel"]
        fanned_cpu = got["fanned_cpu"] / got["channel_cpu"]
        print(
            f"{size:>3} ranks: relayed {got['relayed'] * 1e3:6.1f} ms, direct "
            f"{got['direct'] * 1e3:6.1f} ms, relayed / direct {ratio:.2f}x; on the open "
            f"channel {got['channel'] * 1e3:6.1f} ms = {channel:.2f}x the better; fanned out "
            f"through rank 0 {got['fanned'] * 1e3:6.1f} ms = {fanned:.2f}x, the kernel's CPU "
            f"{got['fanned_cpu'] * 1e3:.2f} ms against {got['channel_cpu'] * 1e3:.2f} ms "
            f"= {fanned_cpu:.2f}x",
            flush=True,
        )
        figures[f"relay_{size}_ratio"] = ratio
        figures[f"channel_{size}_ratio"] = channel
        figures[f"fanout_{size}_ratio"] = fanned
        figures[f"fanout_cpu_{size}_ratio"] = fanned_cpu
    emit(**figures)


if __name__ == "__main__":
    main()
