"""The driver's failure and recovery logic on a group without Ray (tests/_threaded_group.py):
the real controller, cell flow, cell handle, failure policy, stop protocol, commits,
journal and replay, driven by real rank runtimes in this process whose losses the
tests make happen at a chosen step. Each test runs in about a second; the Ray suite
keeps the scenarios that need a real process killed, a real Ray lost or real DDP.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest

import rtnb
from rtnb.core._messages import RankUpdate
from rtnb.driver.cells import _observers
from rtnb.driver.cells._observers import CellObserver, CellView, ObserverContext
from rtnb.driver.ranks import command_all
from rtnb.storage._journal import EntryKind
from rtnb.worker._commands import RankCommand
from tests._margins import until
from tests._threaded_group import ThreadedGroup, no_ray, threaded_ranks

TRAIN = """
import os, time, rtnb
def committed(step):  # rank 1 is lost only once the driver committed this step
    manifest = os.path.join({checkpoints!r}, f"step-{{step:09d}}", "_manifest.json")
    while not os.path.exists(manifest):
        time.sleep(0.005)
ck = rtnb.get_checkpoint()
start = ck.load_state()["step"] + 1 if ck is not None else 0
for step in range(start, 10):
    keep = rtnb.Checkpoint.from_state({{"step": step}}) if step % 2 == 0 else None
    rtnb.report({{"loss": float(step)}}, checkpoint=keep)
    if RANK == 1 and step == 5 and ck is None:
        committed(4)
        lose_me()
start
"""


class Groups:
    """A session's ``group_factory`` that keeps every group it built, in order."""

    def __init__(self) -> None:
        self.built: list[ThreadedGroup] = []

    def __call__(self, config, run_name: str, storage_path: str) -> ThreadedGroup:
        group = ThreadedGroup(config, run_name, storage_path)
        self.built.append(group)
        return group


@pytest.fixture
def groups():
    with threaded_ranks():
        yield Groups()


def _session(tmp_path: Path, groups: Groups, **options) -> rtnb.Session:
    options.setdefault("workers", 2)
    session = rtnb.Session(
        storage=str(tmp_path), name="logic", group_factory=groups, connector=no_ray, **options
    )
    return session.start()


def _train(tmp_path: Path) -> str:
    return TRAIN.format(checkpoints=str(tmp_path / "logic" / "checkpoints"))


def test_a_lost_rank_ends_the_cell_in_one_line_keeps_its_commits_and_a_new_group_serves(
    tmp_path, groups
):
    session = _session(tmp_path, groups)
    try:
        session.run("before = RANK")
        with pytest.raises(rtnb.WorkerGroupError) as raised:
            session.run(_train(tmp_path))
        assert str(raised.value).startswith("rank 1 died during cell"), raised.value
        assert "rebuilt with fresh ranks" in str(raised.value)
        committed = [c.id for c in session.list_checkpoints()]
        assert {"step-000000000", "step-000000002", "step-000000004"} <= set(committed)
        assert len(groups.built) == 2, "the group was rebuilt once"
        assert session.run("RANK").values_list() == [0, 1], "the new group runs cells"
        with pytest.raises(rtnb.CellError, match="NameError"):
            session.run("before")  # the lost group's variables went with it
    finally:
        session.stop()


def test_with_max_failures_a_lost_rank_is_replaced_and_its_cell_goes_on_from_the_latest_commit(
    tmp_path, groups
):
    session = _session(tmp_path, groups, max_failures=1)
    try:
        starts = session.run(_train(tmp_path)).values_list()
        assert starts == [5, 5], "both ranks went on after step 4's checkpoint"
        assert len(groups.built) == 2 and session.failures == 1
        recovery = session.last_recovery
        assert recovery is not None and recovery.error is None, recovery
    finally:
        session.stop()


def test_a_rank_that_raises_stops_the_others_at_a_common_step_and_keeps_the_group(tmp_path, groups):
    session = _session(tmp_path, groups)
    try:
        with pytest.raises(rtnb.CellError) as raised:
            session.run(
                "import rtnb\nkept = RANK\nfor step in range(100000):\n"
                "    rtnb.report({'loss': 1.0})\n"
                "    if RANK == 1 and step == 3:\n        raise RuntimeError('boom')\n"
            )
        shown = str(raised.value) + str(raised.value.failures)
        assert "rank 1" in shown and "boom" in shown, shown
        assert len(groups.built) == 1, "rank 0 stopped at its next report: nothing rebuilt"
        assert session.run("kept").values_list() == [0, 1], "variables kept"
    finally:
        session.stop()


def test_the_ranks_of_a_machine_that_stopped_answering_are_lost_at_once(tmp_path, groups):
    session = _session(tmp_path, groups)
    try:
        handle = session.run_background("import time\nwhile True:\n    time.sleep(0.01)")
        groups.built[0].cut(1, "that machine accepted no connection for 6 s")
        with pytest.raises(rtnb.WorkerGroupError) as raised:
            handle.wait(30)
        assert "rank 1" in str(raised.value)
        assert "accepted no connection for 6 s" in str(raised.value), raised.value
    finally:
        session.stop()


def test_a_replayed_session_rebuilds_the_ranks_variables_from_the_journal(tmp_path, groups):
    first = _session(tmp_path, groups)
    first.run("x = RANK * 10")
    first.run("x += 1")
    first.stop()
    again = _session(tmp_path, groups, replay=True)
    try:
        assert again.run("x").values_list() == [1, 11]
        assert again.last_replay is not None
    finally:
        again.stop()


def test_a_stopped_cell_ends_every_rank_at_one_step_and_keeps_the_group(tmp_path, groups):
    """A stop asks every rank to pause at its next report, then sets one target step
    (past the furthest rank's): each rank leaves its loop there, none is rebuilt."""
    session = _session(tmp_path, groups)
    try:
        handle = session.run_background(
            "import rtnb\nkept = RANK\nfor step in range(10**7):\n    rtnb.report({'loss': 1.0})\n"
        )
        metrics = session.metrics
        until(
            "both ranks reporting", lambda: min(metrics.counts.get(r, 0) for r in (0, 1)) > 50, 30
        )
        handle.stop()
        with pytest.raises(rtnb.CellInterrupted):
            handle.wait(30)
        last = {rank: metrics.last[rank].step for rank in (0, 1)}
        assert last[0] == last[1], f"the ranks stopped at different steps: {last}"
        assert len(groups.built) == 1 and session.run("kept").values_list() == [0, 1]
    finally:
        session.stop()


class _GoOnSmaller(rtnb.FailurePolicy):
    """README's elastic policy: after a death, one rank fewer rather than wait."""

    def decide(self, failure: rtnb.Failure):
        if (
            failure.dead
            and not failure.stopping
            and failure.world_size > 1
            and self.failures < self.max_failures
        ):
            self.failures += 1
            return rtnb.Shrink(self.describe(), workers=failure.world_size - 1)
        return super().decide(failure)


def test_a_policy_that_shrinks_runs_the_cell_again_on_fewer_ranks_with_the_journal_replayed(
    tmp_path, groups
):
    session = _session(tmp_path, groups, failure_policy=_GoOnSmaller(2))
    try:
        session.run("import rtnb\nx = 41")
        value = session.run(
            "if rtnb.get_context().get_world_size() == 2 and RANK == 1:\n    lose_me()\n"
            "(rtnb.get_context().get_world_size(), x + 1)",
            once=True,  # a replay (the scale below) must not run the loss again
        )
        # The replay gave the one rank left the state the cell needs (x).
        assert value == {0: (1, 42)}
        assert session.failures == 1
        assert isinstance(session.last_recovery.decision, rtnb.Shrink)
        assert session.config.workers == 1 and session.group.world_size == 1
        assert session.status().world_size == 1
        assert session.pull("x") == [41]
        # Scaled back to two, a cell on rank 1 alone loses it again: the group it
        # shrinks to has no rank 1, and the cell says so in one line.
        session.scale(2)
        with pytest.raises(rtnb.WorkerGroupError, match="without cell 3's rank 1") as info:
            session.run("lose_me()", ranks="1", once=True)
        assert "\n" not in str(info.value)
        assert session.failures == 2 and session.group.world_size == 1
        assert session.run("x") == {0: 41}
    finally:
        session.stop()


def test_a_cells_timeout_stops_it_on_every_rank_and_keeps_the_group(tmp_path, groups):
    session = _session(tmp_path, groups)
    try:
        with pytest.raises(rtnb.CellInterrupted, match="timed out after 1 s"):
            session.run(
                "import time, rtnb\nwhile True:\n    rtnb.report({'x': 1})\n    time.sleep(0.01)",
                timeout=1,
            )
        assert session.run("2") == {0: 2, 1: 2}
        assert len(groups.built) == 1
    finally:
        session.stop()


# What a rank blocked in native code waits on (a collective whose peer is gone): no
# report reaches its stop, and an interrupt never lands.
STUCK = threading.Event()


def test_a_rank_blocked_past_twice_the_grace_is_given_up_and_fresh_ranks_serve(tmp_path, groups):
    session = _session(tmp_path, groups, stop_grace_s=0.5)
    try:
        session.run("kept = RANK")
        with pytest.raises(rtnb.CellInterrupted) as raised:
            session.run(
                f"import {__name__} as here\nif RANK == 1:\n    here.STUCK.wait()\n", timeout=1
            )
        said = str(raised.value)
        assert "timed out after 1 s" in said and "but rank 1 did not stop within 1 s" in said
        assert "rebuilt with fresh ranks; variables defined on the ranks are gone" in said
        assert "\n" not in said
        assert len(groups.built) == 2, "the stuck rank's group was replaced once"
        assert session.run("RANK") == {0: 0, 1: 1}
        with pytest.raises(rtnb.CellError, match="NameError"):
            session.run("kept")
    finally:
        STUCK.set()
        session.stop()


class _StepsSeen(CellObserver):
    """A feature added as users of the hook interface would: it counts each rank's
    reported steps and says how many when the cell ends."""

    def __init__(self) -> None:
        self.steps: dict[int, int] = {}

    def update(self, cell: CellView, update: RankUpdate) -> None:
        if update.reports is not None:
            self.steps[update.rank] = self.steps.get(update.rank, 0) + len(update.reports)

    def end(self, cell: CellView) -> None:
        counts = ", ".join(f"rank {rank}: {n}" for rank, n in sorted(self.steps.items()))
        cell.note(f"[steps seen] {counts}\n")


class _Broken(CellObserver):
    ticks = 0

    def tick(self, cell: CellView) -> None:
        type(self).ticks += 1
        raise RuntimeError("the feature's own bug")


class _BrokenOnUpdate(CellObserver):
    updates = 0

    def update(self, cell: CellView, update: RankUpdate) -> None:
        type(self).updates += 1
        raise RuntimeError("the feature fails on a rank's update")


def steps_seen(cell: CellView, context: ObserverContext) -> CellObserver:
    return _StepsSeen()


def broken(cell: CellView, context: ObserverContext) -> CellObserver:
    return _Broken()


def broken_on_update(cell: CellView, context: ObserverContext) -> CellObserver:
    return _BrokenOnUpdate()


def test_a_feature_added_as_a_module_and_a_registration_sees_every_report_and_one_that_raises_is_left_out(
    tmp_path, groups, monkeypatch
):
    monkeypatch.setattr(
        _observers,
        "FEATURES",
        (
            *_observers.FEATURES,
            f"{__name__}:broken_on_update",
            f"{__name__}:steps_seen",
            f"{__name__}:broken",
        ),
    )
    session = _session(tmp_path, groups)
    try:
        lines: list[str] = []
        session.run(
            "import time, rtnb\n"
            "for step in range(7):\n"
            "    rtnb.report({'loss': float(step)})\n"
            "    time.sleep(0.05)\n",
            output=lambda rank, stream, text: lines.append(text),
        )
        out = "".join(lines)
        assert "[steps seen] rank 0: 7, rank 1: 7" in out, out
        assert out.count("_Broken left") == 1, out
        assert "the feature's own bug" in out
        assert _Broken.ticks == 1, "a feature that raised is asked nothing more"
        # The updates a turn of the loop took reach each feature together: one that
        # raised on the first is left out, and the features after it get them all.
        assert out.count("_BrokenOnUpdate left") == 1, out
        assert _BrokenOnUpdate.updates == 1
        assert session.run("RANK").values_list() == [0, 1], "the group serves on"
    finally:
        session.stop()


README_CELL = """
import torch, rtnb
net = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.05)
start = 0
if (restored := rtnb.get_checkpoint()) is not None:
    state = restored.load_state()
    net.load_state_dict(state["model"])
    start = state["step"] + 1
for step in range(start, END):
    checkpoint = None
    if step % 10 == 9:
        checkpoint = rtnb.Checkpoint.from_state({"model": net.state_dict(), "step": step})
    rtnb.report({"loss": float(step)}, checkpoint=checkpoint)
start
"""


def test_a_training_cell_run_again_goes_on_from_the_latest_checkpoint_and_says_so_when_nothing_was_left(
    tmp_path, groups
):
    session = _session(tmp_path, groups)
    try:
        said: list[str] = []

        def run(end: int):
            del said[:]
            session.run(f"END = {end}")
            return session.run(README_CELL, output=lambda rank, stream, text: said.append(text))

        assert run(20).values_list() == [0, 0]
        assert not [line for line in said if "[rtnb]" in line], said
        # Run again as it stands: it goes on from step 19, with nothing left to train.
        assert run(20).values_list() == [20, 20]
        notes = [line for line in said if "went on from" in line]
        assert len(notes) == 1, said
        assert "step-000000019" in notes[0] and "%rtnb stop, then %rtnb start" in notes[0]
        # With more steps to take, it trains on from there and needs no word.
        assert run(30).values_list() == [20, 20]
        assert not [line for line in said if "went on from" in line], said
        assert [c.step for c in session.list_checkpoints()] == [9, 19, 29]
    finally:
        session.stop()


@dataclasses.dataclass(frozen=True)
class NamesLike(RankCommand):
    """A control no group knows: the names in a rank's namespace with a prefix."""

    prefix: str

    def apply(self, runtime, payload=None):
        return sorted(name for name in runtime.namespace if name.startswith(self.prefix))


def test_a_new_control_is_one_command_that_reaches_every_rank_through_the_groups_as_they_are(
    tmp_path, groups
):
    session = _session(tmp_path, groups)
    try:
        session.run("seen_rank = RANK\nseen_twice = 2 * RANK")
        group = groups.built[-1]
        answers = group.gather(command_all(group, range(2), NamesLike("seen_")), 10.0)
        assert answers == [["seen_rank", "seen_twice"]] * 2
        # The commands the driver itself sends go the same way: values out and in.
        session.push({"seen_pushed": 7})
        assert session.pull("seen_pushed") == [7, 7]
    finally:
        session.stop()


def _notes(into: list[str]):
    return lambda rank, stream, text: into.append(text) if rank < 0 else None


def _lose_when(group: ThreadedGroup, rank: int, ready) -> threading.Thread:
    """Lose ``rank`` of ``group`` (its process gone) once ``ready()`` holds."""

    def run() -> None:
        until("the moment to lose the rank", ready, 30, poll_s=0.01)
        group.lose(rank)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_pushes_functions_and_a_rank_subsets_cells_are_replayed_after_a_rank_is_lost(
    tmp_path, groups
):
    def setup(config):  # local: cloudpickle journals it by value
        import rtnb

        # State a function leaves on its rank: kept by the rank's runtime.
        extra = rtnb.get_context().extra
        extra["from_fn"] = config["base"] + rtnb.get_context().get_world_rank()
        return extra["from_fn"]

    session = _session(tmp_path, groups, max_failures=2)
    try:
        session.push({"scale": 3})
        assert session.run(setup, config={"base": 10}) == {0: 10, 1: 11}
        session.run("only_on_one = 'kept'", ranks=[1])
        session.run("counter = 0")
        session.run("counter += 1")  # replayed once, so it must end at 1, not 2
        session.run("expensive = 'once'", once=True)  # %%rtrain --once: never replayed
        session.run("import time, rtnb")
        kinds = [e.kind for e in session.journal.entries()]
        assert kinds[:3] == [EntryKind.START, EntryKind.PUSH, EntryKind.CELL]

        loser = _lose_when(groups.built[0], 1, lambda: session.active_cell is not None)
        notes: list[str] = []
        value = session.run(
            "time.sleep(0.5)\n"
            "(scale * rtnb.get_context().extra['from_fn'], counter, 'only_on_one' in globals())",
            output=_notes(notes),
        )
        loser.join()
        assert session.failures == 1 and len(groups.built) == 2
        assert value == {0: (30, 1, False), 1: (33, 1, True)}
        assert session.pull("only_on_one", ranks="1") == ["kept"]
        with pytest.raises(rtnb.SessionError, match="'expensive' is not defined"):
            session.pull("expensive")
        assert any("worker group rebuilt (recovery 1 of 2)" in n for n in notes), notes
        assert any("5 cells and 1 push replayed in" in n for n in notes), notes
        assert any("not replayed: cell 5 (marked --once)" in n for n in notes), notes
        assert any("restarted without loading a checkpoint" in n for n in notes), notes
    finally:
        session.stop()


# The resume pattern of Ray Train: start after the step the checkpoint holds.
RESUMING = (
    "import time, rtnb\n"
    "ck = rtnb.get_checkpoint()\n"
    "loaded_i = ck.load_state()['i'] if ck is not None else None\n"
    "i = loaded_i + 1 if ck is not None else 0\n"
    "while i < STEPS:\n"
    "    time.sleep(globals().get('SLEEP', 0))\n"
    "    first = rtnb.get_context().get_world_rank() == 0\n"
    "    rtnb.report({{'i': i}}, checkpoint=rtnb.Checkpoint.from_state({{'i': i}}) if first else None)\n"
    "    i += 1\n"
    "{tail}"
)


def test_scale_down_and_up_keeps_the_ranks_variables_and_training_goes_on_from_the_latest(
    tmp_path, groups
):
    session = _session(tmp_path, groups)
    try:
        session.push({"lr": 0.25})
        session.run("STEPS = 6\nnote = 'defined before scaling'")
        session.run(RESUMING.format(tail="i"))
        latest = session.checkpoints.latest()

        session.scale(1)
        assert session.world_size == 1 and groups.built[-1].world_size == 1
        assert session.pull("note") == ["defined before scaling"]
        assert session.pull("lr") == [0.25]
        assert session.last_replay.cells == 2 and session.last_replay.pushes == 1
        assert session.run("rtnb.get_context().get_world_size()") == {0: 1}

        session.scale(2)
        assert session.pull("note") == ["defined before scaling"] * 2
        session.run("STEPS = 9")
        size = "rtnb.get_context().get_world_size()"
        value = session.run(RESUMING.format(tail=f"(loaded_i, i, {size})"))
        assert value == {0: (5, 9, 2), 1: (5, 9, 2)}
        assert session.checkpoints.latest().step > latest.step
        kinds = [e.kind for e in session.journal.entries()]
        assert kinds.count(EntryKind.SCALE) == 2

        # restart without --replay is a fresh group; with it, the state stays.
        session.restart(replay=True)
        assert session.pull("note") == ["defined before scaling"] * 2
        session.restart()
        with pytest.raises(rtnb.SessionError, match="not defined"):
            session.pull("note")
    finally:
        session.stop()


def test_a_pull_during_a_recovery_waits_for_the_new_group_or_says_it_is_recovering(
    tmp_path, groups
):
    session = _session(tmp_path, groups, max_failures=1)
    try:
        session.run("import time\nanswer = 42")
        handle = session.run_background("time.sleep(1)\n1")
        groups.built[0].lose(0)
        seen = []
        while not handle.done():
            try:
                seen.append(session.pull("answer"))
            except rtnb.SessionError as exc:
                seen.append(str(exc))
            seen.append(str(session.status()).splitlines()[0])
            handle.wait_left(0.05)
        assert handle.wait(30) == {0: 1, 1: 1}
        assert not any("no worker group" in str(s) for s in seen), seen
        assert [42, 42] in seen
        assert session.failures == 1 and len(groups.built) == 2
    finally:
        session.stop()


# 200 steps from the checkpoint it resumes (one, at step 40); every step reads the
# live control and reports it. Rank 1 is lost once at step 150 (while the DIE file
# is missing): the recovery runs the cell again from step 41.
CONTROLLED = """\
import os, time, rtnb
rank = rtnb.get_context().world_rank
checkpoint = rtnb.get_checkpoint()
start = checkpoint.load_state()["step"] + 1 if checkpoint else 0
seen = []
for step in range(start, 200):
    lr = rtnb.control("lr", 0.1)
    seen.append((step, lr))
    if rank == 1 and step == 150 and not os.path.exists(DIE):
        open(DIE, "w").close()
        lose_me()
    saved = rtnb.Checkpoint.from_state({"step": step}) if step == 40 else None
    rtnb.report({"lr": lr}, checkpoint=saved)
    time.sleep(0.002)
"""


def test_a_control_change_reaches_every_rank_at_one_step_and_a_recovery_and_a_replay_repeat_it(
    tmp_path, groups
):
    from rtnb.storage._metricslog import read_metrics
    from rtnb.storage._rundir import RunDirectory

    session = _session(tmp_path, groups, max_failures=1)
    try:
        # Set between cells: the next cell starts with it.
        assert session.set_controls(lr=0.2) is None
        assert list(session.run("import rtnb\nrtnb.control('lr', 0.1)").values()) == [0.2, 0.2]
        session.push({"DIE": str(tmp_path / "died")})
        handle = session.run_background(CONTROLLED)
        until("step 50 on both ranks", lambda: min(handle.steps.values()) >= 50, 30, 0.01)
        step = session.set_controls(lr=0.5)
        assert 50 <= step < 150
        handle.wait(60)
        assert handle.recoveries == 1 and len(groups.built) == 2  # rank 1 lost at 150
        # The run again (on a new group, from the checkpoint at step 40) took the
        # change at the same step: 0.2 up to it, 0.5 from it on.
        expected = [(s, 0.2 if s < step else 0.5) for s in range(41, 200)]
        assert session.pull("seen") == [expected, expected]
        session.metrics.flush()
        rows = read_metrics(RunDirectory(str(tmp_path), session.run_name))
        first = {
            rank: min(r["step"] for r in rows if r["rank"] == rank and r.get("lr") == 0.5)
            for rank in (0, 1)
        }
        assert first == {0: step, 1: step}
        assert session.metrics.markers == [(step, "lr = 0.5")]
        system = read_metrics(RunDirectory(str(tmp_path), session.run_name), system=True)
        applied = {r["rank"]: r["step"] for r in system if r.get("control/lr") == 0.5}
        assert applied == {0: step, 1: step}
        controls = [e for e in session.journal.entries() if e.kind is EntryKind.CONTROL]
        assert [(e.controls, e.step, e.of is None) for e in controls] == [
            ({"lr": 0.2}, None, True),
            ({"lr": 0.5}, step, False),
        ]
        # A replay onto a fresh group repeats it all: the set between cells, the
        # change at its step.
        session.restart(replay=True)
        assert session.pull("seen") == [expected, expected]
        with pytest.raises(rtnb.ConfigError, match="takes a number"):
            session.set_controls(lr=[1, 2])
    finally:
        session.stop()


def test_replaying_finished_resume_pattern_cells_costs_their_setup_not_their_training(
    tmp_path, groups
):
    session = _session(tmp_path, groups, max_failures=1)
    try:
        trained_s = 0.0
        for k in range(1, 6):
            session.run(f"STEPS = {15 * k}")
            started = time.monotonic()
            session.run("SLEEP = 0.02\n" + RESUMING.format(tail="i"))
            trained_s += time.monotonic() - started
        loser = _lose_when(groups.built[0], 1, lambda: session.active_cell is not None)
        session.run("time.sleep(0.5)\n1")
        loser.join()
        report = session.last_recovery.replay
        assert report.cells == 10
        # Re-training would take about trained_s (~5 s); each replayed cell starts past
        # the latest checkpoint and costs its set-up: half of the training separates
        # the two without racing a busy machine.
        assert report.duration_s < 0.5 * trained_s, (report.duration_s, trained_s)
        assert session.run("i") == {0: 75, 1: 75}
    finally:
        session.stop()
