"""Whether the relay through rank 0 pays for itself: a warm trivial cell on a group
whose cells go through rank 0's relay (rtnb's way from 4 ranks) against the same
cell on a group of the same size that calls every rank directly (its way under 4).

For each size both groups run side by side in one process and one embedded Ray
(fractional CPUs), and cells alternate between them in blocks, so the machine's
drift hits both alike. Printed: each size's medians and relayed / direct.

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


def _started(size: int, relay: bool):
    import rtnb
    from rtnb.driver.ranks import _group

    kept = _group.RELAY_FROM_RANKS
    # The group decides at its start whether it relays (from RELAY_FROM_RANKS ranks):
    # each group here is started with the threshold at its size, or out of its reach.
    _group.RELAY_FROM_RANKS = size if relay else 1_000_000
    try:
        session = rtnb.Session(workers=size, cpus_per_worker=0.9 / size).start()
    finally:
        _group.RELAY_FROM_RANKS = kept
    return session


def phase(size: int, cells: int) -> dict:
    from _common import embedded_ray, quiet

    embedded_ray()
    relayed, direct = _started(size, True), _started(size, False)
    try:
        for session in (relayed, direct):
            for _ in range(10):
                session.run("1", output=quiet)
        times: dict[str, list[float]] = {"relayed": [], "direct": []}
        while len(times["relayed"]) < cells:
            for name, session in (("relayed", relayed), ("direct", direct)):
                for _ in range(10):
                    t0 = time.perf_counter()
                    session.run("1", output=quiet)
                    times[name].append(time.perf_counter() - t0)
    finally:
        relayed.stop()
        direct.stop()
    return {name: statistics.median(values) for name, values in times.items()}


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
        print(
            f"{size:>3} ranks: relayed {got['relayed'] * 1e3:6.1f} ms, direct "
            f"{got['direct'] * 1e3:6.1f} ms, relayed / direct {ratio:.2f}x",
            flush=True,
        )
        figures[f"relay_{size}_ratio"] = ratio
    emit(**figures)


if __name__ == "__main__":
    main()
