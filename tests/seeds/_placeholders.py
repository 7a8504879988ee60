# What the seeds leave to the reader (`MyModel`, `dataloader`, `train_epoch`, ...),
# small and on CPU, run on the ranks before the seeds' own code.
# The names the seeds use without importing them (their pages import them once,
# in an earlier snippet):
import os
import ray
import ray.train
import torch
import torch.nn as nn
from ray import train
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(10, 1)

    def forward(self, batch):
        return self.net(batch).pow(2).mean()


dataloader = DataLoader(torch.randn(64, 10, generator=torch.Generator().manual_seed(0)), batch_size=8)
epochs = num_epochs = 3


def train_epoch(model, optimizer, batch_size=32):
    loss = model(torch.randn(batch_size, 10))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def train_one_epoch(model, optimizer):
    # Seed 000 reports a `loss` its loop never sets: the epoch's loss, here.
    global loss
    loss = train_epoch(model, optimizer)
