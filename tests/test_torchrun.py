"""A torchrun script as written, in a cell and through `%rtnb import`, in a real
kernel on the persistent group; the same script under `torchrun` is the peer."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests._kernel import Kernel

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# The shape of the torchrun scripts most DDP code starts from: its own process group
# set up from the environment, LOCAL_RANK read, a DistributedSampler, a snapshot file
# it resumes from, the group destroyed at the end, positional argparse arguments.
DEFINITIONS = """
import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, data, optimizer, save_every, snapshot):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model, self.data, self.optimizer = model, data, optimizer
        self.save_every, self.snapshot = save_every, snapshot
        self.epochs_run = 0
        if os.path.exists(snapshot):
            state = torch.load(snapshot)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.epochs_run = state["epochs_run"]
            print(f"resuming from the snapshot at epoch {self.epochs_run}")
        self.model = DDP(self.model)

    def train(self, epochs):
        for epoch in range(self.epochs_run, epochs):
            self.data.sampler.set_epoch(epoch)
            for x, y in self.data:
                self.optimizer.zero_grad()
                loss = F.mse_loss(self.model(x), y)
                loss.backward()
                self.optimizer.step()
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                state = {
                    "model": self.model.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "epochs_run": epoch + 1,
                }
                torch.save(state, self.snapshot)
                print(f"epoch {epoch} saved")
        print(f"final loss {loss.item():.10f} on rank {self.global_rank}")


def main(total_epochs, save_every, batch_size=16, snapshot="snapshot.pt"):
    setup()
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    data = TensorDataset(x, x @ torch.arange(8.0).unsqueeze(1))
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data))
    Trainer(model, loader, optimizer, save_every, snapshot).train(total_epochs)
    destroy_process_group()
"""

MAIN = """

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a small DDP job")
    parser.add_argument("total_epochs", type=int, help="epochs to train")
    parser.add_argument("save_every", type=int, help="epochs between snapshots")
    parser.add_argument("--batch_size", default=16, type=int)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    main(args.total_epochs, args.save_every, args.batch_size)
"""

TORCHRUN_VARIABLES = (
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "PYTHON_EXEC",
)


def _final_losses(text: str) -> dict[int, str]:
    return {int(r): v for v, r in re.findall(r"final loss (\S+) on rank (\d+)", text)}


def _ok(run):
    assert run.status == "ok", run.text + run.ename + run.evalue + "\n".join(run.traceback)
    return run


def test_a_torchrun_script_runs_as_written_in_a_cell_and_through_import(ray_cluster, tmp_path):
    script = tmp_path / "nb" / "ddp_job.py"
    script.parent.mkdir()
    script.write_text(DEFINITIONS + MAIN)
    # The peer: the same file under torchrun, in a folder of its own (its own snapshot).
    peer = tmp_path / "peer"
    peer.mkdir()
    (peer / "ddp_job.py").write_text(DEFINITIONS + MAIN)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    ran = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "ddp_job.py", "2", "1"],
        cwd=peer,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    expected = _final_losses(ran.stdout)
    assert set(expected) == {0, 1}

    kernel = Kernel(cwd=str(script.parent))
    try:
        _ok(kernel.execute("%load_ext rtnb\n%rtnb start --workers 2 --stop-grace 1", timeout=180))
        # Pasted into a cell, main(...) at its end: the same model as under torchrun.
        first = _ok(kernel.execute("%%rtrain\n" + DEFINITIONS + "\nmain(2, 1)", timeout=300))
        assert _final_losses(first.text) == expected, first.text
        notes = [line for line in first.text.splitlines() if "[rtnb]" in line]
        assert len([n for n in notes if "init_process_group(backend='gloo')" in n]) == 1, notes
        assert any("already up" in n for n in notes) and any("stays up" in n for n in notes)
        # destroy_process_group() at its end cost nothing: the group is there at once.
        again = _ok(
            kernel.execute(
                "%rtrain import torch.distributed as dist; t = torch.ones(1); dist.all_reduce(t); t.item()"
            )
        )
        assert again.results[-1]["text/plain"] == "[rank 0] 2.0\n[rank 1] 2.0"
        # The snapshot the script wrote resumes on the next cell; the notes said once.
        resumed = _ok(kernel.execute("%%rtrain\nmain(3, 1)", timeout=300))
        assert "resuming from the snapshot at epoch 2" in resumed.text, resumed.text
        assert "[rtnb]" not in resumed.text, "the notes are said once a session"
        # Every variable torchrun gives a worker.
        seen = _ok(
            kernel.execute(f"%rtrain [k for k in {TORCHRUN_VARIABLES!r} if k not in os.environ]")
        )
        assert seen.results[-1]["text/plain"] == "[rank 0] []\n[rank 1] []", seen.results
        roles = _ok(kernel.execute("%rtrain os.environ['GROUP_RANK'], os.environ['ROLE_RANK']"))
        assert roles.results[-1]["text/plain"] == "[rank 0] ('0', '0')\n[rank 1] ('0', '1')"

        # %rtnb import: its __main__ with torchrun's command line, or one line.
        missing = kernel.execute("%rtnb import ddp_job.py 5")
        said = missing.evalue or missing.stderr
        assert missing.status == "error" and "positional argument 'save_every'" in said, said
        assert "Traceback" not in missing.text + said
        imported = _ok(kernel.execute("%rtnb import ddp_job.py 5 1 --verbose --batch_size 32"))
        assert "resuming from the snapshot at epoch 3" in imported.text, imported.text
        assert set(_final_losses(imported.text)) == {0, 1}
        argv = _ok(kernel.execute("%rtrain __import__('sys').argv[1:]"))
        assert "['5', '1', '--verbose', '--batch_size', '32']" in argv.results[-1]["text/plain"]

        # Another backend or world: one line naming both.
        other = kernel.execute("%rtrain init_process_group(backend='nccl')")
        shown = "\n".join(other.traceback)
        assert other.ename == "CellError" and "backend='nccl'" in shown, shown
        assert "gloo over 2 ranks" in shown and "--gpu" in shown
        world = kernel.execute("%rtrain init_process_group('gloo', world_size=4, rank=0)")
        shown = "\n".join(world.traceback)
        assert "world_size=4" in shown and "--workers 4" in shown, shown
        _ok(kernel.execute("%rtnb stop"))
    finally:
        kernel.shutdown()
