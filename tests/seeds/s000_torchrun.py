# Seed 000, "Multi-Process Local Mode with torchrun": train_script.py (indentation
# restored), as run by `%rtnb import` on the group.
# train_script.py — same Ray Train code, launched via torchrun
import torch
from torch.utils.data import DataLoader, TensorDataset
from ray.train import ScalingConfig, get_context
from ray.train.torch import TorchTrainer
def train_func(config):
    model = torch.nn.Linear(10, 1) # replace with your model
    dataset = TensorDataset(torch.randn(100, 10), torch.randn(100, 1))
    loader = DataLoader(dataset, batch_size=16)
    model = ray.train.torch.prepare_model(model)
    loader = ray.train.torch.prepare_data_loader(loader)
    # get_context() returns correct world_size/rank from torchrun env
    print(f"Rank {get_context().get_world_rank()} of {get_context().get_world_size()}")
    # ... training loop with ray.train.report(...)
trainer = TorchTrainer(
    train_loop_per_worker=train_func,
    scaling_config=ScalingConfig(num_workers=0, use_gpu=True),
)
result = trainer.fit()
