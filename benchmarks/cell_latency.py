"""Cell latency of rtnb against its peers, measured in one run of this script.

(a) a warm trivial %%rtrain cell vs a plain Ray actor exec round trip (2 ranks), with
    beside it the same cell with the open channel off (``RTNB_OPEN_CHANNEL=0``: every
    call a Ray actor call, as through a Ray Client) and an echo through Ray's own
    Compiled Graph (``experimental_compile``) to 2 actors, the other open channel;
(b) lifecycle cost, not loop speed: a 20-step DDP SGD loop re-run in a live group vs
    a warm TorchTrainer.fit() of the same loop (which starts and stops its workers),
    tuned as peers.py says (and at Ray Train's defaults without --quick);
(c) start to ready: ``Session.start()`` after ``ray.init`` vs the first
    ``TorchTrainer.fit()``'s time from the call to its loop starting on the workers
    (both exclude ``ray.init``);

Each side runs in its own fresh process with an embedded 2-CPU Ray (Ray Train's
health-check interval is read when Ray starts), then the ratios are printed.

    .venv/bin/python benchmarks/cell_latency.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def phase_rtnb(repeats: int) -> dict:
    import ray
    from _common import embedded_ray, quiet
    from _loop import LOOP_SOURCE

    import rtnb

    ray_init_s = embedded_ray()
    t0 = time.perf_counter()
    # 0.9 CPU a rank (one thread each, as at 1.0) leaves Ray room to place the ranks
    # of (a)'s session without the channel, which ask for none.
    session = rtnb.Session(workers=2, cpus_per_worker=0.9).start()
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    session.run(LOOP_SOURCE, output=quiet)
    first_loop_s = time.perf_counter() - t0
    loop_s = []
    for _ in range(max(5, repeats // 20)):
        t0 = time.perf_counter()
        session.run(LOOP_SOURCE, output=quiet)
        loop_s.append(time.perf_counter() - t0)

    # (a) alternates blocks of each side in this one process and Ray, so the
    # machine's drift hits all alike. The peers take no CPU of Ray's accounting (the
    # session's ranks hold both CPUs), nor does the session whose calls are Ray's.
    from ray.dag import InputNode, MultiOutputNode

    @ray.remote(num_cpus=0)
    class Plain:
        def __init__(self):
            self.ns = {}

        def exec(self, code):
            return eval(compile(code, "<plain>", "eval"), self.ns)

    os.environ["RTNB_OPEN_CHANNEL"] = "0"
    try:
        through_ray = rtnb.Session(workers=2, cpus_per_worker=0).start()
    finally:
        del os.environ["RTNB_OPEN_CHANNEL"]
    assert session.group.channel_ranks == [0, 1] and not through_ray.group.channel_ranks
    actors = [Plain.remote() for _ in range(2)]
    compiled_actors = [Plain.remote() for _ in range(2)]
    with InputNode() as code:
        dag = MultiOutputNode([a.exec.bind(code) for a in compiled_actors])
    compiled = dag.experimental_compile()
    sides = {
        "trivial": lambda: session.run("1", output=quiet),
        "trivial_ray": lambda: through_ray.run("1", output=quiet),
        "plain": lambda: ray.get([a.exec.remote("1") for a in actors]),
        "compiled": lambda: ray.get(compiled.execute("1")),
    }
    for _ in range(20):
        for call in sides.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in sides}
    block = max(10, repeats // 6)
    while len(times["trivial"]) < repeats:
        for name, call in sides.items():
            for _ in range(block):
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
    compiled.teardown()
    through_ray.stop()
    session.stop()
    return {
        "ray_init_s": ray_init_s,
        "start_s": start_s,
        "first_loop_s": first_loop_s,
        "loop_s": statistics.median(loop_s),
        **{f"{name}_s": statistics.median(taken) for name, taken in times.items()},
    }


def phase_trainer(fits: int) -> dict:
    from _common import embedded_ray
    from _loop import train_loop_per_worker
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray_init_s = embedded_ray()
    storage = tempfile.mkdtemp(prefix="rtnb-bench-")
    times, ready = [], []
    for i in range(fits):
        stamp = os.path.join(storage, f"ready-{i}")
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"stamp_file": stamp},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(name=f"fit{i}", storage_path=storage),
        )
        called = time.time()
        t0 = time.perf_counter()
        trainer.fit()
        times.append(time.perf_counter() - t0)
        with open(stamp) as src:
            ready.append(float(src.read()) - called)
    return {
        "ray_init_s": ray_init_s,
        "first_fit_s": times[0],
        "warm_fit_s": times[-1],
        "first_ready_s": ready[0],
    }


def _run_phase(name: str, env_extra: dict[str, str], arg: int) -> dict:
    from _common import run_phase

    return run_phase(
        __file__, ["--phase", name, "--arg", str(arg)], f"phase {name}", 900, env_extra
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", default=None)
    parser.add_argument("--arg", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="fewer cells; no Ray Train defaults row"
    )
    parser.add_argument(
        "--trivial-only",
        type=int,
        default=0,
        metavar="N",
        help="only (a), in N fresh processes, each ratio printed",
    )
    args = parser.parse_args()
    if args.phase == "rtnb":
        print("RESULT " + json.dumps(phase_rtnb(args.arg)))
        return
    if args.phase == "trainer":
        print("RESULT " + json.dumps(phase_trainer(args.arg)))
        return

    if args.trivial_only:
        ratios = []
        for run in range(args.trivial_only):
            r = _run_phase("rtnb", {}, 300)
            ratios.append(r["trivial_s"] / r["plain_s"])
            print(
                f"(a) run {run + 1}: rtnb {r['trivial_s'] * 1e3:.2f} ms (through Ray's calls "
                f"{r['trivial_ray_s'] * 1e3:.2f} ms), plain Ray actors {r['plain_s'] * 1e3:.2f} ms, "
                f"Compiled Graph {r['compiled_s'] * 1e3:.2f} ms; ratio {ratios[-1]:.2f}x",
                flush=True,
            )
        print(
            f"(a) {len(ratios)} runs: ratios {', '.join(f'{x:.2f}' for x in ratios)}; "
            f"worst {max(ratios):.2f}x, median {statistics.median(ratios):.2f}x (goal <= 0.75x in every run)"
        )
        return
    from _common import emit, in_order
    from peers import ray_train_env

    print(
        "cell_latency: 2 ranks, gloo, CPU; each side in a fresh process with embedded Ray (2 CPUs)"
    )
    repeats = 100 if args.quick else 300
    sides = {}
    for side in in_order("rtnb", "trainer"):
        if side == "rtnb":
            sides["rtnb"] = _run_phase("rtnb", {}, repeats)
        else:
            sides["trainer"] = _run_phase("trainer", ray_train_env(), 2)
    r, tuned = sides["rtnb"], sides["trainer"]
    default = None if args.quick else _run_phase("trainer", ray_train_env(tuned=False), 2)

    print()
    print(
        f"(a) warm trivial cell        rtnb {r['trivial_s'] * 1e3:7.2f} ms   plain Ray actors {r['plain_s'] * 1e3:7.2f} ms"
        f"   ratio {r['trivial_s'] / r['plain_s']:.2f}x  (goal <= 0.75x)"
    )
    print(
        f"    the channel off (Ray's calls) {r['trivial_ray_s'] * 1e3:7.2f} ms = "
        f"{r['trivial_ray_s'] / r['plain_s']:.2f}x plain; Ray Compiled Graph echo "
        f"{r['compiled_s'] * 1e3:.2f} ms (rtnb's cell {r['trivial_s'] / r['compiled_s']:.2f}x it)"
    )
    # (b) is not a loop speed-up: both run the same loop at the same speed; a fit()
    # also starts and stops its workers, which a live group does once.
    print(
        f"(b) lifecycle cost: the 20-step DDP loop re-run in a live group {r['loop_s'] * 1e3:7.1f} ms"
    )
    if default is not None:
        print(
            f"    a warm TorchTrainer.fit() of it, Ray Train defaults   {default['warm_fit_s']:7.2f} s "
            f"= {default['warm_fit_s'] / r['loop_s']:.0f}x the live group's"
        )
    print(
        f"    a warm TorchTrainer.fit() of it, tuned (peers.py)     {tuned['warm_fit_s']:7.2f} s "
        f"= {tuned['warm_fit_s'] / r['loop_s']:.0f}x the live group's  (goal >= 50x)"
    )
    first_ready = tuned["first_ready_s"]
    print(
        f"(c) start to ready           rtnb {r['start_s']:6.2f} s   first TorchTrainer.fit() to its loop "
        f"{first_ready:6.2f} s   ratio {r['start_s'] / first_ready:.2f}x  (goal <= 0.2x)"
    )
    print(
        f"    (ray.init excluded on both sides: {r['ray_init_s']:.1f} s / {tuned['ray_init_s']:.1f} s;"
        f" whole first fit() {tuned['first_fit_s']:.2f} s)"
    )
    print("(a fresh kernel to its first result: cold_start.py)")
    emit(
        trivial_ratio=r["trivial_s"] / r["plain_s"],
        trivial_ray_ratio=r["trivial_ray_s"] / r["plain_s"],
        trivial_compiled_ratio=r["trivial_s"] / r["compiled_s"],
        trivial_ms=r["trivial_s"] * 1e3,
        lifecycle_ratio=tuned["warm_fit_s"] / r["loop_s"],
        start_ratio=r["start_s"] / first_ready,
    )


if __name__ == "__main__":
    main()
