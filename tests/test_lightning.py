"""PyTorch Lightning in a cell with ``ray.train.lightning`` as Ray Train's docs write
it: gradients synchronised over the group, ``self.log`` values on the live plot at
every step, the callback's checkpoints in rtnb's store, resumed from one and
recovered after a rank is killed."""

from __future__ import annotations

import pytest

import rtnb
from tests.conftest import require

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SETUP = """
import os, signal, time, torch, rtnb
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
from ray.train.lightning import (
    RayDDPStrategy, RayFSDPStrategy, RayLightningEnvironment, RayTrainReportCallback,
    prepare_trainer,
)

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        if KILL_AT is not None and self.global_step == KILL_AT and rtnb.get_context().world_rank == 1 \\
                and not os.path.exists(MARKER):
            # Once the epoch's checkpoint is committed (its manifest is written last).
            while not os.path.exists(COMMITTED):
                time.sleep(0.05)
            open(MARKER, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

g = torch.Generator().manual_seed(0)
DATA = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
KILL_AT = None

def fit(epochs, strategy=None):
    torch.manual_seed(rtnb.get_context().world_rank)  # different starts: DDP makes them one
    model = Model()
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="auto", devices="auto",
        strategy=strategy or RayDDPStrategy(), plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, logger=False,
        log_every_n_steps=1,
    )
    trainer = prepare_trainer(trainer)
    ckpt = rtnb.get_checkpoint()
    if ckpt is None:
        trainer.fit(model, train_dataloaders=DataLoader(DATA, batch_size=8))
        start = None
    else:
        with ckpt.as_directory() as d:
            trainer.fit(model, train_dataloaders=DataLoader(DATA, batch_size=8),
                        ckpt_path=os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME))
        start = ckpt.id
    weights = round(float(sum(p.detach().sum() for p in model.parameters())), 6)
    return (trainer.world_size, trainer.global_step, weights, start)
"""


def test_lightning_trains_with_ddp_logs_every_step_checkpoints_resumes_and_recovers(lend, tmp_path):
    require("lightning", "the Lightning tests (pip install -e '.[test]')")
    quiet = {"output": lambda *a: None}
    with rtnb.Session(
        workers=2,
        cpus_per_worker=0.5,
        group_factory=lend,
        storage=str(tmp_path / "runs"),
        name="light",
        max_failures=1,
        stop_grace_s=1.0,
    ) as session:
        marker = str(tmp_path / "killed")
        session.run(f"MARKER = {marker!r}\n" + SETUP, **quiet)
        # Earlier fits are --once: replayed with the latest checkpoint (epoch 6),
        # Lightning would refuse a fit of fewer epochs than it holds.
        first = session.run("fit(3)", once=True, **quiet)
        # 64 rows, batch 8, split over 2 ranks by Lightning's DistributedSampler: 4
        # steps an epoch on each rank, each on its own half of the data.
        assert first[0][:2] == first[1][:2] == (2, 12)
        assert first[0][2] == first[1][2], "DDP kept the ranks' weights equal"
        assert [c.id for c in session.list_checkpoints()] == [
            "step-000000004",
            "step-000000008",
            "step-000000012",
        ], "one checkpoint an epoch, every rank's report together"
        for rank in (0, 1):
            steps = session.metrics.series("train_loss", rank)[0]
            assert steps == list(range(1, 13)), "self.log at every step, each step once"
        files = [f["path"] for f in session.list_checkpoints()[-1].files]
        assert any(f.endswith("checkpoint.ckpt") for f in files), files

        # Resumed from the latest checkpoint: Lightning goes on from its epoch 3.
        resumed = session.run("fit(5)", once=True, **quiet)
        assert resumed[0] == resumed[1]
        assert resumed[0][:2] == (2, 20) and resumed[0][3] == "step-000000012"

        # Rank 1 SIGKILLed at step 26 (epoch 7): the group is rebuilt, the cells
        # replayed, and the re-run fit() goes on from the latest committed checkpoint
        # (epoch 6's, step 24).
        committed = (
            tmp_path / "runs" / "light" / "checkpoints" / "step-000000024" / "_manifest.json"
        )
        session.run(f"KILL_AT = 26\nCOMMITTED = {str(committed)!r}", **quiet)
        recovered = session.run("fit(8)", **quiet)
        assert session.failures == 1
        assert recovered[0] == recovered[1]
        assert recovered[0][:2] == (2, 32) and recovered[0][3] == "step-000000024"
        assert session.latest_checkpoint_id().startswith("step-000000032")


def test_lightnings_fsdp_strategy_on_cpu_ranks_is_lightnings_own_one_line(lend, tmp_path):
    """RayFSDPStrategy needs an accelerator (Lightning's FSDP refuses CPU, under Ray
    Train as here): the cell fails in one line naming that, and the group is kept."""
    require("lightning", "the Lightning tests (pip install -e '.[test]')")
    with rtnb.Session(
        workers=2,
        cpus_per_worker=0.5,
        group_factory=lend,
        storage=str(tmp_path / "runs"),
        stop_grace_s=1.0,
    ) as session:
        session.run("MARKER = None\n" + SETUP, output=lambda *a: None)
        with pytest.raises(rtnb.CellError, match="FSDP needs a non-CPU accelerator") as info:
            session.run("fit(1, RayFSDPStrategy())", output=lambda *a: None)
        assert "\n" not in str(info.value).split(": ", 1)[1].strip()
        assert session.run("1 + 1") == {0: 2, 1: 2}
