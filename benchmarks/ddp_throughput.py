"""DDP (or FSDP2) throughput: the same training loop under torchrun, in an rtnb cell,
in TorchTrainer.fit() and in plain Ray actors (one a rank, their process group made
by hand: what a Ray worker process costs by itself), measured in one run of this
script.

``--strategy fsdp`` wraps the model with FSDP2's ``fully_shard`` over a mesh of every
rank (what ``rtnb.prepare_model(parallel_strategy="fsdp")`` does) instead of DDP;
the code is the same text on every side.

The loop is a 3-layer MLP trained with DistributedDataParallel (gloo on CPU, nccl
with --device cuda), big enough that a step takes tens of milliseconds. Each side
times its own steps after a warm-up, on rank 0 after a barrier, so start-up costs
(process launch, Ray, the worker group) are excluded: this compares the loop.
Each side times ``--window-s`` seconds of steps (default 20: torchrun alone varies
by ~13% over half a second here, and a 2% difference needs a long window); the
count is agreed by the ranks from 10 probe steps, so every rank runs the same
collectives. Every side runs in a fresh process; the machine is noisy, so each side
is run ``--rounds`` times (default 5), interleaved, and the median is compared with
the rounds' spread printed beside it.

    .venv/bin/python benchmarks/ddp_throughput.py [--rounds 5] [--window-s 20]
        [--device cuda] [--workers 2] [--strategy ddp|fsdp]

NCCL cannot put two ranks on one GPU, so on a one-GPU machine run ``--workers 1``:
DDP then does no cross-rank traffic and the figure compares what each framework
adds around the same CUDA loop.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WARMUP = 5
WINDOW_S = float(os.environ.get("RTNB_BENCH_WINDOW_S", "20"))

# One source for all three: the DDP model, the data, the timed loop. It reports
# every 10 steps through the framework's own report (none under torchrun).
LOOP = """
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

device = torch.device(DEVICE if DEVICE == "cpu" else f"cuda:{torch.cuda.current_device()}")
torch.manual_seed(dist.get_rank())
width = WIDTH
model = torch.nn.Sequential(
    torch.nn.Linear(width, 2 * width), torch.nn.ReLU(),
    torch.nn.Linear(2 * width, 2 * width), torch.nn.ReLU(),
    torch.nn.Linear(2 * width, 1),
).to(device)
if STRATEGY == "fsdp":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    ddp = fully_shard(model, mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
else:
    ddp = DDP(model, device_ids=None if DEVICE == "cpu" else [device.index])
opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
x = torch.randn(BATCH, width, device=device)
y = x.sum(dim=1, keepdim=True)

def step():
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    return loss

for _ in range(WARMUP):
    step()
if DEVICE != "cpu":
    torch.cuda.synchronize()
# Steps until WINDOW_S has passed on every rank, in chunks of 10: after each chunk
# the ranks agree (an all_reduce(min) of one flag, the same on every side) whether
# to go on, so every rank runs the same collectives.
dist.barrier()
started = time.perf_counter()
STEPS = 0
go = torch.ones(1, device=device)
while True:
    for _ in range(10):
        loss = step()
    STEPS += 10
    REPORT({"loss": loss.item()})
    go.fill_(1.0 if time.perf_counter() - started < WINDOW_S else 0.0)
    dist.all_reduce(go, op=dist.ReduceOp.MIN)
    if go.item() == 0.0:
        break
if DEVICE != "cpu":
    torch.cuda.synchronize()
dist.barrier()
step_s = (time.perf_counter() - started) / STEPS
"""


STRATEGY = os.environ.get("RTNB_BENCH_STRATEGY", "ddp")


def _loop_source(device: str, report: str) -> str:
    # CPU: ~30 ms a step on one core here; CUDA: fp32 on an H100 takes tens of ms
    # (a step of >= 20 ms, as asked).
    width, batch = (4096, 8192) if device == "cuda" else (384, 128)
    return (
        f"DEVICE = {device!r}\nWIDTH = {width}\nBATCH = {batch}\nSTRATEGY = {STRATEGY!r}\n"
        f"WARMUP = {WARMUP}\nWINDOW_S = {WINDOW_S}\nREPORT = {report}\n" + LOOP
    )


TORCHRUN_SCRIPT = """
import json, os, torch.distributed as dist
dist.init_process_group("{backend}")
if "{device}" == "cuda":
    import torch
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
exec(compile({source!r}, "<loop>", "exec"))
if dist.get_rank() == 0:
    print("RESULT " + json.dumps({{"step_s": step_s, "steps": STEPS}}), flush=True)
# Past the loop's last barrier nothing is measured: the ranks leave without torch's
# teardown, which aborted a rank (gloo, "terminate called without an active
# exception") now and then in the first full run, after the figure was printed.
os._exit(0)
"""


def phase_torchrun(device: str, workers: int) -> dict:
    backend = "nccl" if device == "cuda" else "gloo"
    source = _loop_source(device, "lambda metrics: None")
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "loop.py"
        script.write_text(TORCHRUN_SCRIPT.format(backend=backend, device=device, source=source))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(workers),
                str(script),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    from _common import phase_result

    return phase_result(proc, "torchrun")


def phase_rtnb(device: str, workers: int) -> dict:
    from _common import quiet

    import rtnb

    session = rtnb.Session(workers=workers, gpu=device == "cuda").start()
    try:
        source = _loop_source(device, "rtnb.report") + "\nstep_s"
        values = session.run("import rtnb\n" + source + "\n(step_s, STEPS)", output=quiet)
    finally:
        session.stop()
    step_s, steps = values[0]
    return {"step_s": step_s, "steps": steps}


def phase_trainer(device: str, workers: int) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    source = _loop_source(device, "ray.train.report")
    folder = tempfile.mkdtemp(prefix="rtnb-bench-")
    out = os.path.join(folder, "step_s")

    def loop_per_worker(config):
        import ray.train

        namespace = {"ray": ray, "__name__": "__loop__"}
        exec(compile(source, "<loop>", "exec"), namespace)
        # Ray Train 2 keeps metrics only with checkpoints: hand the figure over a file.
        if ray.train.get_context().get_world_rank() == 0:
            with open(config["out"], "w") as dest:
                dest.write(json.dumps([namespace["step_s"], namespace["STEPS"]]))

    trainer = TorchTrainer(
        loop_per_worker,
        train_loop_config={"out": out},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=device == "cuda"),
        run_config=RunConfig(storage_path=folder),
    )
    trainer.fit()
    with open(out) as src:
        step_s, steps = json.load(src)
    return {"step_s": step_s, "steps": steps}


def phase_ray_actors(device: str, workers: int) -> dict:
    """The same loop in plain Ray actors, one a rank, their process group made by hand
    (no rtnb, no Ray Train): what running in a Ray worker process costs by itself."""
    import ray
    from _common import embedded_ray, free_port

    embedded_ray()
    source = _loop_source(device, "lambda metrics: None")
    port = free_port()

    @ray.remote(num_cpus=1, num_gpus=1 if device == "cuda" else 0)
    class Rank:
        def run(self, rank: int) -> tuple[float, int]:
            import torch.distributed as dist

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group(
                "nccl" if device == "cuda" else "gloo", rank=rank, world_size=workers
            )
            namespace: dict = {}
            exec(compile(source, "<loop>", "exec"), namespace)
            return namespace["step_s"], namespace["STEPS"]

    ranks = [Rank.remote() for _ in range(workers)]
    step_s, steps = ray.get([r.run.remote(i) for i, r in enumerate(ranks)])[0]
    ray.shutdown()
    return {"step_s": step_s, "steps": steps}


def _why_failed(message: str) -> str:
    """A failed phase's reason in a few words: the signal it died of, else its last line."""
    # torchrun lists the rank it stopped first and the root cause last.
    signals = re.findall(r"Signal \d+ \(\w+\)", message)
    if signals:
        return f"a rank died of {signals[-1]}"
    lines = [line for line in message.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "failed"


def _run_phase(name: str, device: str, workers: int) -> dict:
    from _common import run_phase
    from peers import ray_train_env

    args = ["--phase", name, "--device", device, "--workers", str(workers)]
    env = ray_train_env() if name == "trainer" else {}
    return run_phase(__file__, args, f"phase {name}", 1200, env)


PHASES = {
    "torchrun": phase_torchrun,
    "rtnb": phase_rtnb,
    "trainer": phase_trainer,
    "ray_actors": phase_ray_actors,
}
# Each side's label, in the order printed; every side but torchrun is a figure
# against it, "<side>_vs_torchrun".
LABELS = {
    "torchrun": "torchrun",
    "rtnb": "rtnb cell",
    "trainer": "TorchTrainer.fit (tuned)",
    "ray_actors": "plain Ray actors",
}
AGAINST_TORCHRUN = [side for side in LABELS if side != "torchrun"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=sorted(PHASES))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--window-s", type=float, default=None, help="seconds of timed steps a side (20)"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default=None)
    args = parser.parse_args()
    global WINDOW_S
    if args.window_s is not None:
        # The phases are fresh processes: they read the window from their environment.
        os.environ["RTNB_BENCH_WINDOW_S"] = str(args.window_s)
        WINDOW_S = args.window_s
    if args.strategy:
        # The phases are fresh processes: they read it from their environment.
        global STRATEGY
        os.environ["RTNB_BENCH_STRATEGY"] = STRATEGY = args.strategy
    if args.phase:
        print("RESULT " + json.dumps(PHASES[args.phase](args.device, args.workers)))
        return
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(
        f"{STRATEGY}_throughput: {args.workers} rank(s), {backend}, {args.device}; "
        f"{WINDOW_S:g} s of timed steps after {WARMUP} warm-up; {args.rounds} "
        "interleaved rounds, median (spread: the rounds' range around it)"
    )
    from _common import emit, in_order

    seen: dict[str, list[float]] = {name: [] for name in PHASES}
    steps: dict[str, list[int]] = {name: [] for name in PHASES}
    failed: dict[str, str] = {}
    for _ in range(args.rounds):
        for name in in_order("rtnb", *(side for side in LABELS if side != "rtnb")):
            try:
                result = _run_phase(name, args.device, args.workers)
            except SystemExit as exc:
                if name == "rtnb":
                    raise
                # A peer that fails is the peer's failed round (run.py counts it so),
                # never its time and never the end of the benchmark's other rounds.
                failed[name] = _why_failed(str(exc))
                print(f"{name} failed this round: {failed[name]}", flush=True)
                continue
            seen[name].append(result["step_s"])
            steps[name].append(int(result["steps"]))
    step = {name: statistics.median(values) for name, values in seen.items() if values}
    print()
    for name, label in LABELS.items():
        if name not in step:
            print(f"{label:17s} failed: {failed[name]}")
            continue
        runs = ", ".join(f"{v * 1e3:.1f}" for v in seen[name])
        spread = (max(seen[name]) - min(seen[name])) / step[name] * 100
        against = f"{step['torchrun'] / step[name]:.3f}x" if "torchrun" in step else "—"
        print(
            f"{label:17s} {step[name] * 1e3:8.1f} ms/step   throughput {against} "
            f"torchrun   spread {spread:.1f}%   (runs: {runs} ms; "
            f"{min(steps[name])}-{max(steps[name])} steps)"
        )
    ratios = {
        f"{side}_vs_torchrun": step["torchrun"] / step[side]
        if {"torchrun", side} <= step.keys()
        else None
        for side in AGAINST_TORCHRUN
    }
    # torchrun is every figure's base: its failure in any run of this round fails them
    # all (rtnb's own failure ends the benchmark instead).
    peer_failed = {
        f"{side}_vs_torchrun": failed[failing]
        for side in AGAINST_TORCHRUN
        for failing in ("torchrun", side)
        if failing in failed
    }
    if ratios["rtnb_vs_torchrun"] is not None:
        print(f"goal: rtnb >= 0.98x torchrun's throughput -> {ratios['rtnb_vs_torchrun']:.3f}x")
    emit(peer_failed, **ratios)
    if STRATEGY == "fsdp":
        print("(FSDP2 on every side: the same fully_shard over a mesh of all ranks)")


if __name__ == "__main__":
    main()
