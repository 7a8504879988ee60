"""The run journal: recovery, scale, restart and stop replay exactly what the ranks
were given, and every message names the checkpoint the ranks really loaded.

All on the session's real local Ray, real gloo, real files; ranks are SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import rtnb
from tests.conftest import wait_for_free_cpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# The resume pattern of Ray Train: start after the step the checkpoint holds.
TRAIN = (
    "import time, rtnb, torch.distributed as dist\n"
    "ck = rtnb.get_checkpoint()\n"
    "loaded_i = ck.load_state()['i'] if ck is not None else None\n"
    "i = loaded_i + 1 if ck is not None else 0\n"
    "while i < STEPS:\n"
    "    time.sleep(SLEEP)\n"
    "    rtnb.report({{'i': i}}, checkpoint=rtnb.Checkpoint.from_state({{'i': i}}) if dist.get_rank() == 0 else None)\n"
    "    i += 1\n"
    "{tail}"
)


def _kill_rank_when(session, rank: int, ready, timeout: float = 60.0) -> threading.Thread:
    """SIGKILL ``rank`` once ``ready()`` holds (checked from another thread)."""

    def run():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not ready():
            time.sleep(0.02)
        os.kill(session.group.ranks[rank].pid, signal.SIGKILL)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _notes(into: list[str]):
    return lambda rank, stream, text: into.append(text) if rank < 0 else None


def test_a_loaded_checkpoint_applies_to_the_next_cell_only_and_recovery_uses_the_latest(
    lend, tmp_path
):
    with rtnb.Session(
        workers=2,
        group_factory=lend,
        storage=str(tmp_path),
        name="load",
        max_failures=1,
        stop_grace_s=1.0,
    ) as session:
        session.run("STEPS, SLEEP = 10, 0.0")
        session.run(TRAIN.format(tail="i"))
        first = {c.step: c.id for c in session.checkpoints.list()}
        assert len(first) == 10
        early = session.load(first[2])  # steps count from 0: step 2 holds i = 2
        assert early.load_state()["i"] == 2

        session.run("STEPS, SLEEP = 40, 0.05")
        committed_after_load = len(first) + 5
        killer = _kill_rank_when(
            session, 0, lambda: len(session.checkpoints.list()) >= committed_after_load
        )
        notes: list[str] = []
        handle = session.begin_cell(TRAIN.format(tail="(loaded_i, i)"), output=_notes(notes))
        value = handle.run_here()
        killer.join()
        assert value[0][1] == value[1][1] == 40
        resumed_from = value[0][0]
        assert resumed_from > 2, "recovery restarted from the latest checkpoint, not the loaded one"
        # The message names what the ranks loaded, and it is that checkpoint's state.
        assert handle.restarted_from is not None
        restarted = session.checkpoints.get(handle.restarted_from)
        assert restarted.load_state()["i"] == resumed_from
        assert any(
            f"cell {handle.cell_id} restarted from {handle.restarted_from} (every rank loaded it)"
            in n
            for n in notes
        ), notes
        assert handle.restarted_from not in first.values()
        # Training on from step 2 of a line that went to 9 is a branch: its ids never
        # collide with the first line's, and each holds the state its id says.
        branch = [c for c in session.checkpoints.list() if c.id.endswith("-b1")]
        assert branch and handle.restarted_from in {c.id for c in branch}
        assert {c.id for c in session.checkpoints.list()} >= set(first.values())
        for c in branch[:: max(1, len(branch) // 5)]:
            assert session.checkpoints.get(c.id).load_state()["i"] == c.step

        # Later cells keep going from the latest, never back to the loaded one.
        latest = session.checkpoints.latest()
        assert session.run("rtnb.get_checkpoint().id") == {0: latest.id, 1: latest.id}
        assert session.run(TRAIN.format(tail="(loaded_i, i)"))[0] == (39, 40)


def test_stop_with_a_background_cell_ends_within_the_stop_grace(ray_cluster, tmp_path):
    free_before = wait_for_free_cpus(4)
    session = rtnb.Session(workers=2, storage=str(tmp_path), name="stop", stop_grace_s=1.0)
    session.start()
    # A loop that never reports: only the end of the group stops it.
    handle = session.run_background("import time\nwhile True:\n    time.sleep(0.01)")
    time.sleep(0.5)
    started = time.monotonic()
    session.stop()
    took = time.monotonic() - started
    assert took <= session.config.stop_grace_s + 1.0, f"stop took {took:.2f} s"
    assert handle.done()
    with pytest.raises(rtnb.CellInterrupted, match="worker group is stopping"):
        handle.wait(1)
    assert wait_for_free_cpus(free_before) >= free_before


def test_restart_during_a_background_cell_rebuilds_once_and_wait_does_not_hang(
    ray_cluster, tmp_path
):
    with rtnb.Session(workers=2, storage=str(tmp_path), name="rs", stop_grace_s=1.0) as session:
        changes = []
        session.on_state_change(lambda change: changes.append(change.new.value))
        handle = session.run_background("import time\nwhile True:\n    time.sleep(0.01)")
        time.sleep(0.3)
        session.restart()
        assert changes.count("restarting") == 1, changes
        with pytest.raises(rtnb.CellInterrupted, match="restarts"):
            session.wait(timeout=5)
        assert handle.done()
        assert session.run("1") == {0: 1, 1: 1}


def test_ctrl_c_during_start_frees_the_placement_group_and_every_actor(
    ray_cluster, tmp_path, request
):
    import _thread

    from rtnb.driver.ranks._group import WorkerGroup

    class InterruptedAfterActorsExist(WorkerGroup):
        # A real group; the "Ctrl-C" lands once its placement group and actors exist.
        def _assign_local_ranks(self, described):
            _thread.interrupt_main()
            super()._assign_local_ranks(described)
            time.sleep(5)  # the KeyboardInterrupt arrives in here

    # A shell's background job (`bash .ci/run &`) starts Python with SIGINT ignored,
    # and interrupt_main() then does nothing: give this test a kernel's Ctrl-C.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    free_before = wait_for_free_cpus(4)
    session = rtnb.Session(
        workers=2,
        storage=str(tmp_path),
        name="ctrlc",
        group_factory=InterruptedAfterActorsExist,
    )
    started = time.monotonic()
    try:
        with pytest.raises(rtnb.SessionError, match="interrupted.*freed"):
            session.start()
        assert wait_for_free_cpus(free_before, timeout=10) >= free_before
        # Not a timing claim: on a loaded 2-core machine creating the actors alone can
        # take ~20 s; what must not happen is waiting for the group to finish starting.
        assert time.monotonic() - started < 60
    finally:
        # Whatever failed above, leave nothing held for the tests after this one.
        session.stop()


def test_a_thousand_racing_commits_each_hold_every_ranks_shard(lend, tmp_path):
    with rtnb.Session(
        workers=2, group_factory=lend, storage=str(tmp_path), name="stress"
    ) as session:
        value = session.run(
            "import torch, rtnb, torch.distributed as dist\n"
            "# rank 1's shard is 10x rank 0's, so its upload lands later\n"
            "size = 2_000 * (1 + 9 * dist.get_rank())\n"
            "for i in range(1000):\n"
            "    rtnb.report({'i': i}, checkpoint=rtnb.Checkpoint.from_state({'w': torch.full((size,), float(i))}))\n"
            "i",
            output=lambda *a: None,
        )
        assert value == {0: 999, 1: 999}
        listed = session.checkpoints.list(include_incomplete=True)
        assert len(listed) == 1000
        for info in listed:
            assert info.status == "committed" and info.ranks == [0, 1], info
            assert sorted(f["path"] for f in info.files) == ["state-rank0.pt", "state-rank1.pt"]
            session.checkpoints.get(info.id).verify(full=True)


def test_a_checkpoint_that_cannot_be_committed_fails_the_cell_with_one_line(lend, tmp_path):
    with rtnb.Session(
        workers=2, group_factory=lend, storage=str(tmp_path), name="broken"
    ) as session:
        # The index beside the checkpoints cannot be replaced: a real storage error.
        (tmp_path / "broken" / "checkpoints" / "index.json" / "x").mkdir(parents=True)
        with pytest.raises(
            rtnb.CheckpointError, match="checkpoint step-000000000 is committed, but"
        ) as info:
            session.run(
                "import rtnb\nrtnb.report({'a': 1}, checkpoint=rtnb.Checkpoint.from_state({'a': 1}))"
            )
        assert "\n" not in str(info.value)
        assert session.run("1") == {0: 1, 1: 1}, "the group stays usable"


def test_a_function_cell_whose_rank_dies_runs_again_with_its_function_and_config(
    ray_cluster, tmp_path
):
    marks = tmp_path / "marks"
    marks.mkdir()

    def train(config):
        import os

        import rtnb

        rank = rtnb.get_context().get_world_rank()
        mark = os.path.join(config["marks"], str(rank))
        if rank == 1 and not os.path.exists(mark):
            open(mark, "w").close()
            os._exit(1)  # the first attempt loses rank 1
        return config["x"] * 2

    with rtnb.Session(
        workers=2, storage=str(tmp_path / "runs"), name="fn", max_failures=1, stop_grace_s=1.0
    ) as session:
        # The rebuilt ranks get the cell's function and config again, not only the
        # journal before it.
        assert session.run(train, config={"x": 21, "marks": str(marks)}) == {0: 42, 1: 42}
        assert session.failures == 1
        assert session.state.value == "ready"
