"""Checkpoints on real ranks and real files: save, commit, verify, retention, load."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

import rtnb

pytestmark = pytest.mark.ray

SAVE_LOOP = (
    "import torch, rtnb, torch.distributed as dist\n"
    "model = torch.nn.Linear(4, 1)\n"
    "for s in range({n}):\n"
    "    loss = float({n} - s) + dist.get_rank()\n"
    "    state = {{'model': model.state_dict(), 'rank': dist.get_rank(), 'i': s}}\n"
    "    rtnb.report({{'loss': loss}}, checkpoint=rtnb.Checkpoint.from_state(state) if dist.get_rank() == 0 else None)\n"
)


@pytest.fixture
def session(lend, tmp_path):
    s = rtnb.Session(
        workers=2,
        group_factory=lend,
        storage=str(tmp_path),
        name="ck",
        keep=2,
        score="loss",
        mode="min",
    )
    s.start()
    yield s
    s.stop()


def test_checkpoints_commit_with_a_manifest_and_get_checkpoint_returns_the_latest(
    session, tmp_path
):
    session.run(SAVE_LOOP.format(n=4))
    listed = session.list_checkpoints()
    assert [c.status for c in listed] == ["committed"] * 2, "keep=2"
    latest = listed[-1]
    manifest = json.loads(
        (tmp_path / "ck" / "checkpoints" / latest.id / "_manifest.json").read_text()
    )
    assert manifest["ranks"] == [0] and manifest["files"][0]["path"] == "state-rank0.pt"
    assert (
        manifest["files"][0]["size"]
        == (tmp_path / "ck" / "checkpoints" / latest.id / "state-rank0.pt").stat().st_size
    )
    assert manifest["metrics"]["loss"] == pytest.approx(1.0)
    assert (tmp_path / "ck" / "checkpoints" / "index.json").exists()
    value = session.run("ck = rtnb.get_checkpoint()\nst = ck.load_state()\n(ck.id, st['i'])")
    assert value == {0: (latest.id, 3), 1: (latest.id, 3)}
    result = session.result()
    assert result.checkpoint.id == latest.id
    # a step number is enough to name a checkpoint
    assert session.load(str(latest.step)).id == session.load(f"step-{latest.step}").id == latest.id


def test_retention_keeps_the_best_by_score_and_never_the_latest_away(session):
    session.run(SAVE_LOOP.format(n=5))  # loss falls: 5,4,3,2,1 (+rank)
    session.run(
        "for s in range(2):\n"
        "    rtnb.report({'loss': 100.0 + s}, checkpoint=rtnb.Checkpoint.from_state({'late': s}) if dist.get_rank() == 0 else None)"
    )
    ids = [c.id for c in session.list_checkpoints()]
    steps = [c.step for c in session.list_checkpoints()]
    assert len(ids) == 3, "the 2 best plus the latest"
    assert steps[-1] == 6, "the latest (worst score) is kept"
    assert steps[:2] == [3, 4], "the two lowest losses are kept"


def test_tampered_or_unmanifested_checkpoints_are_refused(session, tmp_path):
    session.run(SAVE_LOOP.format(n=1))
    latest = session.checkpoints.latest()
    path = tmp_path / "ck" / "checkpoints" / latest.id / "state-rank0.pt"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(rtnb.CheckpointError, match="does not match its manifest"):
        session.checkpoints.get(latest.id).to_directory()
    with pytest.raises(rtnb.CheckpointError, match="does not match its manifest"):
        session.checkpoints.get(latest.id).load_state()
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(rtnb.CheckpointError, match="trusted=True"):
        rtnb.Checkpoint.from_directory(plain).to_directory()
    with pytest.raises(rtnb.CheckpointError, match="no committed checkpoint 'step-000099999'"):
        session.load("step-99999")
    # A typed name never reaches outside checkpoints/.
    for bad in ("step-nope", "../../etc", "step-1/../../x", "latest/.."):
        with pytest.raises(rtnb.CheckpointError, match="is not a checkpoint id"):
            session.load(bad)


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/rtnb-pwned",))


def test_a_planted_pickle_payload_is_never_executed(tmp_path):
    import os

    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "state-rank0.pt").write_bytes(pickle.dumps({"model": _Payload()}))
    if os.path.exists("/tmp/rtnb-pwned"):
        os.remove("/tmp/rtnb-pwned")
    with pytest.raises(rtnb.CheckpointError, match="weights_only"):
        rtnb.Checkpoint.from_directory(folder).load_state(trusted=True)
    assert not os.path.exists("/tmp/rtnb-pwned")


def test_a_new_session_with_the_same_name_resumes_from_the_latest(lend, tmp_path):
    with rtnb.Session(workers=2, group_factory=lend, storage=str(tmp_path), name="again") as first:
        first.run(SAVE_LOOP.format(n=3))
        saved = first.checkpoints.latest().id
    with rtnb.Session(workers=2, group_factory=lend, storage=str(tmp_path), name="again") as second:
        value = second.run("import rtnb\nck = rtnb.get_checkpoint()\n(ck.id, ck.load_state()['i'])")
    assert value == {0: (saved, 2), 1: (saved, 2)}


RESUMABLE = (
    "import rtnb, torch.distributed as dist\n"
    "ck = rtnb.get_checkpoint()\n"
    "start = ck.load_state()['i'] + 1 if ck is not None else 0\n"
    "done = []\n"
    "for i in range(start, 6):\n"
    "    done.append(i)\n"
    "    rtnb.report({'loss': 10.0 - i}, checkpoint=rtnb.Checkpoint.from_state({'i': i}) if dist.get_rank() == 0 else None)\n"
    "done"
)


def test_resume_from_an_earlier_checkpoint_trains_a_branch_and_never_rewrites_the_original(
    lend, tmp_path
):
    with rtnb.Session(
        workers=2, group_factory=lend, storage=str(tmp_path), name="branch"
    ) as session:
        session.run(RESUMABLE)
        main = session.list_checkpoints()
        # Steps count from 0, so the loop's own i names its checkpoints.
        assert [c.id for c in main] == [f"step-00000000{i}" for i in range(6)]
        for c in main:
            assert session.checkpoints.get(c.id).load_state()["i"] == c.step
        files = tmp_path / "branch" / "checkpoints" / "step-000000004" / "state-rank0.pt"
        before = (files.stat().st_mtime_ns, files.read_bytes())
        assert session.resume("step-2") == {0: [3, 4, 5], 1: [3, 4, 5]}
        ids = [c.id for c in session.list_checkpoints()]
        branch = [f"step-00000000{i}-b1" for i in (3, 4, 5)]
        assert set(ids) == {c.id for c in main} | set(branch), "the original line stays whole"
        assert (files.stat().st_mtime_ns, files.read_bytes()) == before, "never rewritten"
        for cid in branch:
            # The branch counts on from the checkpoint's step: id and state agree.
            assert session.checkpoints.get(cid).load_state()["i"] == int(cid[5:14])
        assert session.latest_checkpoint_id() == "step-000000005-b1"
        assert session.load("5").id == "step-000000005", "a bare step names the first line's"
        # The plot draws the branch over the original: the first line is kept aside.
        earlier_steps, _t, _v = session.metrics.earlier_series("loss", 0)
        assert earlier_steps == [0, 1, 2, 3, 4, 5]
        assert session.metrics.series("loss", 0)[0] == [3, 4, 5]
        # A loop that reports its own "step" numbers its checkpoints by it.
        session.run(
            "rtnb.report({'step': 40, 'loss': 0.5}, checkpoint=rtnb.Checkpoint.from_state({'i': 40}) if dist.get_rank() == 0 else None)"
        )
        assert session.latest_checkpoint_id() == "step-000000040-b1"
    # A new session on the same run carries on the branch (line and step).
    with rtnb.Session(workers=2, group_factory=lend, storage=str(tmp_path), name="branch") as again:
        again.run(
            "import rtnb, torch.distributed as dist\n"
            "rtnb.report({'loss': 0.25}, checkpoint=rtnb.Checkpoint.from_state({'i': 41}) if dist.get_rank() == 0 else None)"
        )
        assert again.latest_checkpoint_id() == "step-000000041-b1"
        assert "step-000000041" not in [c.id for c in again.list_checkpoints()]


def test_resume_reruns_the_last_training_cell_from_the_chosen_checkpoint(lend, tmp_path):
    with rtnb.Session(
        workers=2, group_factory=lend, storage=str(tmp_path), name="resume"
    ) as session:
        assert session.run(RESUMABLE) == {0: [0, 1, 2, 3, 4, 5], 1: [0, 1, 2, 3, 4, 5]}
        chosen = next(
            c for c in session.list_checkpoints() if c.metrics["loss"] == pytest.approx(8.0)
        )
        value = session.resume(chosen.id)
        assert value == {0: [3, 4, 5], 1: [3, 4, 5]}, "training continues after the chosen step"
        session.stop()
        # Resume also re-creates the group when it is gone.
        again = session.resume("latest")
        assert again == {0: [], 1: []}


def test_checkpoint_browser_timeline_rows_and_buttons_act_on_the_selected_checkpoint():
    from types import SimpleNamespace

    from rtnb.widgets import CheckpointBrowser

    rows = [
        rtnb.CheckpointInfo(
            id="step-000000001",
            step=1,
            time=1.0,
            metrics={"loss": 3.0},
            ranks=[0],
            files=[{"path": "a", "size": 2048, "sha256": "x"}],
        ),
        rtnb.CheckpointInfo(
            id="step-000000002", step=2, time=2.0, metrics={"loss": 1.0}, ranks=[0, 1]
        ),
        rtnb.CheckpointInfo(
            id="step-000000003", step=3, time=0.0, metrics={}, ranks=[], status="incomplete"
        ),
        rtnb.CheckpointInfo(
            id="step-000000002-b1", step=2, time=5.0, metrics={"loss": 2.0}, ranks=[0, 1]
        ),
    ]
    calls = []
    browser = CheckpointBrowser(
        lambda: list(rows),
        load=lambda cid: calls.append(("load", cid)),
        resume=lambda cid: calls.append(("resume", cid)) or "resumed",
        delete=lambda cid: (
            calls.append(("delete", cid)) or rows.remove(next(r for r in rows if r.id == cid))
        ),
        score="loss",
    )
    # Grouped by line of training (the first, then branch 1), newest step first.
    assert [c.id for c in browser.rows()] == [
        "step-000000003",
        "step-000000002",
        "step-000000001",
        "step-000000002-b1",
    ]
    assert browser.selected is None, "nothing is selected until the user selects"
    assert all(b.disabled for b in browser._buttons.values()), "no button acts on nothing"
    shown = {row["id"]: row for row in browser.table.rows}
    badges = {cid: [label for label, _tone in row["badges"]] for cid, row in shown.items()}
    assert badges["step-000000002-b1"] == ["latest"], "committed last = latest"
    assert shown["step-000000002-b1"]["group"] == "branch 1"
    assert badges["step-000000002"] == ["★ best"] and badges["step-000000003"] == ["incomplete"]
    assert shown["step-000000001"]["cells"]["size"] == "2.0 KB"
    assert shown["step-000000002"]["cells"]["step"] == "step 2", "named by its step"
    assert [c["key"] for c in browser.table.columns if c["numeric"]] == ["age", "loss", "size"]
    # The timeline: one marker trace per line, the best a star, the latest bigger.
    lines = [t for t in browser.timeline.data if t.mode == "lines+markers"]
    assert [t.name for t in lines] == ["main", "branch 1"]
    assert list(lines[0].x) == [1, 2] and list(lines[0].y) == [3.0, 1.0]
    assert list(lines[0].marker.symbol) == ["circle", "star"]
    # A click on the loss header sorts lowest (the best loss) first, the page and
    # the kernel alike; an incomplete checkpoint (no loss) last of its line.
    loss = next(c for c in browser.table.columns if c["key"] == "loss")
    assert loss["descending_first"] is False
    browser.table.sort_by, browser.table.descending = "loss", False
    assert [c.id for c in browser.rows()] == [
        "step-000000002",
        "step-000000001",
        "step-000000003",
        "step-000000002-b1",
    ]
    browser.select("step-000000003")
    assert browser.selected is None, "an incomplete checkpoint cannot be selected"
    # Clicking a marker selects its checkpoint.
    main = next(t for t in browser.timeline.data if t.name == "main")
    browser._on_marker(main, SimpleNamespace(point_inds=[1]), None)
    assert browser.selected == "step-000000002"
    assert not browser._buttons["Delete"].disabled, "not the latest: may be deleted"
    browser.select("step-000000002-b1")
    assert browser._buttons["Delete"].disabled, "the latest is never offered for deletion"
    assert not browser._buttons["Load"].disabled
    browser.select("step-000000001")
    browser._buttons["Load"].click()
    browser._buttons["Resume"].click()
    assert calls == [("load", "step-000000001"), ("resume", "step-000000001")]
    assert "resumed" in browser.message.value
    browser._buttons["Delete"].click()
    assert calls[-1][0] != "delete" and "Confirm delete" in browser.message.value
    browser._buttons["Delete"].click()
    assert calls[-1] == ("delete", "step-000000001")
    assert browser.selected is None and browser._buttons["Delete"].disabled


def test_runs_and_checkpoints_are_listed_on_the_command_line(lend, tmp_path):
    import subprocess
    import sys

    with rtnb.Session(
        workers=2, group_factory=lend, storage=str(tmp_path), name="cli-run"
    ) as session:
        session.run(SAVE_LOOP.format(n=2))
    runs = subprocess.run(
        [sys.executable, "-m", "rtnb.batch.cli", "runs", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert runs.returncode == 0 and "cli-run" in runs.stdout and "stopped" in runs.stdout
    head, row = runs.stdout.strip().splitlines()[:2]
    assert head.split()[:8] == [
        "run",
        "status",
        "ranks",
        "started",
        "updated",
        "duration",
        "steps",
        "checkpoints",
    ]
    cells = row.split()
    assert cells[:3] == ["cli-run", "stopped", "2"]
    assert cells[8:10] == ["2", "2"], "steps and committed checkpoints of the run"
    compared = subprocess.run(
        [sys.executable, "-m", "rtnb.batch.cli", "runs", str(tmp_path), "--metric", "loss"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    head, row = compared.stdout.strip().splitlines()
    assert head.split()[-5:] == ["last", "loss", "best", "loss", "config"], head
    # SAVE_LOOP's loss at its last step is 1 + rank: the mean over 2 ranks is 1.5
    assert row.split()[-3:-1] == ["1.5", "1.5"] and row.split()[1] == "finished", row
    table = subprocess.run(
        [
            sys.executable,
            "-m",
            "rtnb.batch.cli",
            "checkpoints",
            "cli-run",
            "--storage",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = table.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["id", "step", "time"] and "loss" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["step-000000000", "step-000000001"]
    assert all(line.rstrip().endswith("committed") for line in lines[1:])
    missing = subprocess.run(
        [sys.executable, "-m", "rtnb.batch.cli", "checkpoints", "nope", "--storage", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr


def test_reported_state_checkpoints_leave_no_temporary_copies(session):
    import glob

    before = set(glob.glob("/tmp/rtnb-ckpt-*"))
    session.run(SAVE_LOOP.format(n=5))
    assert set(glob.glob("/tmp/rtnb-ckpt-*")) - before == set()


def test_a_same_size_rewrite_after_commit_is_caught(session, tmp_path):
    # Loads skip re-hashing a file whose inode stamp is unchanged since commit; an
    # in-place rewrite that keeps the size must still be caught.
    session.run(SAVE_LOOP.format(n=1))
    latest = session.checkpoints.latest()
    path = tmp_path / "ck" / "checkpoints" / latest.id / "state-rank0.pt"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(data)
    with pytest.raises(rtnb.CheckpointError, match="does not match its manifest"):
        session.checkpoints.get(latest.id).load_state()
    with pytest.raises(rtnb.CheckpointError, match="does not match its manifest"):
        session.checkpoints.get(latest.id).verify()


def test_a_users_directory_is_copied_so_rewriting_it_keeps_the_checkpoint(session, tmp_path):
    # The common loop that torch.save()s into the same folder every epoch must not
    # rewrite checkpoints already committed from that folder.
    own = tmp_path / "mine"
    value = session.run(
        "import os, rtnb, torch\n"
        f"own = {str(own)!r} + str(rtnb.get_context().get_world_rank())\n"
        "os.makedirs(own, exist_ok=True)\n"
        "for i in range(1, 3):\n"
        "    torch.save({'i': i}, os.path.join(own, 'model.pt'))\n"
        "    rtnb.report({'loss': 10.0 - i}, checkpoint=rtnb.Checkpoint.from_directory(own))\n"
        "'ok'"
    )
    assert dict(value) == {0: "ok", 1: "ok"}
    saved = []
    for info in session.list_checkpoints():
        checkpoint = session.checkpoints.get(info.id)
        checkpoint.verify(full=True)
        with checkpoint.as_directory() as folder:
            saved.append(torch.load(os.path.join(folder, "model.pt"))["i"])
    assert saved == [1, 2], "each checkpoint holds what was saved when it was reported"


def test_an_async_folder_kept_and_rewritten_in_place_keeps_each_checkpoint(session, tmp_path):
    # ASYNC with the folder kept (delete_local_checkpoint_after_upload=False): the
    # (--keep 2 keeps the lowest losses and the latest: all three.)
    # upload runs after report returned, while the loop already rewrote the file.
    own = tmp_path / "kept"
    value = session.run(
        "import os, rtnb, torch\n"
        f"own = {str(own)!r} + str(rtnb.get_context().get_world_rank())\n"
        "os.makedirs(own, exist_ok=True)\n"
        "for i in range(11, 14):\n"
        "    torch.save({'i': i}, os.path.join(own, 'model.pt'))\n"
        "    rtnb.report({'loss': float(i)}, step=i, checkpoint=rtnb.Checkpoint.from_directory(own),\n"
        "                checkpoint_upload_mode='ASYNC', delete_local_checkpoint_after_upload=False)\n"
        "os.path.exists(os.path.join(own, 'model.pt'))"
    )
    assert dict(value) == {0: True, 1: True}, "the folder was kept"
    saved = {}
    for info in session.list_checkpoints():
        if info.step >= 11:
            checkpoint = session.checkpoints.get(info.id)
            checkpoint.verify(full=True)
            with checkpoint.as_directory() as folder:
                saved[info.step] = torch.load(os.path.join(folder, "model.pt"))["i"]
    assert saved == {11: 11, 12: 12, 13: 13}, "each holds what was saved when it was reported"


def test_manifests_hashed_with_sha256_still_verify(tmp_path):
    import hashlib

    folder = tmp_path / "old"
    folder.mkdir()
    data = b"weights" * 1000
    (folder / "state-rank0.pt").write_bytes(data)
    entry = {
        "path": "state-rank0.pt",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    old = rtnb.Checkpoint(str(folder), manifest={"files": [entry]})
    old.verify(full=True)
    (folder / "state-rank0.pt").write_bytes(data[:-1] + b"X")
    with pytest.raises(rtnb.CheckpointError, match="does not match its manifest"):
        old.verify(full=True)


def test_every_committed_checkpoint_holds_every_saving_ranks_shard(session):
    # from_state shards upload in the background, rank 1's ten times bigger and so
    # later: the driver must still wait for both before it commits a step.
    session.run(
        "import torch, rtnb, torch.distributed as dist\n"
        "n = 200_000 if dist.get_rank() == 0 else 2_000_000\n"
        "for s in range(6):\n"
        "    rtnb.report({'loss': 10.0 - s}, checkpoint=rtnb.Checkpoint.from_state({'s': s, 'w': torch.randn(n)}))\n"
    )
    listed = session.list_checkpoints(include_incomplete=True)
    assert len(listed) == 2 and all(c.status == "committed" for c in listed)  # keep=2
    for info in listed:
        assert info.ranks == [0, 1], info
        assert sorted(f["path"] for f in info.files) == ["state-rank0.pt", "state-rank1.pt"]
        session.checkpoints.get(info.id).verify(full=True)
    value = session.run("ck = rtnb.get_checkpoint()\nck.load_state()['s']")
    assert value == {0: 5, 1: 5}


def test_a_step_one_rank_could_not_write_is_never_committed_with_the_others_files(lend, tmp_path):
    # Rank 1's checkpoint makes a folder "x" in step 3's checkpoint; rank 0's file of
    # that name can then not be written there. Rank 1's files alone must not become
    # step 3's checkpoint, in this cell or when later cells pass step 3.
    session = rtnb.Session(workers=2, group_factory=lend, storage=str(tmp_path), name="half")
    session.start()
    try:
        with pytest.raises(rtnb.StorageError, match="rank 0 could not write") as failed:
            session.run(
                "import os, tempfile, rtnb, torch.distributed as dist\n"
                "def folder(rank, step):\n"
                "    d = tempfile.mkdtemp()\n"
                "    name = 'x' if rank == 0 and step == 3 else f'x/rank{rank}.pt'\n"
                "    os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)\n"
                "    open(os.path.join(d, name), 'w').write(str(step))\n"
                "    return rtnb.Checkpoint.from_directory(d)\n"
                "rank = dist.get_rank()\n"
                "for step in range(1, 4):\n"
                "    if rank == 0 and step == 3:\n"
                "        dist.barrier()  # rank 1's folder x is there first\n"
                "    rtnb.report({'loss': 1.0}, step=step, checkpoint=folder(rank, step),\n"
                "                checkpoint_upload_mode='SYNC')\n"
                "    if rank == 1 and step == 3:\n"
                "        dist.barrier()\n"
            )
        assert "step-000000002" in str(failed.value), str(failed.value)
        assert [c.step for c in session.list_checkpoints()] == [1, 2]
        session.run(
            "for step in range(4, 6):\n"
            "    rtnb.report({'loss': 1.0}, step=step, checkpoint=folder(rank, step),\n"
            "                checkpoint_upload_mode='SYNC')\n"
        )
        listed = session.list_checkpoints()
        assert [c.step for c in listed] == [1, 2, 4, 5], "step 3 lacks rank 0's files"
        for info in listed:
            assert info.ranks == [0, 1], info
            session.checkpoints.get(info.id).verify(full=True)
    finally:
        session.stop()
