"""Step time of a loop that saves a large checkpoint every 10 steps: no checkpoint vs
``SYNC`` vs ``ASYNC`` uploads, in rtnb and in Ray Train, to object storage (a moto S3
server on loopback) and to local disk.

The loop is the same function on both sides (Ray Train's names): 2 ranks, DDP over
gloo; a step is a small CPU step plus ``--device-ms`` of simulated device time
(``time.sleep``: the host CPU is idle then, as while a GPU computes); every
``--every`` steps each rank ``torch.save``s ``--mb`` MB (its model plus a state blob)
into a fresh folder and reports it with ``Checkpoint.from_directory`` and the mode.
What is timed is the loop, first step to last report, per rank (the slower rank);
what the end of the run still waits for (uploads in flight) is printed beside it.

rtnb: one session per storage, the three modes as function cells. Ray Train: one
``TorchTrainer.fit()`` per mode, tuned as peers.py says, in its own fresh process
with its own Ray. The goal: ``ASYNC`` ≤ 1.10× the loop without checkpoints.

    .venv/bin/python benchmarks/checkpoint_async.py [--quick] [--mb 100] [--storage s3,local]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODES = ("none", "SYNC", "ASYNC")
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


def train_loop(config: dict) -> None:
    """The loop both sides run: Ray Train's names (rtnb's inside a cell)."""
    import json
    import os
    import tempfile
    import time

    import ray.train
    import torch
    import torch.distributed as dist
    from ray.train import Checkpoint
    from ray.train.torch import prepare_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = dist.get_rank()
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    blob = torch.randn(config["mb"] * 1024 * 1024 // 4)
    x, y = torch.randn(64, 256), torch.randn(64, 1)
    mode = config["mode"]
    started = time.perf_counter()
    for step in range(config["steps"]):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(config["device_ms"] / 1000)
        checkpoint, kwargs = None, {}
        if mode != "none" and step % config["every"] == config["every"] - 1:
            folder = tempfile.mkdtemp(prefix="bench-ckpt-")
            torch.save({"model": model.state_dict(), "blob": blob}, f"{folder}/rank{rank}.pt")
            checkpoint = Checkpoint.from_directory(folder)
            kwargs = {"checkpoint_upload_mode": ray.train.CheckpointUploadMode[mode]}
        # Steps go on across the modes run in one rtnb session (a checkpoint id is a step).
        metrics = {"loss": loss.item(), "step": config["first_step"] + step}
        ray.train.report(metrics, checkpoint=checkpoint, **kwargs)
    loop_s = time.perf_counter() - started
    with open(os.path.join(config["out"], f"{mode}-rank{rank}.json"), "w") as out:
        json.dump({"loop_s": loop_s, "end": time.time()}, out)


def _config(args, mode: str, out: str) -> dict:
    return {
        "mode": mode,
        "first_step": MODES.index(mode) * args.steps,
        "mb": args.mb,
        "steps": args.steps,
        "every": args.every,
        "device_ms": args.device_ms,
        "out": out,
    }


def _timed(out: str, mode: str, started: float) -> dict:
    """The slower rank's loop time, how long the run's end waited after its loop
    (uploads in flight), and the whole run's time."""
    ranks = [json.loads(Path(out, f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]
    now = time.time()
    return {
        "loop_s": max(r["loop_s"] for r in ranks),
        "drain_s": now - max(r["end"] for r in ranks),
        "total_s": now - started,
    }


def phase_rtnb(args) -> dict:
    from _common import embedded_ray, quiet

    import rtnb

    embedded_ray()
    got = {}
    for kind, storage in _storages(args):
        with rtnb.Session(
            workers=2, storage=storage, name=f"async-{kind}", env=CREDENTIALS
        ) as session:
            for mode in args.order:
                out = tempfile.mkdtemp(prefix="bench-out-")
                started = time.time()
                session.run(train_loop, config=_config(args, mode, out), output=quiet)
                got[f"{kind}.{mode}"] = _timed(out, mode, started)
    return got


def phase_trainer(args) -> dict:
    from _common import embedded_ray

    embedded_ray()
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    got = {}
    for kind, storage in _storages(args):
        for mode in args.order:
            out = tempfile.mkdtemp(prefix="bench-out-")
            started = time.time()
            TorchTrainer(
                train_loop,
                train_loop_config=_config(args, mode, out),
                scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(storage_path=storage, name=f"async-{kind}-{mode}"),
            ).fit()
            got[f"{kind}.{mode}"] = _timed(out, mode, started)
    return got


def _storages(args) -> list[tuple[str, str]]:
    found = []
    for kind in args.storage.split(","):
        if kind == "local":
            found.append((kind, tempfile.mkdtemp(prefix="bench-runs-")))
        else:
            endpoint = os.environ["BENCH_S3_ENDPOINT"]
            found.append(
                (kind, f"s3://bench/runs?endpoint_override={endpoint}&scheme=http&region=us-east-1")
            )
    return found


def _moto() -> tuple[subprocess.Popen, str]:
    """A moto S3 server on a free loopback port, with the bucket made."""
    from _common import free_port

    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit("moto_server did not start") from None
            time.sleep(0.1)
    import boto3

    boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket="bench")
    return server, f"127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", default=None)
    parser.add_argument(
        "--quick", action="store_true", help="S3 only, 10 MB a rank, no Ray Train side"
    )
    parser.add_argument("--mb", type=int, default=100, help="MB each rank saves")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    # 300 ms: a step of a model that checkpoints 200 MB is rarely shorter on a GPU.
    # The torch.save into the folder is in the loop on every side and in every mode,
    # so at 100 ms a step it alone costs ~10% (see docs/benchmarks.md).
    parser.add_argument("--device-ms", type=float, default=300.0)
    parser.add_argument("--storage", default="s3,local")
    parser.add_argument("--order", default=",".join(MODES))
    args = parser.parse_args()
    args.order = args.order.split(",")
    if args.phase:
        os.environ.update(CREDENTIALS)
        result = phase_rtnb(args) if args.phase == "rtnb" else phase_trainer(args)
        print("RESULT " + json.dumps(result), flush=True)
        return

    from _common import emit, in_order, peer_first, run_phase
    from peers import ray_train_env

    sides: tuple[str, ...] = ("rtnb", "trainer")
    if args.quick:
        # 10 MB: moto (a Python server on the same two cores) takes ~3 MB/s, so at
        # 50 MB a quick round spent ~5 min waiting for it, not measuring the loop.
        args.storage, args.mb, sides = "s3", 10, ("rtnb",)
    server, endpoint = _moto()
    # The modes' order alternates with the sides' (the disk and moto warm up).
    order = list(reversed(MODES)) if peer_first() else list(MODES)
    common = [
        "--mb", str(args.mb), "--steps", str(args.steps), "--every", str(args.every),
        "--device-ms", str(args.device_ms), "--storage", args.storage, "--order", ",".join(order),
    ]  # fmt: skip
    env = {**CREDENTIALS, "BENCH_S3_ENDPOINT": endpoint}
    got = {}
    try:
        for side in in_order(*sides):
            extra = {**env, **(ray_train_env() if side == "trainer" else {})}
            got[side] = run_phase(
                __file__, ["--phase", side, *common], f"phase {side}", 1800, extra
            )
    finally:
        os.killpg(server.pid, signal.SIGKILL)
    print(
        f"checkpoint_async: 2 ranks, DDP over gloo, {args.steps} steps of {args.device_ms:.0f} ms "
        f"simulated device time, {args.mb} MB a rank saved every {args.every} steps "
        "(Checkpoint.from_directory); loop time of the slower rank, then what the run's end "
        "waited for"
    )
    figures = {}
    for kind in args.storage.split(","):
        for side, name in (("rtnb", "rtnb"), ("trainer", "Ray Train (tuned)")):
            if side not in got:
                continue
            row = got[side]
            base = row[f"{kind}.none"]["loop_s"]
            cells = []
            for mode in MODES:
                entry = row[f"{kind}.{mode}"]
                cells.append(
                    f"{mode} {entry['loop_s']:6.2f} s ({entry['loop_s'] / base:.2f}x, "
                    f"end +{entry['drain_s']:.1f} s)"
                )
            print(f"  {kind:5} {name:18} " + "   ".join(cells))
        ours = got["rtnb"]
        base = ours[f"{kind}.none"]["loop_s"]
        figures[f"async_ratio_{kind}"] = ours[f"{kind}.ASYNC"]["loop_s"] / base
        figures[f"sync_ratio_{kind}"] = ours[f"{kind}.SYNC"]["loop_s"] / base
        peer = ""
        if "trainer" in got:
            theirs = got["trainer"]
            figures[f"trainer_async_ratio_{kind}"] = (
                theirs[f"{kind}.ASYNC"]["loop_s"] / theirs[f"{kind}.none"]["loop_s"]
            )
            peer = f"; Ray Train ASYNC {figures[f'trainer_async_ratio_{kind}']:.2f}x"
        print(
            f"  {kind}: rtnb ASYNC {figures[f'async_ratio_{kind}']:.2f}x the loop without "
            f"checkpoints (goal <= 1.10x); SYNC {figures[f'sync_ratio_{kind}']:.2f}x{peer}"
        )
    emit(**figures)


if __name__ == "__main__":
    main()
