"""``checkpoint_upload_mode=NO_UPLOAD`` and ``checkpoint_upload_fn``: files the user
put in the run's storage are committed where they are, with a manifest that vouches
for them (hashes checked before use), and rtnb never deletes them."""

from __future__ import annotations

import json

import pytest

import rtnb

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CELL = """
import os, shutil, torch, rtnb, torch.distributed as dist
r = dist.get_rank()

def state_folder(step):
    folder = os.path.join(KEPT, f"step{step}-rank{r}")
    os.makedirs(folder, exist_ok=True)
    torch.save({"w": torch.full((3,), float(step))}, os.path.join(folder, f"state-rank{r}.pt"))
    return folder

def my_upload(checkpoint, destination):
    # The user's own writer: here a plain copy into the folder rtnb names.
    shutil.copytree(checkpoint.path, destination, dirs_exist_ok=True)
    return rtnb.Checkpoint.from_directory(destination)

rtnb.report({"loss": 1.0}, step=1, checkpoint_upload_mode="NO_UPLOAD",
            checkpoint=rtnb.Checkpoint.from_directory(state_folder(1)))
rtnb.report({"loss": 0.5}, step=2, checkpoint_upload_fn=my_upload,
            checkpoint=rtnb.Checkpoint.from_directory(state_folder(2)))
rtnb.report({"loss": 0.2}, step=3, checkpoint_upload_fn=my_upload, checkpoint_upload_mode="ASYNC",
            checkpoint=rtnb.Checkpoint.from_directory(state_folder(3)))
"""


def test_files_committed_where_they_are_are_vouched_for_and_never_deleted(ray_cluster, tmp_path):
    kept = tmp_path / "kept"
    runs = tmp_path / "runs"
    with rtnb.Session(workers=2, cpus_per_worker=0.5, storage=str(runs), name="placed") as session:
        session.push({"KEPT": str(kept)})
        session.run(CELL)
        listed = session.list_checkpoints()
        assert [(c.step, c.ranks) for c in listed] == [(1, [0, 1]), (2, [0, 1]), (3, [0, 1])]
        folder = runs / "placed" / "checkpoints"
        manifest = json.loads((folder / "step-000000001" / "_manifest.json").read_text())
        # NO_UPLOAD: nothing copied; the manifest names where each rank's files are.
        assert sorted(p.name for p in (folder / "step-000000001").iterdir()) == ["_manifest.json"]
        assert {f["at"] for f in manifest["files"]} == {
            str(kept / "step1-rank0"),
            str(kept / "step1-rank1"),
        }
        # The upload function wrote into the checkpoint's own folder, sync and async.
        for step in (2, 3):
            names = {p.name for p in (folder / f"step-00000000{step}").iterdir()}
            assert names == {"_manifest.json", "state-rank0.pt", "state-rank1.pt"}, names
        # ASYNC deletes the reported folder by default (as Ray Train does): the
        # upload function read a snapshot of it, and the committed copy is whole.
        assert not (kept / "step3-rank0").exists() and (kept / "step2-rank0").exists()
        loaded = session.run("float(rtnb.get_checkpoint().load_state()['w'][0])")
        assert loaded == {0: 3.0, 1: 3.0}
        first = session.checkpoints.get("step-000000001")
        first.verify(full=True)
        assert first.load_state()["w"].tolist() == [1.0, 1.0, 1.0]
        # A file changed where it lies is caught against the manifest.
        with open(kept / "step1-rank0" / "state-rank0.pt", "ab") as out:
            out.write(b"tampered")
        with pytest.raises(rtnb.CheckpointError, match="does not match its manifest"):
            session.checkpoints.get("step-000000001").verify(full=True)
        # Deleting the checkpoint removes rtnb's folder, never the user's files.
        session.checkpoints.delete("step-000000001")
        assert not (folder / "step-000000001").exists()
        assert (kept / "step1-rank1" / "state-rank1.pt").exists()


def test_bad_placement_input_is_one_line(ray_cluster, tmp_path):
    with rtnb.Session(workers=0, storage=str(tmp_path / "runs"), name="badplace") as session:
        session.run("import rtnb, tempfile\nd = tempfile.mkdtemp()\nopen(d + '/f', 'w').close()")
        with pytest.raises(rtnb.CellError, match="not one of SYNC, ASYNC, NO_UPLOAD"):
            session.run(
                "rtnb.report({}, checkpoint=rtnb.Checkpoint.from_directory(d), "
                "checkpoint_upload_mode='LATER')"
            )
        with pytest.raises(rtnb.CellError, match="returns the Checkpoint it wrote"):
            session.run(
                "rtnb.report({}, step=5, checkpoint=rtnb.Checkpoint.from_directory(d), "
                "checkpoint_upload_fn=lambda c, dest: None)"
            )
        assert session.list_checkpoints() == []
