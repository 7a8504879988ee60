"""Memory stays bounded over a long session: one session, 2,000 short cells, 200
background cells, 100 interrupts and 50 checkpoints, with the driver's (kernel's)
and every rank's RSS sampled from cell 100 to the end.

Goal: each grows by ≤ 50 MB. An embedded 2-CPU Ray, 2 ranks, gloo, local storage.

    .venv/bin/python benchmarks/soak.py [--cells 2000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MB = 1024 * 1024
SHORT = "x = {i}\nprint('cell', {i}, 'x' * 200)\nrtnb.report({{'x': {i}}})\nx"
BACKGROUND = "for _ in range(20):\n    rtnb.report({'b': 1.0})\nprint('background', 'y' * 500)"
INTERRUPTED = "import time\nwhile True:\n    rtnb.report({'spin': 1.0})\n    time.sleep(0.002)"
CHECKPOINT = (
    "rtnb.report({{'c': {i}}}, checkpoint=rtnb.Checkpoint.from_state({{'w': torch.randn(10_000)}}))"
)


def rss(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / MB


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=2000)
    args = parser.parse_args()

    import os

    from _common import embedded_ray, emit, quiet

    import rtnb

    embedded_ray()
    session = rtnb.Session(
        workers=2, storage=tempfile.mkdtemp(prefix="rtnb-soak-"), name="soak", stop_grace_s=1.0
    ).start()
    session.run("import torch, rtnb", output=quiet)
    pids = [r.pid for r in session.group.ranks]
    counts = {"cells": 0, "background": 0, "interrupts": 0, "checkpoints": 0}
    baseline: dict[str, float] = {}
    started = time.monotonic()

    def sample() -> dict[str, float]:
        return {"kernel": rss(os.getpid()), **{f"rank {r}": rss(p) for r, p in enumerate(pids)}}

    for i in range(1, args.cells + 1):
        session.run(SHORT.format(i=i), output=quiet)
        counts["cells"] += 1
        if i % 10 == 0:
            session.run_background(BACKGROUND, output=quiet).wait(60)
            counts["background"] += 1
        if i % 20 == 0:
            handle = session.run_background(INTERRUPTED, output=quiet)
            time.sleep(0.02)
            handle.stop()
            try:
                handle.wait(60)
            except rtnb.CellInterrupted:
                counts["interrupts"] += 1
        if i % 40 == 0:
            session.run(CHECKPOINT.format(i=i), output=quiet)
            counts["checkpoints"] += 1
        if i == 100:
            baseline = sample()
    final = sample()
    elapsed = time.monotonic() - started
    assert len(session.checkpoints.list()) == counts["checkpoints"]
    session.stop()
    print(
        f"soak: {counts['cells']} cells, {counts['background']} background cells, "
        f"{counts['interrupts']} interrupts, {counts['checkpoints']} checkpoints in "
        f"{elapsed:.0f} s"
    )
    worst = 0.0
    for name in final:
        grew = final[name] - baseline[name]
        worst = max(worst, grew)
        print(
            f"  {name:7s} RSS at cell 100 {baseline[name]:7.1f} MB, at the end "
            f"{final[name]:7.1f} MB, growth {grew:+6.1f} MB"
        )
    print(f"  largest growth {worst:+.1f} MB (goal ≤ 50 MB): {'met' if worst <= 50 else 'MISSED'}")
    emit(
        kernel_growth_mb=final["kernel"] - baseline["kernel"],
        rank_growth_mb=max(final[n] - baseline[n] for n in final if n.startswith("rank")),
    )
    if worst > 50:
        sys.exit(1)


if __name__ == "__main__":
    main()
