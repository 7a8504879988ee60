"""The training loop the cell-latency benchmark runs in both rtnb and Ray Train."""

from __future__ import annotations

STEPS = 20

# Written against ray.train's API; inside rtnb the same names resolve to rtnb's.
LOOP_SOURCE = f"""
import torch
import ray.train
import ray.train.torch

torch.manual_seed(0)
x = torch.randn(512, 32)
y = x.sum(dim=1, keepdim=True)
model = ray.train.torch.prepare_model(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range({STEPS}):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    ray.train.report({{"loss": loss.item(), "step": step}})
"""


def train_loop_per_worker(config):
    stamp = (config or {}).get("stamp_file")
    if stamp:
        # When the loop starts on a worker: the "ready" moment of a Ray Train run.
        import time

        import ray.train

        if ray.train.get_context().get_world_rank() == 0:
            with open(stamp, "w") as out:
                out.write(repr(time.time()))
    exec(LOOP_SOURCE, {"__name__": "__loop__"})
