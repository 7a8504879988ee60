"""What local mode (``--workers 0``) costs a cell, against ``exec`` of the same code in
the same process, measured in one run of this script (CPU, this machine):

1. a training cell (a small MLP, 50 steps with a report each, ~0.3 s): rtnb's cell
   (journal written ahead, the cell thread, reports to the live store, output
   captured) vs ``exec`` of the same code with ``report`` appending to a list; the
   two alternate, 15 each, medians and their ratio (goal <= 1.05x);
2. a trivial cell (``x = 1``): the fixed cost of a cell, in milliseconds.

    .venv/bin/python benchmarks/local_overhead.py [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

SETUP = """
import torch
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data, target = torch.randn(512, 64), torch.randn(512, 1)
"""

TRAIN = """
for step in range({steps}):
    loss = torch.nn.functional.mse_loss(model(data), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    report({{"loss": loss.item()}})
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    from _common import emit, in_order

    import rtnb

    session = rtnb.Session(workers=0, storage=tempfile.mkdtemp(prefix="rtnb-bench-"))
    started = time.perf_counter()
    session.start()
    print(f"local mode started in {time.perf_counter() - started:.2f} s (no Ray)")
    quiet = lambda *_: None  # noqa: E731
    code = TRAIN.format(steps=args.steps)
    try:
        session.run(SETUP + "\nfrom rtnb import report", output=quiet)
        reports: list = []
        plain = {"report": reports.append}
        exec(SETUP, plain)
        compiled = compile(code, "<bench>", "exec")
        for _ in range(2):  # warm up both
            session.run(code, output=quiet)
            exec(compiled, plain)
        ours, theirs = [], []
        for _ in range(args.runs):
            for side in in_order("rtnb", "exec"):
                t0 = time.perf_counter()
                if side == "rtnb":
                    session.run(code, output=quiet)
                    ours.append(time.perf_counter() - t0)
                else:
                    exec(compiled, plain)
                    theirs.append(time.perf_counter() - t0)
        ratio = statistics.median(ours) / statistics.median(theirs)
        print(
            f"(1) training cell, {args.steps} steps with a report each: local mode "
            f"{statistics.median(ours) * 1e3:.1f} ms vs exec {statistics.median(theirs) * 1e3:.1f} ms "
            f"(median of {args.runs}): {ratio:.3f}x (goal <= 1.05x: {'met' if ratio <= 1.05 else 'missed'})"
        )
        trivial = []
        for _ in range(200):
            t0 = time.perf_counter()
            session.run("x = 1", output=quiet)
            trivial.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(200):
            exec("x = 1", plain)
        exec_us = (time.perf_counter() - t0) / 200 * 1e6
        print(
            f"(2) trivial cell: local mode {statistics.median(trivial) * 1e3:.2f} ms "
            f"(p95 {sorted(trivial)[int(0.95 * len(trivial))] * 1e3:.2f} ms) vs exec {exec_us:.1f} us"
        )
        emit(train_ratio=ratio)
    finally:
        session.stop()


if __name__ == "__main__":
    main()
