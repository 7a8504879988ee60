"""Every peer's settings, in one place: what each benchmark runs rtnb against, tuned.

A ratio means something only when the peer does the same work, tuned as well as a
careful user would tune it. The benchmarks read their peer's settings from here, and
``run.py`` prints them beside each figure.

Ray Train (``TorchTrainer``), tuned alike with rtnb:

* ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.1`` (default 2.0): the controller polls its
  workers, and so hears their reports, their end and their deaths, 20x as often;
  rtnb's driver long-polls its ranks, so it hears them at once.
* ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=3`` (default 60): how long the controller
  waits for a worker group's resources before it gives up and tries again (smaller,
  elastic); rtnb's placement try is 3 s too.

These are read by the controller's process, which inherits the environment of the
process that starts Ray: a peer side sets them before ``ray.init``, in a fresh process.
Ray Train at its defaults appears only as a separate row, labelled so.
"""

from __future__ import annotations

RAY_TRAIN_TUNED: dict[str, str] = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "3",
}

RAY_TRAIN_TUNED_TEXT = "TorchTrainer, health check 0.1 s, worker-group start timeout 3 s"
RAY_TRAIN_DEFAULTS_TEXT = "TorchTrainer at Ray Train's defaults (health check 2 s, start 60 s)"

# What each benchmark's peer is, as the table prints it.
PEERS: dict[str, str] = {
    "cell_latency": f"plain Ray actors' exec; {RAY_TRAIN_TUNED_TEXT}",
    "report_overhead": f"the same loop without reports; {RAY_TRAIN_TUNED_TEXT}",
    "ddp_throughput": "torchrun (the same DDP loop); "
    + RAY_TRAIN_TUNED_TEXT
    + "; plain Ray actors, a process group made by hand",
    "fsdp_throughput": "torchrun (the same FSDP2 loop); "
    + RAY_TRAIN_TUNED_TEXT
    + "; plain Ray actors, a process group made by hand",
    "checkpoint_io": (
        "torch.save into a new checkpoint folder each save / torch.load; "
        "both sides complete, then os.sync() on every rank"
    ),
    "checkpoint_async": RAY_TRAIN_TUNED_TEXT + ", report(checkpoint_upload_mode=ASYNC), same loop",
    "cold_start": "jupyter-distributed 0.1.1 + a gloo group (server); nbdistributed 0.1.0",
    "data_start": RAY_TRAIN_TUNED_TEXT + ", ray.init(num_cpus=3)",
    "data_throughput": RAY_TRAIN_TUNED_TEXT + " (same Ray, same dataset, same Trainer)",
    "elastic_shrink": RAY_TRAIN_TUNED_TEXT + ", ScalingConfig(num_workers=(1, 2))",
    "live_view": "FigureWidget redrawn 10x/s from the last 1,000 points a rank (batch_update)",
    "local_overhead": "exec() of the same code in the same process",
    "recovery_replay": "training the journaled cells again from their start",
    "stacks_latency": "py-spy dump, one per rank, run at once",
    "sweep": RAY_TRAIN_TUNED_TEXT + ", one fit() per trial in a Tune grid",
    "scale": "rtnb itself at 2 ranks (how its costs grow with the size)",
    "relay": "the same group size calling every rank directly (rtnb's way under 4 ranks)",
    "soak": "none (growth against the goal)",
    "file_sync": "the same cell on a group of the same Ray without sync (--files off)",
    "cluster": "the same driver on one machine (embedded Ray); torchrun --nnodes 2 on the same two machines",
}


def ray_train_env(tuned: bool = True) -> dict[str, str]:
    """The environment a Ray Train side starts its Ray with."""
    return dict(RAY_TRAIN_TUNED) if tuned else {}
