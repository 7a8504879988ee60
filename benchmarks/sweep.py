"""Wall time of a sweep of 8 short trials, rtnb against Ray Tune + Ray Train, measured
in one run of this script.

Each trial trains the same tiny DDP model for 20 steps on 2 ranks (gloo, 0.5 CPU
each), reporting its loss every step; the search space is one ``tune.loguniform``
learning rate, 8 samples, 2 trials at once, no early stopping (so both sides run
every step of every trial). Each side runs in a fresh process with its own embedded
2-CPU Ray, started before the clock starts.

- rtnb: ``rtnb.sweep(train, space, num_samples=8, max_concurrent_trials=2,
  workers=2, cpus_per_worker=0.5)``: two groups, each lent to the next trial.
- Ray Tune + Ray Train (V2), as its docs put it: a ``Tuner`` over a function
  trainable (no CPU) that runs a ``TorchTrainer`` per trial with
  ``TuneReportCallback``; Ray Train tuned as ``peers.py`` says (its default 2 s
  health check made each ``report()`` wait ~2 s): the peer at its quickest.

Goal: rtnb's wall time ≤ 0.5× the peer's.

    .venv/bin/python benchmarks/sweep.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TRIALS = 4 if os.environ.get("RTNB_BENCH_QUICK") == "1" else 8
STEPS = 20
CONCURRENT = 2


def train_loop(config: dict) -> None:
    """One trial: a linear model under DDP, STEPS steps, a report each (Ray Train's
    names, so the same function runs on both sides)."""
    import ray.train
    import torch
    from ray.train.torch import prepare_model

    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    for _step in range(config.get("steps", 20)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ray.train.report({"loss": loss.item()})


def space() -> dict:
    from ray import tune

    return {"lr": tune.loguniform(1e-3, 1e-1), "steps": STEPS}


def phase_rtnb() -> dict:
    from _common import embedded_ray

    import rtnb

    embedded_ray()
    started = time.perf_counter()
    sweep = rtnb.sweep(
        train_loop,
        space(),
        metric="loss",
        mode="min",
        num_samples=TRIALS,
        max_concurrent_trials=CONCURRENT,
        workers=2,
        cpus_per_worker=0.5,
        storage=tempfile.mkdtemp(prefix="rtnb-bench-"),
    )
    wall = time.perf_counter() - started
    trials = sweep.trials
    assert len(trials) == TRIALS and all(t.iterations == STEPS for t in trials), trials
    return {"wall_s": wall, "groups_started": sweep.groups_started}


def phase_tune() -> dict:
    from _common import embedded_ray
    from ray import tune
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    embedded_ray()
    storage = tempfile.mkdtemp(prefix="rtnb-bench-")

    def trial(config: dict) -> None:
        TorchTrainer(
            train_loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(
                name=f"trial-{tune.get_context().get_trial_id()}",
                storage_path=storage,
                callbacks=[TuneReportCallback()],
            ),
        ).fit()

    started = time.perf_counter()
    results = tune.Tuner(
        # No CPU of its own (Tune needs a bundle that is not empty: one byte of memory),
        # so both trials' ranks fit as on rtnb's side.
        tune.with_resources(trial, {"CPU": 0, "memory": 1}),
        param_space=space(),
        tune_config=tune.TuneConfig(
            num_samples=TRIALS, max_concurrent_trials=CONCURRENT, metric="loss", mode="min"
        ),
        run_config=tune.RunConfig(storage_path=storage, verbose=0),
    ).fit()
    wall = time.perf_counter() - started
    errors = [r.error for r in results if r.error is not None]
    if errors:
        raise RuntimeError(f"a Tune trial failed: {errors[0]}")
    steps = [r.metrics.get("training_iteration") for r in results]
    assert len(results) == TRIALS and all(s == STEPS for s in steps), steps
    return {"wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", default=None)
    parser.add_argument("--quick", action="store_true", help="4 trials instead of 8")
    args = parser.parse_args()
    if args.phase == "rtnb":
        print("RESULT " + json.dumps(phase_rtnb()))
        return
    if args.phase == "tune":
        print("RESULT " + json.dumps(phase_tune()))
        return
    from _common import emit, in_order, run_phase
    from peers import ray_train_env

    if args.quick:
        os.environ["RTNB_BENCH_QUICK"] = "1"
    print(
        f"sweep: {TRIALS} trials x 2 ranks x {STEPS} steps, {CONCURRENT} at once, 0.5 CPU a rank; "
        "each side in a fresh process with an embedded 2-CPU Ray"
    )
    got = {}
    for side in in_order("rtnb", "tune"):
        env = ray_train_env() if side == "tune" else {}
        got[side] = run_phase(__file__, ["--phase", side], f"phase {side}", 1800, env)
    ours, peer = got["rtnb"], got["tune"]
    ratio = ours["wall_s"] / peer["wall_s"]
    print(
        f"wall time   rtnb.sweep {ours['wall_s']:7.2f} s ({ours['groups_started']} groups started)   "
        f"Tuner + TorchTrainer {peer['wall_s']:7.2f} s   ratio {ratio:.2f}x  (goal <= 0.5x)"
    )
    emit(sweep_ratio=ratio)


if __name__ == "__main__":
    main()
