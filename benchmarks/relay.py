"""Whether the relay through rank 0 pays for itself where the kernel has no open
channel to the ranks (a Ray Client, ``RTNB_OPEN_CHANNEL=0``): a warm trivial cell on
a group whose cells go through rank 0's relay (rtnb's way there from 4 ranks)
against the same cell on a group of the same size that makes a Ray call to every
rank (its way under 4), and beside them a group of that size on its open channel
(rtnb's way wherever the kernel reaches the ranks: no relay).

For each size the groups run side by side in one process and one embedded Ray
(fractional CPUs), and cells alternate between them in blocks, so the machine's
drift hits all alike. Printed: each size's medians, relayed / direct, and the
channel / the better of the two.

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


def _started(size: int, relay: bool | None):
    """A group of ``size`` on Ray's calls, relayed or not; None: on its channel."""
    import os

    import rtnb
    from rtnb.driver.ranks import _group

    kept = _group.RELAY_FROM_RANKS
    # The group decides at its start whether it relays (from RELAY_FROM_RANKS ranks):
    # each group here is started with the threshold at its size, or out of its reach.
    _group.RELAY_FROM_RANKS = size if relay else 1_000_000
    if relay is not None:
        os.environ["RTNB_OPEN_CHANNEL"] = "0"
    try:
        session = rtnb.Session(workers=size, cpus_per_worker=0.6 / size).start()
    finally:
        _group.RELAY_FROM_RANKS = kept
        os.environ.pop("RTNB_OPEN_CHANNEL", None)
    return session


def phase(size: int, cells: int) -> dict:
    from _common import embedded_ray, quiet

    embedded_ray()
    sides = {
        "relayed": _started(size, True),
        "direct": _started(size, False),
        "channel": _started(size, None),
    }
    try:
        for session in sides.values():
            for _ in range(10):
                session.run("1", output=quiet)
        times: dict[str, list[float]] = {name: [] for name in sides}
        while len(times["relayed"]) < cells:
            for name, session in sides.items():
                for _ in range(10):
                    t0 = time.perf_counter()
                    session.run("1", output=quiet)
                    times[name].append(time.perf_counter() - t0)
    finally:
        for session in sides.values():
            session.stop()
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
        channel = got["channel"] / min(got["relayed"], got["direct"])
        print(
            f"{size:>3} ranks: relayed {got['relayed'] * 1e3:6.1f} ms, direct "
            f"{got['direct'] * 1e3:6.1f} ms, relayed / direct {ratio:.2f}x; on the open "
            f"channel {got['channel'] * 1e3:6.1f} ms = {channel:.2f}x the better",
            flush=True,
        )
        figures[f"relay_{size}_ratio"] = ratio
        figures[f"channel_{size}_ratio"] = channel
    emit(**figures)


if __name__ == "__main__":
    main()
