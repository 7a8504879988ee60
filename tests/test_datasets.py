"""Ray Data in cells: each rank's streaming shard, as Ray Train hands it, kept across
cells, and handed again to every new group (recovery, scale, --replay)."""

from __future__ import annotations

import os

import pytest

import rtnb

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# One epoch of the rank's shard, as a train_loop_per_worker reads it.
EPOCH = (
    "import ray.train\n"
    "rows = []\n"
    "for batch in ray.train.get_dataset_shard('train').iter_batches(batch_size=16):\n"
    "    rows += [int(i) for i in batch['id']]\n"
    "rows\n"
)


def _tripled(row: dict) -> dict:
    # Preprocessing: where it runs is recorded, so the test can say it was not here.
    return {"id": row["id"] * 3, "pid": os.getpid()}


def _assert_split(value: dict, world: int, total: int) -> None:
    shards = [value[r] for r in range(world)]
    seen = [row for shard in shards for row in shard]
    assert sorted(seen) == [i * 3 for i in range(total)], "together the shards are the dataset"
    assert len(seen) == len(set(seen)), "no row is on two ranks"
    assert all(shards), "every rank got rows"


def test_shards_are_disjoint_cover_the_dataset_and_last_across_cells(ray_cluster, tmp_path):
    import numpy as np
    import ray
    from ray.train import DataConfig

    with rtnb.Session(
        workers=2, cpus_per_worker=0.5, storage=str(tmp_path), name="data"
    ) as session:
        train = ray.data.range(200).map(_tripled)
        _assert_split(session.run(EPOCH, datasets={"train": train}), 2, 200)
        # A second epoch, in a later cell, through rtnb's own name for it.
        again = session.run(
            EPOCH.replace("ray.train.get_dataset_shard", "rtnb.get_dataset_shard").replace(
                "import ray.train", "import rtnb"
            )
        )
        _assert_split(again, 2, 200)
        pids = session.run(
            "{int(p) for b in rtnb.get_dataset_shard('train').iter_batches() for p in b['pid']}"
        )
        ranks = set(session.run("import os\nos.getpid()").values())
        workers = set().union(*pids.values())
        assert os.getpid() not in workers and not workers & ranks, (
            "preprocessing ran on the cluster"
        )

        # A dataset left out of datasets_to_split goes whole to every rank.
        session.set_datasets(
            val=ray.data.from_numpy(np.arange(10)),
            dataset_config=DataConfig(datasets_to_split=["train"]),
        )
        assert session.dataset_names == ["train", "val"]
        whole = session.run(
            "sorted(int(x) for b in rtnb.get_dataset_shard('val').iter_batches() for x in b['data'])"
        )
        assert whole == {0: list(range(10)), 1: list(range(10))}
        _assert_split(session.run(EPOCH), 2, 200)

        # Bad input: one line each, and the session goes on.
        with pytest.raises(rtnb.ConfigError, match="'rows' is a list, not a Ray Dataset") as bad:
            session.set_datasets(rows=[1, 2, 3])
        assert "\n" not in str(bad.value)
        with pytest.raises(rtnb.ConfigError, match="names 'test', which was not passed"):
            session.set_datasets(train=train, dataset_config=DataConfig(datasets_to_split=["test"]))
        with pytest.raises(rtnb.CellError, match=r"no dataset named 'test'.*handed: train, val"):
            session.run("rtnb.get_dataset_shard('test')")
        assert session.dataset_names == ["train", "val"]
        _assert_split(session.run(EPOCH), 2, 200)


def test_a_rank_lost_mid_epoch_scale_and_replay_get_the_datasets_again(ray_cluster, tmp_path):
    import numpy as np
    import ray

    marker = tmp_path / "killed-once"
    options = dict(cpus_per_worker=0.5, storage=str(tmp_path), name="data-again", stop_grace_s=1.0)
    with rtnb.Session(workers=2, max_failures=1, **options) as session:
        session.set_datasets(
            train=ray.data.range(120).map(_tripled), scratch=ray.data.from_numpy(np.arange(4))
        )
        # Rank 1 dies after its first batch, once: recovery rebuilds the group, hands
        # the datasets to it (a fresh split: the dead rank's epoch is gone) and runs
        # the cell again, whose epoch then covers the dataset.
        value = session.run(
            "import os, signal, ray.train, torch.distributed as dist\n"
            "rows = []\n"
            "for batch in ray.train.get_dataset_shard('train').iter_batches(batch_size=8):\n"
            "    rows += [int(i) for i in batch['id']]\n"
            f"    if dist.get_rank() == 1 and not os.path.exists({str(marker)!r}):\n"
            f"        open({str(marker)!r}, 'w').close()\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "rows\n"
        )
        assert marker.exists() and session.failures == 1
        _assert_split(value, 2, 120)

        session.scale(3)
        _assert_split(session.run(EPOCH), 3, 120)

    # A new kernel's --replay rebuilds the datasets from their lineage; one made
    # from the old kernel's memory cannot be, and the replay says which.
    with rtnb.Session(workers=2, replay=True, **options) as again:
        assert "scratch" in str(again.last_replay) and "pass it again" in str(again.last_replay)
        _assert_split(again.run(EPOCH), 2, 120)


def test_datasets_given_before_a_group_exists_are_refused_and_not_kept(ray_cluster, tmp_path):
    import ray

    session = rtnb.Session(workers=2, cpus_per_worker=0.5, storage=str(tmp_path))
    with pytest.raises(rtnb.SessionError, match="no worker group is running"):
        session.set_datasets(train=ray.data.range(8))
    assert session.dataset_names == [], "a refused hand-over is not kept for the next one"


def test_split_train_only_in_a_notebook_and_rank_0_alone_reads_the_validation_set(
    ray_cluster, tmp_path
):
    """The form of Ray's own scripts (``DataConfig(datasets_to_split=["train"])``, the
    validation set read by rank 0 only), written with the magics' ``--split``."""
    from tests._kernel import Kernel

    kernel = Kernel(cwd=str(tmp_path))
    try:
        cells = [
            f"%load_ext rtnb\n%rtnb start --cpus-per-worker 0.5 --storage {tmp_path} --name split",
            "import ray\ntrain_ds = ray.data.range(40)\nval_ds = ray.data.range(6)",
            "%%rtrain --datasets train=train_ds,val=val_ds --split train\n"
            "import ray.train\n"
            "rows = [int(i) for b in ray.train.get_dataset_shard('train').iter_batches() for i in b['id']]\n"
            "val = None\n"
            "if ray.train.get_context().get_world_rank() == 0:\n"
            "    val = sorted(int(i) for b in ray.train.get_dataset_shard('val').iter_batches() for i in b['id'])\n"
            "(len(rows), val)",
        ]
        shown = []
        for code in cells:
            run = kernel.execute(code, timeout=240)
            assert run.status == "ok", run.text + run.evalue + "\n".join(run.traceback)
            shown.append(run.text + "".join(str(r.get("text/plain", "")) for r in run.results))
        # train split in two halves; val whole, read by rank 0 alone, and nothing waits.
        assert "[rank 0] (20, [0, 1, 2, 3, 4, 5])" in shown[-1], shown[-1]
        assert "[rank 1] (20, None)" in shown[-1], shown[-1]
        # Ray Data's bars, reading the whole set on rank 0, are not shown as raw JSON.
        assert "magic_token" not in shown[-1], shown[-1]
        names = kernel.execute("%rtnb datasets")
        assert "datasets on the ranks: train, val" in names.text, names.text
    finally:
        kernel.execute("%rtnb stop")
        kernel.shutdown()


def test_a_rank_waiting_on_a_split_another_rank_does_not_read_is_told_why(
    ray_cluster, tmp_path, monkeypatch
):
    """Both datasets split (the default) and only rank 0 reads `val`: rank 0 would wait
    for ever, as under TorchTrainer. The cell says why, naming the dataset, the ranks
    and the fix, once rank 0 waited the note's time; once rank 1 reads its part too,
    the cell ends."""
    import ray

    from rtnb.driver.ranks import _datasets
    from tests._margins import until

    # The product's 20 s, shortened: the suite proves the note, not its patience.
    note_s = 3.0
    monkeypatch.setattr(_datasets, "SPLIT_WAIT_NOTE_S", note_s)

    gate = tmp_path / "rank-1-reads-now"
    lines: list[str] = []
    with rtnb.Session(
        workers=2, cpus_per_worker=0.5, storage=str(tmp_path), name="split-wait"
    ) as session:
        handle = session.run_background(
            "import os, time, ray.train\n"
            "rank = ray.train.get_context().get_world_rank()\n"
            "if rank == 1:\n"
            f"    while not os.path.exists({str(gate)!r}):\n"
            "        time.sleep(0.1)\n"
            "sum(len(b['id']) for b in ray.train.get_dataset_shard('val').iter_batches())",
            datasets={"train": ray.data.range(40), "val": ray.data.range(10)},
            output=lambda rank, stream, text: lines.append(text),
        )
        said = until(
            "the line about the split no other rank reads",
            lambda: next((t for t in lines if "is split across the ranks" in t), None),
            timeout_s=10 * note_s,
        )
        gate.touch()
        assert handle.wait(120) == {0: 5, 1: 5}
    assert "Ray Data 'val' is split across the ranks, and rank 0 has waited" in said, said
    assert "while rank 1 does not read it" in said and "--split train" in said, said
    assert "\n" not in said.rstrip("\n"), said
