"""A Hugging Face Trainer in a cell: DDP over the group, its logs in the live store,
its checkpoints in rtnb's store, resumed from one (after a recovery too). A tiny
model built from a config, synthetic token ids: nothing is downloaded."""

from __future__ import annotations

import pytest

import rtnb

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SETUP = """
import os, torch, rtnb
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from ray.train.huggingface.transformers import prepare_trainer, RayTrainReportCallback

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        ids = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}

def make(max_steps, data=None, folder=OUT):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    args = TrainingArguments(
        output_dir=f"{folder}/rank{rtnb.get_context().world_rank}",
        per_device_train_batch_size=4, max_steps=max_steps, logging_steps=1,
        save_steps=3, report_to=[], disable_tqdm=True,
    )
    return Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data or Tokens())

def weights(trainer):
    return round(float(sum(p.detach().sum() for p in trainer.model.parameters())), 4)
"""


def test_a_trainer_trains_with_ddp_reports_checkpoints_and_resumes(ray_cluster, tmp_path):
    import numpy as np
    import ray

    with rtnb.Session(
        workers=2,
        cpus_per_worker=0.5,
        storage=str(tmp_path / "runs"),
        name="hf",
        max_failures=1,
        stop_grace_s=1.0,
    ) as session:
        session.run(f"OUT = {str(tmp_path / 'out')!r}\n" + SETUP, output=lambda *a: None)
        # Ray Train's order: the callback added by the user, then prepare_trainer.
        value = session.run(
            "trainer = make(6)\n"
            "trainer.add_callback(RayTrainReportCallback())\n"
            "trainer = prepare_trainer(trainer)\n"
            "trainer.train()\n"
            "(trainer.args.world_size, trainer.state.global_step, weights(trainer))",
            output=lambda *a: None,
        )
        (world0, steps0, w0), (world1, steps1, w1) = value[0], value[1]
        assert world0 == world1 == 2 and steps0 == steps1 == 6
        assert w0 == w1, "DDP kept the ranks' weights equal (each saw its own batches)"
        assert [c.id for c in session.list_checkpoints()] == ["step-000000003", "step-000000006"]
        for rank in (0, 1):
            steps = session.metrics.series("loss", rank)[0]
            assert steps == [1, 2, 3, 4, 5, 6], "every logging step once, in the live store"
        assert session.run("rtnb.get_checkpoint().id") == {0: "step-000000006", 1: "step-000000006"}

        # Resumed from rtnb's checkpoint; then rank 1 dies once in a later cell, and the
        # recovery's re-run resumes from the latest checkpoint again.
        marker = tmp_path / "killed"
        resume = (
            "import signal\n"
            "ck = rtnb.get_checkpoint()\n"
            "again = prepare_trainer(make(STEPS))\n"
            "with ck.as_directory() as d:\n"
            f"    if rtnb.get_context().world_rank == 1 and STEPS == 12 and not os.path.exists({str(marker)!r}):\n"
            f"        open({str(marker)!r}, 'w').close()\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "    again.train(resume_from_checkpoint=os.path.join(d, 'checkpoint'))\n"
            "(ck.id, again.state.global_step)"
        )
        assert session.run("STEPS = 9\n" + resume, output=lambda *a: None) == {
            0: ("step-000000006", 9),
            1: ("step-000000006", 9),
        }
        assert session.run("STEPS = 12\n" + resume, output=lambda *a: None) == {
            0: ("step-000000009", 12),
            1: ("step-000000009", 12),
        }
        assert marker.exists() and session.failures == 1
        assert session.latest_checkpoint_id() == "step-000000012"

        # A Ray Data shard feeds a new Trainer (prepare_trainer passes its batches on).
        tokens = np.random.default_rng(0).integers(0, 50, size=(64, 16))
        shard = ray.data.from_numpy(tokens).map_batches(
            lambda b: {"input_ids": b["data"], "labels": b["data"]}
        )
        fed = session.run(
            "batches = rtnb.get_dataset_shard('train').iter_torch_batches(batch_size=4)\n"
            "fed = prepare_trainer(make(4, data=batches, folder=OUT + '-data'))\n"
            "fed.train()\n"
            "fed.state.global_step",
            datasets={"train": shard},
            output=lambda *a: None,
        )
        assert fed == {0: 4, 1: 4}
        # A fresh Trainer in a run that trained before goes on after the run's steps
        # (its saves at its steps 3 and 4 are the run's 15 and 16: no clash with
        # step-000000003).
        assert [c.id for c in session.list_checkpoints()][-2:] == [
            "step-000000015",
            "step-000000016",
        ]
        assert session.metrics.series("loss", 1)[0][-4:] == [13, 14, 15, 16]

        with pytest.raises(rtnb.CellError, match="prepare_trainer.. was already called") as info:
            session.run("prepare_trainer(trainer)")
        assert "\n" not in str(info.value).split(": ", 1)[1].strip()
