"""The nccl path: one GPU per rank. Skipped cleanly where no CUDA GPU is visible."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_nccl_group_all_reduces_on_gpu():
    import ray

    import rtnb

    if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the Ray cluster of this test session has no GPU")
    n = max(1, min(2, torch.cuda.device_count()))
    with rtnb.Session(workers=n, gpu=True) as session:
        value = session.run(
            "import torch, torch.distributed as dist, rtnb\n"
            "t = torch.ones(1, device=rtnb.get_device())\n"
            "dist.all_reduce(t)\n"
            "(dist.get_backend(), t.device.type, t.item())"
        )
    assert all(v == ("nccl", "cuda", float(n)) for v in value.values())


def test_cuda_loss_tensors_report_their_values_and_checkpoint_state_comes_back_on_the_gpu(
    tmp_path,
):
    """A loop that reports its CUDA loss tensor (no .item()) gets the numbers as they
    were at the report, even when the loop changes the tensor in place afterwards;
    a checkpoint of CUDA state with a CUDA metric commits and loads back on the GPU."""
    import ray

    import rtnb

    if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the Ray cluster of this test session has no GPU")
    with rtnb.Session(workers=1, gpu=True, storage=str(tmp_path)) as session:
        session.run(
            "import torch, rtnb\n"
            "dev = rtnb.get_device()\n"
            "for i in range(300):\n"
            "    loss = torch.full((1,), float(i), device=dev) * 0.5\n"
            "    rtnb.report({'loss': loss, 'i': i})\n"
            "    loss.add_(1000.0)\n"
            "w = torch.arange(3.0, device=dev)\n"
            "rtnb.report({'loss': w.sum()}, checkpoint=rtnb.Checkpoint.from_state({'w': w}))\n"
        )
        session.metrics.flush()
        steps, _times, values = session.metrics.series("loss", 0)
        assert steps == list(range(301))
        assert values == [i * 0.5 for i in range(300)] + [3.0]
        [checkpoint] = session.list_checkpoints()
        assert checkpoint.metrics["loss"] == 3.0
        loaded = session.run(
            "state = rtnb.get_checkpoint().load_state(map_location=rtnb.get_device())\n"
            "(state['w'].device.type, state['w'].tolist())"
        )
    assert loaded == {0: ("cuda", [0.0, 1.0, 2.0])}


def test_fsdp_on_nccl_shards_on_the_gpu_and_a_dcp_checkpoint_loads_there(tmp_path):
    """FSDP2 over nccl: each rank's shard is a CUDA DTensor; a DCP checkpoint saved
    by every rank commits as one and loads back onto the GPU (resharded when only
    one GPU is there to load it)."""
    import ray

    import rtnb

    if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the Ray cluster of this test session has no GPU")
    n = max(1, min(2, torch.cuda.device_count()))
    with rtnb.Session(workers=n, gpu=True, storage=str(tmp_path), name="gpu-fsdp") as session:
        placed = session.run(
            "import tempfile, torch, rtnb, torch.distributed as dist\n"
            "import torch.distributed.checkpoint as dcp\n"
            "from torch.distributed.checkpoint.state_dict import get_model_state_dict\n"
            "torch.manual_seed(0)\n"
            "model = rtnb.prepare_model(torch.nn.Linear(8, 16), parallel_strategy='fsdp')\n"
            "model(torch.randn(4, 8, device=rtnb.get_device())).sum().backward()\n"
            "shard = tempfile.mkdtemp()\n"
            "dcp.save({'model': get_model_state_dict(model)}, checkpoint_id=shard)\n"
            "rtnb.report({'x': 1.0}, checkpoint=rtnb.Checkpoint.from_directory(shard))\n"
            "(type(model.weight).__name__, model.weight.device.type)"
        )
        kind = "DTensor" if n > 1 else "Parameter"  # one rank: the model unwrapped
        assert all(v == (kind, "cuda") for v in placed.values()), placed
        (checkpoint,) = session.checkpoints.list()
        assert checkpoint.ranks == list(range(n))
        loaded = session.run(
            "from torch.distributed.checkpoint.state_dict import set_model_state_dict\n"
            "state = {'model': get_model_state_dict(model)}\n"
            "with rtnb.get_checkpoint().as_directory() as folder:\n"
            "    dcp.load(state, checkpoint_id=folder)\n"
            "set_model_state_dict(model, state['model'])\n"
            "next(iter(state['model'].values())).device.type"
        )
        assert set(loaded.values()) == {"cuda"}
