"""A checkpoint's files: links, hashes written while writing (storage/_checkpoint)."""

from __future__ import annotations

import threading


def test_ranks_linking_the_same_file_name_into_a_checkpoint_never_leave_it_missing(tmp_path):
    # Two ranks whose checkpoints hold the same file name link it into one folder at
    # once, each then hashing what it placed: the name must never be missing.
    from rtnb.storage._checkpoint import _link

    dst = tmp_path / "checkpoint" / "model.pt"
    sources = []
    for rank in (0, 1):
        src = tmp_path / f"rank{rank}.pt"
        src.write_bytes(b"weights")
        sources.append(str(src))
    _link(sources[0], str(dst))
    problems: list[str] = []
    linking = threading.Event()
    linking.set()

    def link_again(src: str) -> None:
        for _ in range(3000):
            if not _link(src, str(dst)):
                problems.append("a link fell back to a copy")

    def look() -> None:
        while linking.is_set():
            if not dst.exists():
                problems.append("missing")

    watcher = threading.Thread(target=look)
    watcher.start()
    linkers = [threading.Thread(target=link_again, args=(s,)) for s in sources]
    for thread in linkers:
        thread.start()
    for thread in linkers:
        thread.join()
    linking.clear()
    watcher.join()
    assert not problems, f"{len(problems)} times: {sorted(set(problems))}"
    assert sorted(p.name for p in dst.parent.iterdir()) == ["model.pt"], "no spare names left"


def test_from_state_hashes_while_it_writes_and_the_run_keeps_that_hash(tmp_path):
    """The digest from_state takes as torch.save writes is the file's own (so the
    upload, which links the file into the run, need not read it back), and the
    committed entry verifies in full."""
    import os

    import torch

    from rtnb.storage._checkpoint import MANIFEST, Checkpoint, _hash, upload_directory

    state = {"w": torch.randn(300_000), "step": 7}
    checkpoint = Checkpoint.from_state(state)
    ((name, written),) = checkpoint._written.items()
    assert written == _hash(checkpoint.filesystem, os.path.join(checkpoint.path, name))
    entries = upload_directory(checkpoint, checkpoint.filesystem, str(tmp_path / "ckpt"))
    assert [(e["path"], e["size"]) for e in entries] == [(name, written[1])]
    assert (
        entries[0][next(k for k in entries[0] if k not in ("path", "size", "stamp"))] == written[0]
    )
    assert not os.path.exists(checkpoint.path), "the temp folder goes once uploaded"
    assert MANIFEST not in os.listdir(tmp_path / "ckpt")
    assert torch.load(tmp_path / "ckpt" / name)["step"] == 7
