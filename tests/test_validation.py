"""``report(..., validation=...)``: the validation runs as its own Ray task on the
committed checkpoint, never on a rank; its metrics join the checkpoint's in the
browser's table, the ``Result`` and ``get_all_reported_checkpoints`` (on the ranks
and in the notebook), with Ray Train's statuses and consistency modes."""

from __future__ import annotations

import os

import pytest

import rtnb
from rtnb.storage._checkpoints import CheckpointInfo

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# The validation waits for a file the test writes, so the test decides when it ends.
DEFINE = """
import os, time, rtnb, torch

def validate(checkpoint, scale=1.0, gate=None):
    while gate is not None and not os.path.exists(gate):
        time.sleep(0.05)
    state = checkpoint.load_state()
    return {"val_loss": float(state["w"].sum()) * scale, "val_pid": os.getpid()}

def save(step, **kwargs):
    shard = rtnb.Checkpoint.from_state({"w": torch.full((4,), float(step))})
    rtnb.report({"loss": 1.0 / step}, checkpoint=shard, step=step, **kwargs)
"""


def test_a_validation_runs_as_a_task_and_its_metrics_join_its_checkpoint(lend, tmp_path):
    gate = tmp_path / "gate"
    with rtnb.Session(
        workers=2,
        cpus_per_worker=0.5,
        group_factory=lend,
        storage=str(tmp_path),
        name="val",
        score="val_loss",
    ) as session:
        session.run(DEFINE)
        rank_pids = set(session.run("os.getpid()").values())
        value = session.run(
            "from ray.train import ValidationConfig, ValidationTaskConfig\n"
            f"held = ValidationConfig(validate, ValidationTaskConfig(fn_kwargs={{'gate': {str(gate)!r}}}))\n"
            "save(1, validation=validate)\n"
            "save(2, validation=held)\n"
            # The rank's COMMITTED read returns with the second still validating.
            "[(r.checkpoint.id, r.status) for r in rtnb.get_all_reported_checkpoints('COMMITTED')]"
        )
        for rank in (0, 1):
            seen = dict(value[rank])
            assert list(seen) == ["step-000000001", "step-000000002"], seen
            assert seen["step-000000002"] == "PENDING_VALIDATION", seen
        shown = CheckpointInfo.table(session.list_checkpoints())
        assert "validating" in shown, shown
        gate.write_text("go")
        # In the notebook, VALIDATED (the default) waits for the validations.
        reported = rtnb.get_all_reported_checkpoints()
        assert [(r.checkpoint.id, r.status) for r in reported] == [
            ("step-000000001", "VALIDATED"),
            ("step-000000002", "VALIDATED"),
        ]
        assert [r.metrics["val_loss"] for r in reported] == [4.0, 8.0]
        assert [r.metrics["loss"] for r in reported] == [1.0, 0.5]
        assert not {r.metrics["val_pid"] for r in reported} & rank_pids, "ran on a rank"
        # On the ranks, VALIDATED returns once their last checkpoint is validated.
        on_ranks = session.run(
            "[(r.status, r.metrics['val_loss']) for r in rtnb.get_all_reported_checkpoints()]"
        )
        assert on_ranks == {r: [("VALIDATED", 4.0), ("VALIDATED", 8.0)] for r in (0, 1)}
        # The browser's table and the Result carry the validation's metrics; the
        # --score metric can be the validation's.
        listed = session.list_checkpoints()
        shown = CheckpointInfo.table(listed)
        assert "val_loss" in shown and "validated" in shown, shown
        result = session.result()
        best = result.get_best_checkpoint("val_loss", "min")
        assert best is not None and best.id == "step-000000001"


def test_a_failing_or_slow_validation_is_marked_and_training_goes_on(lend, tmp_path):
    with rtnb.Session(
        workers=2, cpus_per_worker=0.5, group_factory=lend, storage=str(tmp_path), name="valbad"
    ) as session:
        session.run(DEFINE)
        value = session.run(
            "from ray.train import ValidationConfig, ValidationTaskConfig\n"
            "def broken(checkpoint):\n    return 1 / 0\n"
            "def never(checkpoint):\n    time.sleep(60)\n    return {}\n"
            "save(1, validation=broken)\n"
            "save(2, validation=ValidationConfig(never, ValidationTaskConfig(timeout_s=0.5)))\n"
            "save(3)\n"
            "'trained'"
        )
        assert value == {0: "trained", 1: "trained"}
        reported = rtnb.get_all_reported_checkpoints()
        assert [r.status for r in reported] == [
            "VALIDATION_FAILED",
            "VALIDATION_TIMEOUT",
            "COMMITTED",
        ]
        (failed,) = [c for c in session.list_checkpoints() if c.step == 1]
        assert "division by zero" in failed.validation["error"]
        assert os.path.exists(tmp_path / "valbad" / "validations" / "step-000000001.json")
        # A checkpoint whose validation failed still loads: its files are intact.
        assert session.run("rtnb.get_checkpoint().load_state()['w'][0].item()") == {0: 3.0, 1: 3.0}


def test_validation_without_a_checkpoint_is_one_line(ray_cluster, tmp_path):
    with rtnb.Session(workers=0, storage=str(tmp_path), name="valnone") as session:
        with pytest.raises(rtnb.errors.CellError, match="validates the checkpoint reported"):
            session.run("import rtnb\nrtnb.report({'loss': 1.0}, validation=lambda c: {})")
