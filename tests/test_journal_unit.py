"""The journal and checkpoint commits on real files, without Ray."""

from __future__ import annotations

import pytest

from rtnb.core._messages import CheckpointOffer
from rtnb.errors import CheckpointError, SessionError
from rtnb.storage._checkpoints import CheckpointStore
from rtnb.storage._journal import CellOutcome, EntryKind, Journal
from rtnb.storage._rundir import RunDirectory


def _cell(journal: Journal, cell_id: int, outcome: CellOutcome | None, **kw):
    entry = journal.append(EntryKind.CELL, cell_id=cell_id, code=f"c{cell_id}", **kw)
    if outcome is not None:
        journal.append(EntryKind.CELL_END, of=entry.seq, cell_id=cell_id, outcome=outcome)
    return entry


def test_replay_plan_follows_the_journal_since_the_last_fresh_start(tmp_path):
    journal = Journal(RunDirectory(str(tmp_path), "run"))
    journal.append(EntryKind.START, workers=2, keep=False)
    _cell(journal, 1, CellOutcome.OK)
    journal.append(EntryKind.RESTART, workers=2, keep=False)  # state gone: replay starts after
    push = journal.append(EntryKind.PUSH, values=b"pickled", names=["lr"])
    _cell(journal, 2, CellOutcome.OK, ranks=[1])
    _cell(journal, 3, CellOutcome.ERROR)
    _cell(journal, 4, CellOutcome.OK, once=True)
    journal.append(EntryKind.SCALE, workers=1)  # state kept
    _cell(journal, 5, CellOutcome.INTERRUPTED)
    _cell(journal, 6, CellOutcome.OK)
    running = _cell(journal, 7, None)

    def plan(before=None):
        return [
            (s.entry.kind.value, s.entry.cell_id, s.skipped) for s in journal.replay_plan(before)
        ]

    expected = [
        ("push", None, ""),
        ("cell", 2, ""),
        ("cell", 3, "it ended with error"),
        ("cell", 4, "marked --once"),
        ("cell", 5, "it ended with interrupted"),
        ("cell", 6, ""),
    ]
    assert plan(before=running.seq) == expected
    assert plan() == [*expected, ("cell", 7, "its outcome was never recorded")]
    # A new process reads the same journal back from storage, values included.
    journal.flush()
    again = Journal(RunDirectory(str(tmp_path), "run"))
    assert [e.to_json() for e in again.entries()] == [e.to_json() for e in journal.entries()]
    assert again.read_values(again.cell_entry(push.seq)) == b"pickled"
    assert [(s.entry.seq, s.skipped) for s in again.replay_plan()] == [
        (s.entry.seq, s.skipped) for s in journal.replay_plan()
    ], "a fresh start read back from storage still bounds the replay"
    assert again.entries()[2].ranks is None and again.cell_entry(push.seq + 1).ranks == [1]


def test_a_torn_last_entry_is_not_an_action(tmp_path):
    run_dir = RunDirectory(str(tmp_path), "run")
    journal = Journal(run_dir)
    _cell(journal, 1, CellOutcome.OK)
    journal.flush()
    run_dir.write_bytes("journal/00000003-cell.json", b'{"seq": 3, "kind": "ce')
    again = Journal(run_dir)
    assert [e.seq for e in again.entries()] == [1, 2]
    assert again.append(EntryKind.PUSH).seq == 3


def test_a_committed_checkpoint_is_never_rewritten(tmp_path):
    run_dir = RunDirectory(str(tmp_path), "run")
    store = CheckpointStore(run_dir)
    files = [{"path": "state-rank0.pt", "size": 1, "xxh3_128": "0"}]
    store.offer(0, CheckpointOffer(step=3, time=1.0, metrics={"loss": 1.0}, files=files))
    assert [c.id for c in store.commit_ready({0: 3}, {0})] == ["step-000000003"]
    store.offer(0, CheckpointOffer(step=3, time=2.0, metrics={"loss": 9.0}, files=files))
    with pytest.raises(CheckpointError, match="step-000000003 is already committed"):
        store.commit_ready({0: 3}, {0})
    assert CheckpointStore(run_dir).get("3").manifest["metrics"] == {"loss": 1.0}


def test_commit_waits_for_every_rank_to_pass_the_step(tmp_path):
    store = CheckpointStore(RunDirectory(str(tmp_path), "run"))
    shard = [{"path": "state-rank0.pt", "size": 1, "xxh3_128": "0"}]
    store.offer(0, CheckpointOffer(step=5, time=1.0, metrics={}, files=shard))
    # rank 1 has not passed step 5 yet (its files may still be uploading)
    assert store.commit_ready({0: 5, 1: 4}, {0, 1}) == []
    store.offer(1, CheckpointOffer(step=5, time=1.0, metrics={}, files=shard))
    (info,) = store.commit_ready({0: 5, 1: 5}, {0, 1})
    assert info.ranks == [0, 1]


def test_delete_touches_only_a_committed_checkpoint_of_this_run(tmp_path):
    run_dir = RunDirectory(str(tmp_path), "run")
    store = CheckpointStore(run_dir)
    files = [{"path": "state-rank0.pt", "size": 1, "xxh3_128": "0"}]
    for step in (1, 2):
        store.offer(0, CheckpointOffer(step=step, time=1.0, metrics={}, files=files))
    store.commit_ready({0: 2}, {0})
    outside = tmp_path / "precious"
    outside.mkdir()
    (tmp_path / "run" / "checkpoints" / "step-000000009").mkdir()  # no manifest
    for bad in ("../../precious", "step-000000009", "step-1/../../..", "latest"):
        with pytest.raises(CheckpointError):
            store.delete(bad)
    with pytest.raises(CheckpointError, match="latest checkpoint of the run and is kept"):
        store.delete("step-000000002")
    assert outside.exists() and (tmp_path / "run" / "checkpoints" / "step-000000009").exists()
    store.delete("step-000000001")
    assert [c.id for c in store.list()] == ["step-000000002"]


def test_a_journal_write_that_fails_is_one_line_and_acts_on_nothing(tmp_path):
    run_dir = RunDirectory(str(tmp_path), "run")
    journal = Journal(run_dir)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "journal").write_text("not a folder")  # where the journal must go
    with pytest.raises(SessionError, match="run journal .* nothing was sent") as info:
        journal.append(EntryKind.START, workers=2, keep=False)
    assert "\n" not in str(info.value)
    (tmp_path / "run" / "journal").unlink()  # the cause is gone: the next append works
    journal.append(EntryKind.START, workers=2, keep=False)
    journal.append(EntryKind.CELL, cell_id=1, code="x = 1")
    assert [e.kind for e in Journal(run_dir).entries()] == [EntryKind.START, EntryKind.CELL]


def test_the_journal_is_written_ahead_and_a_torn_last_line_is_skipped(tmp_path):
    run_dir = RunDirectory(str(tmp_path), "run")
    journal = Journal(run_dir)
    journal.append(EntryKind.START, workers=2, keep=False)
    push = journal.append(EntryKind.PUSH, values=b"pickled", names=["lr"])
    journal.append(EntryKind.CELL, cell_id=1, code="x = lr")
    # No flush, no close: what a process killed right now leaves.
    (ahead,) = (tmp_path / "run" / "journal").glob("ahead-*.jsonl")
    with open(ahead, "ab") as out:
        out.write(b'{"seq": 4, "kind": "cell", "co')  # a kill in the middle of a write
    again = Journal(run_dir)
    assert [e.seq for e in again.entries()] == [1, 2, 3]
    assert again.read_values(again.cell_entry(push.seq)) == b"pickled"
    assert again.append(EntryKind.CELL, cell_id=2, code="y = 1").seq == 4
    assert [e.seq for e in Journal(run_dir).entries()] == [1, 2, 3, 4]


def test_two_ranks_saving_one_file_name_commit_the_file_that_is_there(tmp_path):
    """Ranks 0 and 1 each report a folder with its own `model.pt` (Ray Train merges
    the ranks' folders alike): the last one written is the checkpoint's file, and the
    committed checkpoint verifies and loads as that file, not as a manifest naming
    both."""
    import xxhash

    from rtnb.storage._layout import checkpoint_file

    run_dir = RunDirectory(str(tmp_path), "run")
    store = CheckpointStore(run_dir)
    contents = {0: b"rank zero's weights", 1: b"rank one's other weights"}
    for rank, data in contents.items():
        entry = {
            "path": "model.pt",
            "size": len(data),
            "xxh3_128": xxhash.xxh3_128(data).hexdigest(),
        }
        store.offer(rank, CheckpointOffer(step=4, time=1.0, metrics={}, files=[entry]))
    run_dir.write_bytes(checkpoint_file("step-000000004", "model.pt"), contents[1])
    (info,) = store.commit_ready({0: 4, 1: 4}, {0, 1})
    assert info.ranks == [0, 1]
    assert [(f["path"], f["rank"]) for f in info.files] == [("model.pt", 1)]
    checkpoint = CheckpointStore(run_dir).get("4")
    checkpoint.verify(full=True)
    with checkpoint.as_directory() as folder:
        with open(f"{folder}/model.pt", "rb") as saved:
            assert saved.read() == contents[1]
