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
