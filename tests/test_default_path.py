"""The path a user gets by default, with the seeds' code as they wrote it.

One real Jupyter kernel, no ``RAY_ADDRESS``, the warm Ray on (as in any notebook
kernel) at this machine's real CPU count, and a plain ``%rtnb start``: the rest of
the suite uses a roomy 4-CPU test cluster, which hid a Ray Data cell that waited
for ever on a 2-core laptop. The Ray Train examples of ``shared/seeds/`` run here
from ``tests/seeds/`` (as pasted; where a page lost its indentation it is
restored, and each file's header says what else it needed): through ``%rtnb
import``, in ``%%rtrain`` cells, and through ``rtnb.sweep``.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import psutil
import pytest

from tests._kernel import kernel_with_rtnb
from tests.conftest import require

pytestmark = [pytest.mark.slow]

SEEDS = Path(__file__).resolve().parent / "seeds"


def _ok(run) -> str:
    assert run.status == "ok", run.text + run.ename + run.evalue + "\n".join(run.traceback)
    return run.text + json.dumps(run.results)


def _cell_error(run) -> str:
    """A cell that failed on the ranks: its one-line summary (the remote traceback of
    the user's code follows it in the cell, as it should)."""
    assert run.status == "error", run.text
    assert "\n" not in run.evalue.strip(), run.evalue
    return run.evalue


def _one_line(run) -> str:
    assert run.status == "error", run.text
    shown = "\n".join(run.traceback) + run.stderr
    assert "Traceback" not in shown and "site-packages/rtnb" not in shown, shown
    return run.evalue


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    nb = tmp_path_factory.mktemp("nb")
    # A newcomer's machine: none of the suite's Ray settings (its token included) and
    # a HOME with no ~/.ray, so the warm Ray makes its token as on a laptop that never
    # ran Ray, and the kernel must find it by itself.
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "RTNB_WARM_RAY" and not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))
    }
    env.update(
        HOME=str(tmp_path_factory.mktemp("user")),
        RTNB_HOME=str(home),
        RTNB_WARM_RAY_IDLE_S="3",
    )
    with kernel_with_rtnb(str(nb), env=env) as k:
        k.started = k.execute("%rtnb start", timeout=240)
        k.cwd = nb
        yield k
    # The warm Ray ends once no kernel is attached for its idle time (3 s here).
    states = list((home / "warm-ray").glob("*.json"))
    pids = [json.loads(s.read_text())["pid"] for s in states]
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and any(
        psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids
    ):
        time.sleep(0.25)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_a_plain_start_joins_the_warm_ray_at_this_machines_cpus(kernel):
    shown = _ok(kernel.started)
    assert "the warm Ray" in shown and "2 ranks" in shown, shown
    resources = _ok(kernel.execute("import ray\nprint(dict(ray.cluster_resources()))"))
    cpus = os.cpu_count()
    assert f"'CPU': {cpus + 1}.0" in resources, "the machine's CPUs, and one for Ray Data"
    assert f"'rtnb_rank_cpu': {cpus}.0" in resources, "ranks never take Ray Data's CPU"


def test_a_ray_data_cell_reads_every_row_once_and_says_what_it_did(kernel):
    _ok(kernel.execute("ds = ray.data.range(200).map(lambda r: {'id': r['id'] * 2})"))
    run = kernel.execute(
        "%%rtrain --datasets train=ds\n"
        "import rtnb\n"
        "got = sorted(r['id'] for r in rtnb.get_dataset_shard('train').iter_rows())",
        timeout=120,
    )
    _ok(run)
    shards = _pull(kernel, "got")
    assert sorted(sum(shards, [])) == list(range(0, 400, 2)), "every row once"
    assert [len(s) for s in shards] == [100, 100]
    # Ray 2.40's Data stats keep no row count: the line then says "rows read".
    counted = "200 rows" if _ray_at_least(2, 60) else "rows"
    # The time is left out when Ray's stats hold no end for the read (seen once in a
    # fresh-clone run): the line is still whole.
    assert re.search(rf"Ray Data 'train': {counted} read( in \d+\.\d s)?\n", run.text), run.text
    assert "Running Dataset" not in run.text, "no progress bars in the cell"


def _ray_at_least(major: int, minor: int) -> bool:
    import ray

    return tuple(int(x) for x in ray.__version__.split(".")[:2]) >= (major, minor)


def _pull(kernel, name: str) -> list:
    """``%rtnb pull NAME``'s list, read back into the test."""
    import pickle

    run = kernel.execute(f"import pickle\n_v = %rtnb pull {name}\nprint(pickle.dumps(_v).hex())")
    _ok(run)
    return pickle.loads(bytes.fromhex(run.stdout.split()[-1]))


def test_a_pipeline_that_cannot_get_a_cpu_ends_the_cell_in_one_line(kernel):
    """Another actor holds Ray Data's CPU: the cell ends within the 15 s wait, its
    line says what holds the CPUs and what to do; nothing is kept."""
    _ok(
        kernel.execute(
            "@ray.remote(num_cpus=1)\nclass Hog:\n    def ping(self): return 1\n"
            "hog = Hog.remote(); ray.get(hog.ping.remote())"
        )
    )
    try:
        run = kernel.execute(
            "%%rtrain --datasets more=ds\nlen(list(rtnb.get_dataset_shard('more').iter_rows()))",
            timeout=60,
        )
        line = _one_line(run)
        assert "the Ray Data pipeline of 'more' needs 1 free CPU" in line, line
        assert "the ranks hold 2 of the cluster's 3 CPUs, other work holds 1" in line, line
        assert "--cpus-per-worker 0.5" in line
    finally:
        _ok(kernel.execute("ray.kill(hog)"))
    kept = _cell_error(kernel.execute("%%rtrain\nrtnb.get_dataset_shard('more')"))
    assert "more" in kept, "a refused pipeline is not handed over"


def test_seed_scripts_run_on_the_live_group_through_import(kernel):
    _ok(kernel.execute("%%rtrain\n" + (SEEDS / "_placeholders.py").read_text()))
    quick = _ok(kernel.execute(f"%rtnb import {SEEDS / 's001_quickstart.py'}", timeout=120))
    assert "the script asks for 4 workers" in quick and "runs on this group's 2 ranks" in quick
    assert 'left out (driver code): line 39 (print(f"Final loss' in quick, quick
    losses = _ok(kernel.execute("r = %rtnb result\nprint(sorted(r.metrics_dataframe.columns))"))
    assert "'loss'" in losses and "'epoch'" in losses, losses

    torchrun = _ok(kernel.execute(f"%rtnb import {SEEDS / 's000_torchrun.py'}", timeout=120))
    assert "[rank 0] Rank 0 of 2" in torchrun and "[rank 1] Rank 1 of 2" in torchrun, torchrun

    # Seed 000's checkpointing loop: rank 0's checkpoint an epoch; run again, every
    # rank loads the latest one and carries on after its epoch.
    _ok(kernel.execute(f"%rtnb import {SEEDS / 's000_checkpointing.py'}", timeout=120))
    latest = _checkpoints(kernel)[-1]
    again = _ok(
        kernel.execute(
            f"%rtnb import {SEEDS / 's000_checkpointing.py'}\n"
            "%rtrain print('start', ray.train.get_checkpoint().id)",
            timeout=120,
        )
    )
    assert again.count(f"start {latest}") == 2, again

    # Seeds whose code fails under TorchTrainer too fail here the same way, in one line.
    scale = _cell_error(kernel.execute(f"%rtnb import {SEEDS / 's001_scale_existing.py'}"))
    assert "UnboundLocalError" in scale and "dataloader" in scale, scale
    trial_dir = _cell_error(kernel.execute(f"%rtnb import {SEEDS / 's001_checkpointing.py'}"))
    assert "get_trial_dir() is not for training workers" in trial_dir, trial_dir


def _checkpoints(kernel) -> list[str]:
    run = kernel.execute("_c = %rtnb checkpoints --list\nprint('ids', *[c.id for c in _c])")
    _ok(run)
    return run.stdout.split("ids", 1)[1].split()


def test_the_seeds_hugging_face_trainer_trains_with_ddp_without_use_cpu(kernel):
    require("transformers", "the Hugging Face seeds (pip install -e '.[test]')")
    _ok(kernel.execute("%%rtrain\n" + (SEEDS / "_hf_placeholders.py").read_text(), timeout=120))
    seed = (SEEDS / "s000_huggingface.py").read_text()
    # As pasted, bf16=True on CPU ranks: transformers' own line, as under TorchTrainer.
    bf16 = _cell_error(kernel.execute("%%rtrain\n" + seed + "\ntrain_func(config)", timeout=120))
    assert "doesn't support bf16/gpu" in bf16, bf16
    # bf16 left out (a GPU's), nothing else changed: DDP over the group.
    before = _checkpoints(kernel)
    trained = _ok(
        kernel.execute(
            "%%rtrain\n" + seed.replace("        bf16=True,\n", "") + "\ntrain_func(config)\n"
            "result = (trainer_world_size(), weights(model))",
            timeout=300,
        )
    )
    (world0, w0), (world1, w1) = _pull(kernel, "result")
    assert world0 == world1 == 2, trained
    assert w0 == w1, "DDP kept the weights equal though each rank had its own data"
    saved = _checkpoints(kernel)
    assert len(saved) == len(before) + 2, "save_strategy='epoch': each epoch's in rtnb's store"

    # Seed 001's loop (its TransformersTrainer is gone from Ray 2.60): the function's
    # body, a local model folder for "gpt2", and no Ray Train call at all.
    seed = (SEEDS / "s001_huggingface.py").read_text()
    loop = seed.split("# Scale to multi-node")[0].replace('"gpt2"', "LOCAL_GPT2")
    loop = loop.replace("from ray.train.huggingface import TransformersTrainer\n", "")
    _ok(kernel.execute("%%rtrain\n" + loop + "\ntrain_func({})", timeout=300))


def test_the_seeds_ray_data_loop_reads_the_pipeline(kernel):
    src = (SEEDS / "s000_ray_data.py").read_text()
    driver, loop = src.split("def train_func", 1)
    _ok(kernel.execute((SEEDS / "_data_placeholders.py").read_text() + driver, timeout=120))
    _ok(
        kernel.execute(
            "%%rtrain\nnum_epochs = 1\nSEEN_COUNT = 0\n"
            "def model(input_ids, labels):\n"
            "    global SEEN_COUNT\n"
            "    SEEN_COUNT += len(input_ids)\n"
            "    return input_ids.float().mean()\n"
        )
    )
    # On CPU ranks, `device="cuda"` is the one change (TorchTrainer fails the same).
    cuda = _cell_error(
        kernel.execute("%%rtrain --datasets train=ds\ndef train_func" + loop + "\ntrain_func({})")
    )
    assert "CUDA" in cuda, cuda
    _ok(
        kernel.execute(
            "%%rtrain --datasets train=ds\nSEEN_COUNT = 0\ndef train_func"
            + loop.replace('device="cuda"', "device=ray.train.torch.get_device()")
            + "\ntrain_func({})",
            timeout=120,
        )
    )
    assert sum(_pull(kernel, "SEEN_COUNT")) == 256, "every row of the 4 files, once"


def test_the_seeds_tune_searches_run_through_rtnb_sweep(kernel):
    _ok(kernel.execute("%rtnb stop"))  # the trials' groups need the CPUs
    _ok(kernel.execute(f"exec(open({str(SEEDS / '_placeholders.py')!r}).read())"))
    found = _ok(
        kernel.execute(
            "import rtnb\n"
            f"exec(open({str(SEEDS / 's000_tune.py')!r}).read())\n"
            "def train_func(config):\n"
            "    for epoch in range(config['epochs']):\n"
            "        ray.train.report({'eval_loss': config['lr'] * 1000 / (epoch + 1), 'epoch': epoch})\n"
            "tune_config.num_samples = 2\n"
            "s0 = rtnb.sweep(train_func, param_space, tune_config=tune_config)\n"
            "print('best', sorted(s0.best_config))",
            timeout=300,
        )
    )
    assert "best ['batch_size', 'epochs', 'lr']" in found, found
    # Seed 001's: its train_func and search space as pasted, its Tuner's TuneConfig
    # handed to rtnb.sweep (20 samples made 2).
    seed = (SEEDS / "s001_tune.py").read_text().split("# Run 20 trials")[0]
    found = _ok(
        kernel.execute(
            seed + "s1 = rtnb.sweep(train_func, param_space, tune_config=tune.TuneConfig(\n"
            "    num_samples=2, scheduler=ASHAScheduler(metric='loss', mode='min')))\n"
            "print('best', sorted(s1.best_config))",
            timeout=300,
        )
    )
    assert "best ['batch_size', 'lr']" in found, found


def test_local_mode_runs_the_torchrun_seed_in_the_kernel(kernel):
    _ok(kernel.execute("%rtnb start --workers 0"))
    _ok(kernel.execute("%%rtrain\n" + (SEEDS / "_placeholders.py").read_text()))
    shown = _ok(kernel.execute(f"%rtnb import {SEEDS / 's000_torchrun.py'}"))
    assert "Rank 0 of 1" in shown, shown
    _ok(kernel.execute("%rtnb stop"))
