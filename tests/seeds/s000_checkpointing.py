# Seed 000 (shared/seeds/000_*.txt), "Checkpointing in the Training Loop": the page
# lost its indentation, restored here; its placeholders `model = ...` and
# `optimizer = ...` are filled with the corpus' MyModel and Adam (see _placeholders.py).
from ray.train import Checkpoint
import tempfile, os

def train_func(config):
    model = MyModel()
    optimizer = torch.optim.Adam(model.parameters())
    # Resume from checkpoint if available
    checkpoint = ray.train.get_checkpoint()
    start_epoch = 0
    if checkpoint:
        with checkpoint.as_directory() as ckpt_dir:
            state = torch.load(os.path.join(ckpt_dir, "model.pt"))
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start_epoch = state["epoch"] + 1
    for epoch in range(start_epoch, num_epochs):
        train_one_epoch(model, optimizer)
        # Save checkpoint (only rank 0 saves, but all ranks must call report)
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if ray.train.get_context().get_world_rank() == 0:
                torch.save({
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                }, os.path.join(tmp, "model.pt"))
                checkpoint = Checkpoint.from_directory(tmp)
            ray.train.report(
                metrics={"loss": loss, "epoch": epoch},
                checkpoint=checkpoint,
            )
