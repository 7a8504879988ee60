"""`%rtnb export`: a notebook's training leaves as a standalone Ray Train script that
reaches the same model, under `python FILE.py` and under torchrun."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SETUP = (
    "import torch, rtnb\n"
    "torch.manual_seed(0)\n"
    "model = rtnb.prepare_model(torch.nn.Linear(4, 1))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=lr)\n"
    "g = torch.Generator().manual_seed(1 + rtnb.get_context().get_world_rank())\n"
    "data = torch.randn(64, 4, generator=g)\n"
    "target = data.sum(dim=1, keepdim=True)"
)
EPOCHS = (
    "for epoch in range(5):\n"
    "    loss = torch.nn.functional.mse_loss(model(data), target)\n"
    "    opt.zero_grad(); loss.backward(); opt.step()\n"
    "    rtnb.report({'loss': loss.item()},"
    " checkpoint=rtnb.Checkpoint.from_state({'model': model.state_dict()}))"
)


def run_exported(script, *args: str) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS``: Ray Train on the session's cluster (RAY_ADDRESS), ranks
    as Ray workers; its controller polls them every 0.1 s, not 2 s (the script's
    result is the same). It must succeed."""
    run = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=script.parent,
        env={**os.environ, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def _final_losses(output: str) -> list[float]:
    """The final loss each process printed (under torchrun: one per rank)."""
    found = re.findall(r"final metrics: \{[^}]*'loss': ([-0-9.e]+)", output)
    assert found, output[-3000:]
    return sorted(float(x) for x in found)


def test_export_runs_as_torchtrainer_and_under_torchrun_to_the_same_model(ray_cluster, tmp_path):
    import torch

    import rtnb

    session = rtnb.Session(
        workers=2, cpus_per_worker=0.5, storage=str(tmp_path / "runs"), name="seeded"
    )
    session.start()
    try:
        session.push({"lr": 0.05})
        session.run(SETUP)
        session.run("print('a look at the data')", once=True)
        with pytest.raises(rtnb.CellError):
            session.run("raise ValueError('a typo')")
        session.run(EPOCHS)
        session.run(EPOCHS, ranks=None)
        ours = {r: session.metrics.last[r].metrics["loss"] for r in (0, 1)}
        expected = session.checkpoint_store().get(session.latest_checkpoint_id()).load_state()
        script = tmp_path / "train.py"
        exported = session.export(str(script))
    finally:
        session.stop()
    assert exported.cells == 3 and exported.inputs is None
    notes = "\n".join(exported.notes)
    assert "marked --once" in notes and "ended with error" in notes, notes
    text = script.read_text()
    tree = ast.parse(text)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m and m.split(".")[0] == "rtnb" for m in imported), imported
    assert not any(isinstance(n, ast.Name) and n.id == "rtnb" for n in ast.walk(tree))
    assert "lr = loop_config['lr']" in text and "'lr': 0.05" in text
    assert "# cell" in text and "left out: marked --once" in text

    run = run_exported(script)
    assert _final_losses(run.stdout) == pytest.approx([ours[0]], rel=1e-5), "rank 0's, as Ray's"
    path = re.findall(r"checkpoint: Checkpoint\(filesystem=\w+, path=([^)]+)\)", run.stdout)
    assert path, run.stdout[-2000:]
    # Ray Train writes no rtnb manifest: the user vouches for the files.
    state = rtnb.Checkpoint.from_directory(path[-1]).load_state(trusted=True)
    for name, tensor in expected["model"].items():
        assert torch.allclose(state["model"][name], tensor, atol=1e-6), name

    # The same file under torchrun: Ray Train's local mode in torchrun's processes.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TRAIN_V2_ENABLED"] = "1"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env["TMPDIR"] = str(scratch)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    launched = subprocess.run(
        [torchrun, "--nproc-per-node=2", str(script)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tempfile.mkdtemp(dir=tmp_path),
        env=env,
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert _final_losses(launched.stdout) == pytest.approx(sorted(ours.values()), rel=1e-5)
    # Each report's checkpoint went to the run's storage; its scratch copy is gone.
    assert not list(scratch.glob("checkpoint-*")), list(scratch.iterdir())


def test_export_bad_input_is_one_line_and_writes_nothing(tmp_path):
    import rtnb

    session = rtnb.Session(workers=0, storage=str(tmp_path / "runs"))
    session.start()
    try:
        with pytest.raises(rtnb.RtnbError, match="no cell that ran to its end"):
            session.export(str(tmp_path / "nothing.py"))
        assert not (tmp_path / "nothing.py").exists()
        session.run("x = 1")
        with pytest.raises(rtnb.RtnbError, match="FILE.py"):
            session.export(str(tmp_path / "train.txt"))
        mine = tmp_path / "mine.py"
        mine.write_text("print('my own script')\n")
        with pytest.raises(rtnb.RtnbError, match="not an rtnb export"):
            session.export(str(mine))
        assert mine.read_text() == "print('my own script')\n"
        with pytest.raises(rtnb.RtnbError, match="cannot export"):
            session.export(str(tmp_path / "no" / "such" / "dir" / "train.py"))
        exported = session.export(str(tmp_path / "train.py"))
        again = session.export(str(tmp_path / "train.py"))  # its own earlier export: replaced
        assert exported.cells == again.cells == 1
        assert "num_workers=0," in (tmp_path / "train.py").read_text(), "local mode exports as such"
    finally:
        session.stop()


RAY_TRAIN_SCRIPT = '''"""A Ray Train example as its users write it."""
import ray
import ray.train
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

SCALE = 10.0
ray.init(ignore_reinit_error=True)


def train_func(config):
    ctx = ray.train.get_context()
    model = ray.train.torch.prepare_model(torch.nn.Linear(2, 1))
    for epoch in range(config["epochs"]):
        ray.train.report({"loss": SCALE * config["lr"] / (epoch + 1),
                          "world": ctx.get_world_size()})


def main():
    ray.init()
    config = {"lr": 0.5, "epochs": 3}
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="example"),
    )
    print(trainer.fit())


if __name__ == "__main__":
    main()
'''


def test_import_runs_a_scripts_loop_on_the_group_at_its_size_and_config(ray_cluster, tmp_path):
    """From local mode: the script's ScalingConfig(num_workers=2) scales the group
    (variables kept), its loop runs with its config, and nothing of its driver code
    (ray.init, the trainer, fit) runs; a file with no loop or bad syntax is one line."""
    import rtnb

    script = tmp_path / "example.py"
    script.write_text(RAY_TRAIN_SCRIPT)
    session = rtnb.Session(workers=0, cpus_per_worker=0.5, storage=str(tmp_path / "runs"))
    session.start()
    try:
        session.run("kept = 'from local mode'")
        plan = session.prepare_import(str(script))
        assert session.world_size == 2 and "scaled to the script's 2 ranks" in plan.notes[0]
        assert any("main() (builds the trainer)" in n for n in plan.notes), plan.notes
        assert any("ray.init(" in n for n in plan.notes), plan.notes
        session.run(plan.code)
        rows = session.result().metrics_dataframe
        assert sorted(rows["loss"].tolist()) == pytest.approx(sorted([5.0, 2.5, 5 / 3] * 2))
        assert set(rows["world"]) == {2}
        assert session.pull("kept") == ["from local mode"] * 2
        assert not (tmp_path / "example").exists(), "no Ray Train run was made"
        bad = tmp_path / "bad.py"
        bad.write_text("import torch\nx = 1\n")
        with pytest.raises(rtnb.RtnbError, match="has no training loop"):
            session.prepare_import(str(bad))
        bad.write_text("def train_func(:\n")
        with pytest.raises(rtnb.RtnbError, match="not valid Python"):
            session.prepare_import(str(bad))
        with pytest.raises(rtnb.RtnbError, match="cannot read"):
            session.prepare_import(str(tmp_path / "missing.py"))
        assert session.world_size == 2
    finally:
        session.stop()


def test_an_exported_notebook_that_read_ray_data_runs_to_its_end_on_this_machine(
    ray_cluster, tmp_path
):
    """`python job.py` on the machine the notebook trained on: two workers of one CPU
    each would hold every CPU of a 2-core machine and leave Ray Data's tasks none (the
    fit then waits for ever, silently); the script's own Ray keeps one for them."""
    import ray

    import rtnb

    session = rtnb.Session(workers=2, storage=str(tmp_path / "runs"), name="data-export")
    session.start()
    try:
        train = ray.data.range(64)
        session.run(
            "import ray.train\n"
            "rows = sum(len(b['id']) for b in ray.train.get_dataset_shard('train').iter_batches())\n"
            "ray.train.report({'rows': rows})",
            datasets={"train": train},
        )
        script = tmp_path / "job.py"
        session.export(str(script))
    finally:
        session.stop()
    text = script.read_text()
    assert "ray.init(num_cpus=(os.cpu_count() or 1) + 1)" in text and "It reads Ray Data" in text
    # Its own Ray, with the machine's own CPUs (not the tests' 4-CPU cluster). In a
    # HOME of its own: a new local Ray writes ~/.ray/auth_token, which would turn token
    # auth on for every later `ray start` of the suite (tests/conftest.py).
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.1"
    env["HOME"] = str(tmp_path / "home")
    run = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "final metrics:" in run.stdout, run.stdout[-3000:]
