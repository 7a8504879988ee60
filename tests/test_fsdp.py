"""Models bigger than one device: FSDP2 in a cell on gloo CPU ranks, and a sharded
(DCP) checkpoint that every rank saved, committed as one, loaded at another world
size."""

from __future__ import annotations

import re

import pytest
import torch

import rtnb
from tests.test_export import run_exported

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = """
import torch, rtnb
import torch.distributed as dist
from torch.distributed.tensor import DTensor
torch.manual_seed(0)
model = rtnb.prepare_model(
    torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
    parallel_strategy="fsdp",
)
"""

TRAIN = """
import tempfile
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(1 + dist.get_rank())  # each rank its own batch
for step in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()
shard = tempfile.mkdtemp()
dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=shard)
rtnb.report({"step": step}, checkpoint=rtnb.Checkpoint.from_directory(shard))
full = {k: v.full_tensor() for k, v in model.state_dict().items()}
"""

LOAD = """
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
state = {"model": get_model_state_dict(model)}
with rtnb.get_checkpoint().as_directory() as folder:
    files = sorted(os.listdir(folder))
    dcp.load(state, checkpoint_id=folder)
set_model_state_dict(model, state["model"])
loaded = {k: v.full_tensor() for k, v in model.state_dict().items()}
"""


def test_fsdp_shards_the_model_and_a_dcp_checkpoint_saved_at_2_ranks_loads_at_3(
    ray_cluster, tmp_path
):
    with rtnb.Session(
        workers=2, cpus_per_worker=0.5, storage=str(tmp_path), name="fsdp", stop_grace_s=1.0
    ) as session:
        session.run(MODEL)
        # Each rank holds its half of every parameter (a DTensor), not a replica.
        shards = session.run(
            "p = next(model.parameters())\n(type(p).__name__, tuple(p.to_local().shape), "
            "tuple(p.shape))"
        )
        assert shards == {r: ("DTensor", (8, 8), (16, 8)) for r in (0, 1)}
        session.run(TRAIN, once=True)
        full = session.pull("full")
        # Gradients were reduced over the ranks' different batches: one model.
        for name in full[0]:
            assert torch.equal(full[0][name], full[1][name]), name
        # One committed checkpoint holding every rank's DCP files and the metadata.
        (checkpoint,) = session.checkpoints.list()
        files = {f["path"] for f in checkpoint.files}
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= files, files
        assert checkpoint.ranks == [0, 1]

        session.scale(3)
        assert session.world_size == 3
        session.run("import os\n" + MODEL + LOAD)
        assert session.pull("files")[2] == session.pull("files")[0]
        for loaded in session.pull("loaded"):
            assert loaded.keys() == full[0].keys()
            for name, tensor in full[0].items():
                assert torch.equal(loaded[name], tensor), name
        # Each of the 3 ranks now holds its part of the 16 rows.
        rows = session.run("next(model.parameters()).to_local().shape[0]")
        assert sum(rows.values()) == 16 and len(rows) == 3
        session.run(
            "w_sum = float(sum(v.sum() for v in loaded.values()))\nprint(f'w_sum {w_sum!r}')"
        )
        notebook_sum = session.pull("w_sum")[0]
        checkpoint_path = session.checkpoints.get(checkpoint.id).path
        script = tmp_path / "fsdp_train.py"
        session.export(str(script))

    # The exported script keeps FSDP2 (no rtnb in it) and, told where to start from,
    # loads the notebook's sharded checkpoint: the same weights.
    text = script.read_text()
    assert "prepare_model_fsdp(" in text and "fully_shard" in text
    assert "import rtnb" not in text
    run = run_exported(script, "--resume-from", checkpoint_path)
    # The script's workers printed the sum of the weights they loaded.
    found = re.findall(r"RayTrainWorker pid=\d+\S* w_sum ([-0-9.e]+)", run.stdout + run.stderr)
    assert found, (run.stdout + run.stderr)[-3000:]
    assert all(float(x) == pytest.approx(notebook_sum, rel=1e-6) for x in found), found


def test_an_unknown_parallel_strategy_is_one_line_and_local_mode_is_unwrapped(tmp_path):
    with rtnb.Session(workers=0, storage=str(tmp_path), name="local-fsdp") as session:
        unwrapped = session.run(
            "import torch, rtnb\nm = rtnb.prepare_model(torch.nn.Linear(2, 2), "
            "parallel_strategy='fsdp')\ntype(m).__name__"
        )
        assert unwrapped == {0: "Linear"}
        with pytest.raises(rtnb.CellError, match="parallel_strategy 'tp' is not supported"):
            session.run("rtnb.prepare_model(torch.nn.Linear(2, 2), parallel_strategy='tp')")
