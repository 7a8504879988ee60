"""What ``rtnb.report()`` costs, measured in one run of this script (2 ranks, gloo, CPU):

1. training loops at ~1 kHz (2 metrics), ~10 kHz (3 metrics) and ~40 kHz (2 metrics)
   with a report every step vs the same loop without (alternated, median of 9: runs
   on this VM spread by +-20%), and
   the kernel's CPU per report received during them (process time, all threads);
2. the most reports per second one rank sustains (every one reaching the driver);
3. report -> driver latency, p50/p95, at 100 reports/s per rank;
4. for contrast, Ray Train's ``ray.train.report()`` per call, tuned as peers.py says.

With ``--device cuda`` (one rank on a GPU) it measures instead what reporting a
CUDA loss every step costs a GPU loop: the loss tensor itself
(``report({"loss": loss})``, read by rtnb at the poll), ``loss.item()`` (what a
Ray Train loop writes: a GPU sync per step) and, for contrast, the bare sync.

    .venv/bin/python benchmarks/report_overhead.py [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

LOOP = """
import time, torch, rtnb
torch.set_num_threads(1)
a = torch.randn({size}, {size})
def step_work():
    t = a
    for _ in range({inner}):
        t = torch.tanh(t @ a) * 0.5
    return t
metrics = {metrics}
def run(steps, with_report):
    t0 = time.perf_counter()
    for s in range(steps):
        step_work()
        if with_report:
            rtnb.report(metrics)
    return time.perf_counter() - t0
"""

# (label, target seconds per step, matrix size, metrics reported per step, goal)
LOOPS = [
    ("~1 kHz", 1e-3, 96, {"loss": 0.5, "lr": 0.1}, 1.03),
    ("~10 kHz", 1e-4, 32, {"loss": 0.5, "lr": 0.1, "acc": 0.9}, 1.05),
    ("~40 kHz", 2.5e-5, 8, {"loss": 0.5, "lr": 0.1}, 1.10),
]


def _loop_overhead(session, quiet, target_s: float, size: int, metrics: dict, runs: int = 9):
    """(median ratio, runs, seconds per step, kernel CPU microseconds per report)."""
    inner = 4
    for _ in range(3):
        session.run(LOOP.format(inner=inner, size=size, metrics=metrics), output=quiet)
        session.run("run(200, False)", output=quiet)  # warm up
        per = max(session.run("run(1000, False) / 1000", output=quiet).values())
        inner = max(1, round(inner * target_s / per))
    session.run(LOOP.format(inner=inner, size=size, metrics=metrics), output=quiet)
    steps = max(2000, int(1.0 / target_s))
    ratios, base, cpu_per_report = [], [], []
    for _ in range(runs):
        without = max(session.run(f"run({steps}, False)", output=quiet).values())
        before = session.metrics.count()
        cpu = time.process_time()
        with_report = max(session.run(f"run({steps}, True)", output=quiet).values())
        cpu = time.process_time() - cpu
        cpu_per_report.append(cpu / max(1, session.metrics.count() - before))
        ratios.append(with_report / without)
        base.append(without / steps)
    return (
        statistics.median(ratios),
        ratios,
        statistics.median(base),
        statistics.median(cpu_per_report) * 1e6,
    )


CUDA_LOOP = """
import time, torch, rtnb
dev = rtnb.get_device()
torch.manual_seed(0)
w = torch.randn(2048, 2048, device=dev)
x = torch.randn(512, 2048, device=dev)
def step():
    return (torch.tanh(x @ w) ** 2).mean()
def run(n, mode):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        loss = step()
        if mode == "tensor":
            rtnb.report({"loss": loss})
        elif mode == "item":
            rtnb.report({"loss": loss.item()})
        elif mode == "sync":
            loss.item()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n
"""
CUDA_MODES = ("none", "tensor", "item", "sync")
CUDA_WARMUP, CUDA_ROUNDS, CUDA_STEPS = 300, 5, 3000


def main_cuda() -> None:
    from _common import quiet

    import rtnb

    with rtnb.Session(workers=1, gpu=True, storage=tempfile.mkdtemp()) as session:
        session.run(CUDA_LOOP, output=quiet)
        session.run(f"[run({CUDA_WARMUP}, m) for m in {CUDA_MODES!r}]", output=quiet)
        seen: dict[str, list[float]] = {mode: [] for mode in CUDA_MODES}
        for _ in range(CUDA_ROUNDS):
            for mode in CUDA_MODES:
                seen[mode].append(session.run(f"run({CUDA_STEPS}, {mode!r})", output=quiet)[0])
        session.metrics.flush()
        received = session.metrics.count(0)
    # Two of the ways report every step: "tensor" and "item".
    sent = 2 * (CUDA_WARMUP + CUDA_ROUNDS * CUDA_STEPS)
    step = {mode: statistics.median(values) for mode, values in seen.items()}
    print(
        f"report_overhead --device cuda: 1 rank, a CUDA loop, {CUDA_ROUNDS} x {CUDA_STEPS} "
        "steps per way, median"
    )
    for mode, label in (
        ("none", "no report"),
        ("tensor", 'report({"loss": loss})'),
        ("item", 'report({"loss": loss.item()})'),
        ("sync", "loss.item() alone"),
    ):
        print(
            f"  {label:30s} {step[mode] * 1e6:8.1f} us/step   {step[mode] / step['none']:.3f}x "
            "the loop without reports"
        )
    print(f"  reports received: {received:,} (sent {sent:,})")


def _ray_train_report_cost() -> float:
    """Seconds per ``ray.train.report()`` call on 2 workers, tuned as peers.py says."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cost_file = tempfile.mktemp(prefix="rtnb-raytrain-cost-")

    def loop(config):
        import time as _t

        import ray.train as rt

        costs = []
        for i in range(4):
            t0 = _t.perf_counter()
            rt.report({"i": i})
            costs.append(_t.perf_counter() - t0)
        if rt.get_context().get_world_rank() == 0:
            with open(config["cost_file"], "w") as out:
                out.write(str(sum(costs) / len(costs)))

    trainer = TorchTrainer(
        loop,
        train_loop_config={"cost_file": cost_file},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=tempfile.mkdtemp()),
    )
    trainer.fit()
    with open(cost_file) as src:
        return float(src.read())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="two loop speeds, 3 runs each")
    args = parser.parse_args()
    if args.device == "cuda":
        main_cuda()
        return

    from _common import embedded_ray, emit, peer_first, quiet
    from peers import ray_train_env

    import rtnb

    # Ray Train's controller reads its settings from the environment Ray starts with.
    os.environ.update(ray_train_env())
    embedded_ray()
    ray_train_cost = _ray_train_report_cost() if peer_first() else None
    session = rtnb.Session(workers=2, storage=tempfile.mkdtemp(prefix="rtnb-bench-")).start()

    runs = 3 if args.quick else 9
    loops = [
        (label, goal, _loop_overhead(session, quiet, target, size, metrics, runs))
        for label, target, size, metrics, goal in (LOOPS[:2] if args.quick else LOOPS)
    ]

    # Max sustained rate: report as fast as possible for 2 s; all must reach the driver.
    session.run("1", output=quiet)
    session.metrics.flush()
    before = {r: session.metrics.count(r) for r in (0, 1)}
    sent = session.run(
        "import time, rtnb\nn = 0\nend = time.perf_counter() + 2.0\n"
        "while time.perf_counter() < end:\n    rtnb.report({'x': 1.0})\n    n += 1\nn",
        output=quiet,
    )
    received = {r: session.metrics.count(r) - before[r] for r in (0, 1)}
    rate = min(sent.values()) / 2.0

    # Latency: the record's wall time on the rank vs its arrival at the driver.
    latencies: list[float] = []
    unsubscribe = session.metrics.subscribe(
        lambda rank, batch: latencies.extend(time.time() - t for t in batch.times)
    )
    session.run(
        "import time, rtnb\nfor i in range(300):\n    rtnb.report({'y': i})\n    time.sleep(0.01)",
        output=quiet,
    )
    unsubscribe()
    session.stop()
    latencies.sort()
    p50 = latencies[len(latencies) // 2]
    p95 = latencies[int(len(latencies) * 0.95)]

    if ray_train_cost is None:
        ray_train_cost = _ray_train_report_cost()

    print("report_overhead: 2 ranks, gloo, CPU, embedded Ray (2 CPUs)")
    for label, goal, (ratio, runs, per_step, cpu_us) in loops:
        print(
            f"1. {label} loop ({per_step * 1e6:.0f} us/step), report every step: {ratio:.3f}x the "
            f"loop without (runs: {', '.join(f'{r:.3f}' for r in runs)}; goal <= {goal:.2f}x); "
            f"kernel CPU {cpu_us:.2f} us per report (goal <= 2 us)"
        )
    print(
        f"2. sustained reports/s per rank: {rate:,.0f} (goal >= 200,000); "
        f"sent {dict(sent)} received {received}"
    )
    print(
        f"3. report -> driver latency: p50 {p50 * 1e3:.0f} ms, p95 {p95 * 1e3:.0f} ms (goal p95 <= 150 ms), n={len(latencies)}"
    )
    print(
        f"4. Ray Train report(), tuned (peers.py), same run: {ray_train_cost * 1e3:,.0f} ms per call "
        f"(rtnb at the sustained rate: {1e6 / rate:.1f} us per call)"
    )
    by_label = {label: figures for label, _goal, figures in loops}
    emit(
        loop_1khz=by_label["~1 kHz"][0],
        loop_10khz=by_label["~10 kHz"][0],
        # At 10 kHz: at 1 kHz the driver's fixed per-poll cost is spread over 10x
        # fewer reports (~15 us each), which is not what the goal is about.
        kernel_us_per_report=by_label["~10 kHz"][3],
        reports_per_s=rate,
        p95_ms=p95 * 1e3,
        ray_train_per_call=ray_train_cost / (1.0 / rate),
    )


if __name__ == "__main__":
    main()
