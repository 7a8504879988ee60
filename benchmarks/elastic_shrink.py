"""How long an elastic group takes from losing a node to its next training step, rtnb
against Ray Train's elastic TorchTrainer, measured in one run of this script.

A Ray head (1 CPU) and a worker node (1 CPU) on this machine, the GCS declaring a
silent node dead after 2 s (the same for both; Ray Train tuned as ``peers.py`` says); a group of ``(1, 2)`` ranks, one per
node, trains a loop (all-reduce and a report every step, 50 ms a step, a checkpoint
from rank 0 every 10 steps). The worker node is killed at step 20 (raylet, object store and its rank);
the figure is the time from the kill to the first step after it, and to the end
of the run (60 steps). rtnb: ``Session(workers=(1, 2), max_failures=1)`` and a
background cell; Ray Train: ``ScalingConfig(num_workers=(1, 2))``,
``FailureConfig(max_failures=1)``.

    .venv/bin/python benchmarks/elastic_shrink.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import free_port
from peers import ray_train_env

DEATH = {
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "4",
}
# Ray Train tuned as peers.py says: its workers polled every 0.1 s (its default 2 s
# made each report() wait ~2 s here) and a worker group's resources awaited 3 s, as
# rtnb's placement try is, not 60 s (after the node's loss it waits for 2 ranks'
# resources before it settles for 1). rtnb reads none of these.
DEATH.update(ray_train_env())
STEPS = 60
KILL_AT = 20

LOOP = f"""
import os, time, torch, torch.distributed as dist
def train(report, get_checkpoint, checkpoint_of, load, stamps):
    ck = get_checkpoint()
    i = load(ck) + 1 if ck is not None else 0
    t = torch.zeros(1)
    while i < {STEPS}:
        time.sleep(0.05)
        dist.all_reduce(t)
        if dist.get_rank() == 0:
            with open(stamps, "a") as f:
                f.write(f"{{i}} {{time.time()}} {{dist.get_world_size()}}\\n")
        save = dist.get_rank() == 0 and i % 10 == 0
        report({{"i": i}}, checkpoint=checkpoint_of(i) if save else None)
        i += 1
    return i
"""


def _ray(*args: str, log: Path) -> subprocess.Popen:
    ray_bin = Path(sys.executable).parent / "ray"
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(ray_bin), "start", "--block", "--node-ip-address=127.0.0.1", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **DEATH},
        )


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def _wait_cpus(n: float, timeout: float = 60) -> None:
    import ray

    deadline = time.monotonic() + timeout
    while ray.cluster_resources().get("CPU", 0) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"the cluster never had {n} CPUs")
        time.sleep(0.2)


def _stamps(path: Path) -> list[tuple[int, float, int]]:
    """(step, when, world size) of each step rank 0 finished."""
    if not path.exists():
        return []
    return [
        (int(a), float(b), int(c))
        for a, b, c in (line.split() for line in path.read_text().split("\n") if line)
    ]


def _after_kill(stamps: Path, worker: subprocess.Popen, done: threading.Event) -> float:
    """Kill the worker node once step KILL_AT is done; the kill's time."""
    while not any(i >= KILL_AT for i, _, _ in _stamps(stamps)):
        if done.is_set():
            raise SystemExit("the run ended before the node could be killed")
        time.sleep(0.01)
    killed = time.time()
    _kill(worker)
    return killed


def _figures(stamps: Path, killed: float) -> dict:
    """From the kill: to the first step of the rebuilt group, and to the run's last
    step. The rebuilt group is the smaller one (a step that was already past its
    all-reduce when the node died can still land just after the kill, at the old
    size); its first step may come right after the last one done, when the
    checkpoint of the step the node died at was committed."""
    resumed = None
    after = []
    done = _stamps(stamps)
    world = max((w for _, t, w in done if t <= killed), default=0)
    for i, t, w in done:
        if t > killed:
            after.append((i, t))
            if resumed is None and w < world:
                resumed = t
    return {
        "next_step_s": round(resumed - killed, 2) if resumed else None,
        "to_end_s": round(after[-1][1] - killed, 2) if after else None,
        "last_step": after[-1][0] if after else None,
    }


def rtnb_run(address: str, head_log: Path, storage: str) -> dict:
    import rtnb

    stamps = Path(tempfile.mkdtemp()) / "stamps"
    session = rtnb.Session(
        address=address,
        workers=(1, 2),
        cpus_per_worker=1,
        max_failures=1,
        storage=storage,
        allow_local_storage=True,
        stop_grace_s=1.0,
    )
    session.start()
    try:
        assert session.world_size == 2, session.status()
        nodes = session.run("import ray\nray.get_runtime_context().get_node_id()")
        if len(set(nodes.values())) != 2:
            raise SystemExit(f"rtnb's two ranks are not on the two nodes: {nodes}")
        session.run(LOOP)
        done = threading.Event()
        handle = session.run_background(
            "import rtnb\n"
            f"train(rtnb.report, rtnb.get_checkpoint, lambda i: rtnb.Checkpoint.from_state({{'i': i}}),"
            f" lambda ck: ck.load_state()['i'], {str(stamps)!r})",
            output=lambda *_: None,
        )
        handle.add_done_callback(lambda _h: done.set())
        killed = _after_kill(stamps, WORKER["proc"], done)
        handle.wait(300)
        figures = _figures(stamps, killed)
        figures["ranks_after"] = session.world_size
        return figures
    finally:
        session.stop()


def ray_train_run(storage: str) -> dict:
    import ray.train
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    stamps = Path(tempfile.mkdtemp()) / "stamps"
    namespace: dict = {}
    exec(LOOP, namespace)

    def checkpoint_of(i: int):
        directory = tempfile.mkdtemp()
        Path(directory, "i.json").write_text(json.dumps(i))
        return ray.train.Checkpoint.from_directory(directory)

    def load(ck) -> int:
        with ck.as_directory() as d:
            return json.loads(Path(d, "i.json").read_text())

    def loop(config):
        namespace["train"](
            ray.train.report, ray.train.get_checkpoint, checkpoint_of, load, config["stamps"]
        )

    trainer = TorchTrainer(
        loop,
        train_loop_config={"stamps": str(stamps)},
        scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name=f"elastic-{time.time_ns()}",
            storage_path=storage,
            failure_config=FailureConfig(max_failures=1),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    done = threading.Event()
    outcome: dict = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except Exception as exc:  # noqa: BLE001 - reported as the peer's outcome
            outcome["error"] = repr(exc)[:300]
        finally:
            done.set()

    threading.Thread(target=fit, daemon=True).start()
    killed = _after_kill(stamps, WORKER["proc"], done)
    done.wait(400)
    figures = _figures(stamps, killed)
    if "error" in outcome:
        figures["error"] = outcome["error"]
    return figures


WORKER: dict = {}


def _wait_nodes_alive(count: int, timeout_s: float = 60) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while sum(node["Alive"] for node in ray.nodes()) != count:
        if time.monotonic() > deadline:
            nodes = [(n["NodeManagerAddress"], n["Resources"], n["Alive"]) for n in ray.nodes()]
            raise SystemExit(f"the cluster did not settle at {count} live node(s): {nodes}")
        time.sleep(0.1)


def main() -> None:
    from rtnb.core._net import use_auth_token_if_present

    # A head started where ~/.ray/auth_token exists uses token auth: so must its node.
    use_auth_token_if_present()
    os.environ.update(DEATH)  # the driver (Ray Train's controller reads it) and the nodes
    temp = Path(tempfile.mkdtemp(prefix="rtnb-elastic-"))
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = _ray(
        "--head",
        f"--port={port}",
        "--num-cpus=1",
        "--object-store-memory=200000000",
        "--include-dashboard=false",
        f"--temp-dir={temp}",
        log=temp / "head.log",
    )
    storage = str(temp / "runs")
    try:
        from rtnb.driver.cluster._connect import connect

        deadline = time.monotonic() + 60
        while True:  # the head's GCS port opens once it started
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or head.poll() is not None:
                    raise SystemExit((temp / "head.log").read_text()[-2000:]) from None
                time.sleep(0.3)
        # As a notebook joins a cluster (Ray's auth token, if this machine has one).
        connect(address, timeout_s=60)
        from _common import emit, in_order

        results = {}
        sides = {
            "rtnb": lambda: rtnb_run(address, temp / "head.log", storage),
            "Ray Train": lambda: ray_train_run(storage),
        }
        for name in in_order("rtnb", "Ray Train"):
            run = sides[name]
            WORKER["proc"] = _ray(
                f"--address={address}",
                "--num-cpus=1",
                "--object-store-memory=100000000",
                log=temp / f"worker-{name}.log",
            )
            _wait_cpus(2)
            results[name] = run()
            _kill(WORKER["proc"])
            _wait_nodes_alive(1)  # the GCS declared the killed node dead
            print(f"{name}: {results[name]}", flush=True)
        ours, theirs = results["rtnb"], results["Ray Train"]
        if ours.get("next_step_s") and theirs.get("next_step_s"):
            print(
                f"node loss -> next step: rtnb {ours['next_step_s']:.2f} s, Ray Train "
                f"{theirs['next_step_s']:.2f} s ({ours['next_step_s'] / theirs['next_step_s']:.2f}x); "
                f"to the end of the run: rtnb {ours['to_end_s']:.2f} s, Ray Train {theirs['to_end_s']:.2f} s"
            )
        mine, peer = ours.get("next_step_s"), theirs.get("next_step_s")
        emit(resume_ratio=mine / peer if mine and peer else None, rtnb_resume_s=mine)
    finally:
        import ray

        ray.shutdown()
        _kill(head)


if __name__ == "__main__":
    main()
