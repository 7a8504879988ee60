"""Ray Data and a Hugging Face Trainer in a cell against the same code under
``TorchTrainer.fit()``, on the same kind of local Ray (2 CPUs, 2 ranks of 0.5 CPU, so
Ray Data has a CPU of its own), each side in a fresh process, one run each.

(a) rows/s per rank reading a Ray Data shard (``iter_torch_batches``; a
    ``map_batches`` preprocessing step on the cluster) over epochs 2-3 of 3 (the
    first starts the pipeline); goal >= 0.95x of TorchTrainer's;
(b) a tiny GPT-2's Trainer step time on 2 ranks (DDP, gloo), from step 20 to the last (120; 50 with --quick); goal:
    rtnb's steps/s >= 0.98x of TorchTrainer's.

    .venv/bin/python benchmarks/data_throughput.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

QUICK = os.environ.get("RTNB_BENCH_QUICK") == "1"
ROWS = 60_000 if QUICK else 200_000
HF_STEPS = 50 if QUICK else 120
EPOCHS = 3  # the figure: epochs 2-3


def make_dataset():
    import numpy as np
    import ray

    def features(batch):
        batch["x"] = np.repeat(batch["id"][:, None].astype("float32"), 16, axis=1)
        return batch

    return ray.data.range(ROWS).map_batches(features)


def _keep(config: dict, name: str, value: float) -> None:
    """Ray Train V2's Result keeps metrics reported with a checkpoint only: each rank
    writes its figure to a file the driver reads."""
    import os

    import ray.train

    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"{name}-{rank}.json"), "w") as out:
        out.write(json.dumps(value))


def read_loop_trained(config: dict) -> None:
    _keep(config, "rows_per_s", read_loop())


def hf_loop_trained(config: dict) -> None:
    _keep(config, "s_per_step", hf_loop())


def read_loop():
    """EPOCHS epochs of this rank's shard; rows/s over every epoch after the first
    (which starts the pipeline), a fixed choice made before any figure was seen."""
    import time

    import ray.train

    shard = ray.train.get_dataset_shard("train")
    rows = seconds = 0.0
    for epoch in range(EPOCHS):
        read, started = 0, time.perf_counter()
        for batch in shard.iter_torch_batches(batch_size=512):
            read += len(batch["id"])
        if epoch > 0:
            rows, seconds = rows + read, seconds + time.perf_counter() - started
    return rows / seconds


def hf_loop():
    """A tiny GPT-2 Trainer for HF_STEPS steps; seconds per step after the first 20."""
    import tempfile as _tempfile
    import time

    import torch
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 4096

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=32)
    )
    args = TrainingArguments(
        output_dir=_tempfile.mkdtemp(),
        per_device_train_batch_size=8,
        max_steps=HF_STEPS,
        logging_steps=5,
        save_steps=HF_STEPS,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Clock()])
    trainer.add_callback(RayTrainReportCallback())
    trainer = prepare_trainer(trainer)
    trainer.train()
    per_step = (stamps[-1] - stamps[19]) / (len(stamps) - 20)  # steps 20 to the last
    return per_step


def phase_rtnb() -> dict:
    import inspect

    from _common import embedded_ray, quiet

    import rtnb

    embedded_ray()
    with rtnb.Session(
        workers=2, cpus_per_worker=0.5, storage=tempfile.mkdtemp(prefix="rtnb-bench-")
    ) as session:
        session.set_datasets(train=make_dataset())
        source = f"EPOCHS = {EPOCHS}\n" + inspect.getsource(read_loop) + "read_loop()"
        rates = session.run(source, output=quiet)
        hf = session.run(
            f"HF_STEPS = {HF_STEPS}\n" + inspect.getsource(hf_loop) + "hf_loop()", output=quiet
        )
    return {"rows_per_s": min(rates.values()), "s_per_step": max(hf.values())}


def phase_trainer() -> dict:
    from _common import embedded_ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    embedded_ray()
    storage = tempfile.mkdtemp(prefix="rtnb-bench-")
    scaling = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})
    out = {"out": storage}
    data = TorchTrainer(
        read_loop_trained,
        train_loop_config=out,
        datasets={"train": make_dataset()},
        scaling_config=scaling,
        run_config=RunConfig(name="data", storage_path=storage),
    ).fit()
    hf = TorchTrainer(
        hf_loop_trained,
        train_loop_config=out,
        scaling_config=scaling,
        run_config=RunConfig(name="hf", storage_path=storage),
    ).fit()
    for result in (data, hf):
        if result.error is not None:
            raise RuntimeError(f"TorchTrainer failed: {result.error}")
    figures = {}
    for name, pick in (("rows_per_s", min), ("s_per_step", max)):
        values = [json.loads((Path(storage) / f"{name}-{r}.json").read_text()) for r in (0, 1)]
        figures[name] = pick(values)  # the slowest rank, as on rtnb's side
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", default=None)
    parser.add_argument("--quick", action="store_true", help=f"{60_000:,} rows, 50 HF steps")
    args = parser.parse_args()
    if args.phase == "rtnb":
        print("RESULT " + json.dumps(phase_rtnb()))
        return
    if args.phase == "trainer":
        print("RESULT " + json.dumps(phase_trainer()))
        return
    from _common import emit, in_order, run_phase
    from peers import ray_train_env

    print(
        "data_throughput: 2 ranks x 0.5 CPU, gloo; each side in a fresh process with embedded Ray"
    )
    quick = {"RTNB_BENCH_QUICK": "1" if args.quick else "0"}
    got = {}
    for side in in_order("rtnb", "trainer"):
        env = {**quick, **(ray_train_env() if side == "trainer" else {})}
        got[side] = run_phase(__file__, ["--phase", side], f"phase {side}", 900, env)
    ours, peer = got["rtnb"], got["trainer"]
    ratio = ours["rows_per_s"] / peer["rows_per_s"]
    print(
        f"(a) Ray Data shard, rows/s per rank   rtnb {ours['rows_per_s']:10,.0f}   "
        f"TorchTrainer {peer['rows_per_s']:10,.0f}   ratio {ratio:.2f}x  (goal >= 0.95x)"
    )
    speed = peer["s_per_step"] / ours["s_per_step"]
    print(
        f"(b) HF Trainer step, 2 ranks          rtnb {ours['s_per_step'] * 1e3:8.1f} ms   "
        f"TorchTrainer {peer['s_per_step'] * 1e3:8.1f} ms   steps/s ratio {speed:.2f}x  (goal >= 0.98x)"
    )
    emit(rows_ratio=ratio, hf_ratio=speed)


if __name__ == "__main__":
    main()
