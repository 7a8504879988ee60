"""Automatic recovery (--max-failures): SIGKILLed ranks, replay, no checkpoint lost."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

import rtnb

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SETUP = "import time, rtnb, torch.distributed as dist\nSTEPS = {steps}"
TRAIN = (
    "ck = rtnb.get_checkpoint()\n"
    "i = ck.load_state()['i'] + 1 if ck is not None else 0\n"
    "while i < STEPS:\n"
    "    time.sleep(0.05)\n"
    "    rtnb.report({{'i': i}}, checkpoint=rtnb.Checkpoint.from_state({{'i': i}}) if dist.get_rank() == 0 else None)\n"
    "    i += 1\n"
    "i"
)


def _killer(session, kills: int, done: threading.Event, committed_seen: list, gap_s: float):
    rng = random.Random(7)
    killed = 0
    while killed < kills and not done.is_set():
        # Each kill is its own failure: wait until the last one was noticed, then
        # for the rebuilt group to make progress (commit one more checkpoint), so a
        # kill never lands on a group already being replaced.
        deadline = time.monotonic() + 60
        while session.failures < killed and time.monotonic() < deadline and not done.is_set():
            time.sleep(0.05)
        before = len(session.checkpoints.list())
        while time.monotonic() < deadline and not done.is_set():
            if session.state.value == "running" and len(session.checkpoints.list()) > before:
                break
            time.sleep(0.1)
        time.sleep(gap_s)
        if done.is_set():
            return
        committed_seen.extend(c.id for c in session.checkpoints.list())
        group = session.group
        if group is None or not group.ranks or session.state.value != "running":
            continue
        try:
            os.kill(rng.choice([r.pid for r in group.ranks]), signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass


def test_five_kills_recover_without_losing_a_checkpoint_and_the_sixth_fails_cleanly(lend, tmp_path):
    # Five, not more: each recovery rebuilds the group (~6 s here), and five already
    # land at random points of training, commit and rebuild.
    kills = 5
    with rtnb.Session(
        workers=2,
        group_factory=lend,
        storage=str(tmp_path),
        name="chaos",
        max_failures=kills,
        stop_grace_s=1.0,
    ) as session:
        session.run(SETUP.format(steps=400))
        done, seen = threading.Event(), []
        killer = threading.Thread(
            target=_killer, args=(session, kills, done, seen, 0.3), daemon=True
        )
        killer.start()
        notes = []
        try:
            value = session.run(
                TRAIN.format(),
                output=lambda rank, stream, text: notes.append(text) if rank < 0 else None,
            )
        finally:
            done.set()
            killer.join(timeout=30)
        assert session.failures == kills, f"{session.failures} recoveries"
        assert value == {0: 400, 1: 400}, "the loop finished exactly at the requested step"
        assert sum("worker group rebuilt" in n for n in notes) == kills
        final = {c.id for c in session.checkpoints.list()}
        assert set(seen) <= final, "no committed checkpoint was lost"
        assert session.checkpoints.latest().step == max(c.step for c in session.checkpoints.list())
        # Budget spent: the next death fails the cell with one line, the group comes back empty.
        session.run("import os, signal, time")
        with pytest.raises(rtnb.WorkerGroupError, match=f"after {kills} recoveries") as info:
            session.run(
                "if dist.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(3)"
            )
        assert "\n" not in str(info.value)
        assert session.run("1") == {0: 1, 1: 1}


BIG_SAVE = (
    "import os, torch, time, rtnb, torch.distributed as dist\n"
    "ck = rtnb.get_checkpoint()\n"
    "if ck is not None:\n"
    "    state = ck.load_state()  # verifies every file against the manifest first\n"
    "    assert state['i'] >= 0 and state['w'].numel() == 2_000_000\n"
    "    resumed_from.append(ck.id)\n"
    "i = state['i'] + 1 if ck is not None else 0\n"
    "while True:\n"
    "    # every rank writes its own 8 MB shard, so kills land mid-upload\n"
    "    shard = rtnb.Checkpoint.from_state({'i': i, 'w': torch.randn(2_000_000), 'rank': dist.get_rank()})\n"
    "    rtnb.report({'i': i}, checkpoint=shard)\n"
    "    # The ranks decide together: each reading the file alone could stop a step apart.\n"
    "    stop = torch.tensor([float(os.path.exists(STOP_FILE))])\n"
    "    dist.all_reduce(stop, op=dist.ReduceOp.MAX)\n"
    "    if stop.item():\n"
    "        break\n"
    "    i += 1\n"
    "i"
)


def test_kills_during_shard_writes_never_leave_a_partial_checkpoint_listed(lend, tmp_path):
    kills = 5
    with rtnb.Session(
        workers=2,
        group_factory=lend,
        storage=str(tmp_path),
        name="torn",
        max_failures=kills,
        keep=3,
    ) as session:
        stop_file = tmp_path / "stop"
        session.run(f"resumed_from = []\nSTOP_FILE = {str(stop_file)!r}")
        done, seen = threading.Event(), []

        def kill_then_stop():
            _killer(session, kills, done, seen, 0.05)
            time.sleep(2)  # let the last rebuilt group commit once more
            stop_file.write_text("stop")

        killer = threading.Thread(target=kill_then_stop, daemon=True)
        killer.start()
        try:
            value = session.run(BIG_SAVE, output=lambda *a: None)
        finally:
            done.set()
            killer.join(timeout=30)
        # The killer waits for each failure to be noticed before the next kill.
        assert session.failures == kills, f"{session.failures} recoveries for {kills} kills"
        assert value[0] == value[1] > 0
        listed = session.checkpoints.list(include_incomplete=True)
        assert all(c.status == "committed" for c in listed), [
            c.id for c in listed if c.status != "committed"
        ]
        for info in listed:
            session.checkpoints.get(info.id).verify(full=True)
            assert info.ranks == [0, 1]
        folders = {p.name for p in (tmp_path / "torn" / "checkpoints").iterdir() if p.is_dir()}
        assert folders == {c.id for c in listed}, "half-written folders are cleaned up"


def test_the_live_widget_shows_the_restart(lend, tmp_path):
    from rtnb.widgets import LiveMetrics

    with rtnb.Session(
        workers=2,
        group_factory=lend,
        storage=str(tmp_path),
        name="shown",
        max_failures=1,
        stop_grace_s=1.0,
    ) as session:
        session.run(SETUP.format(steps=80))
        handle = session.run_background(TRAIN.format(), total_steps=80)
        view = LiveMetrics(session.metrics, handle)
        headers = []
        view._header.observe(lambda change: headers.append(change["new"]), names="value")
        deadline = time.monotonic() + 60
        while not session.checkpoints.list() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(session.group.ranks[1].pid, signal.SIGKILL)
        assert handle.wait(120) == {0: 80, 1: 80}
        view.redraw()
        assert any("<b>restarting</b>" in h for h in headers), "shown while the group is rebuilt"
        restarted_from = handle.restarted_from
        assert restarted_from is not None and restarted_from.startswith("step-")
        assert f"restarted 1×, last from {restarted_from}" in view._header.value
        view.close()
