"""What the run journal saves when the ranks' state must be rebuilt, in one run.

(a) recovery after a SIGKILLed rank: the journal replay of a set-up cell and five
    finished training cells written in Ray Train's resume pattern, judged per cell:
    what replaying one training cell costs (each loads the latest checkpoint and
    skips its loop) less the checkpoint load itself (measured in a live cell); the
    set-up cell's replay is taken from a second run whose journal holds it alone.
    Then the whole session's replay against a new group's start (a restart's), and
    the old ratio to the cells' first run (which says how long they trained);
(b) ``scale`` (rebuild + replay, state kept) vs ``restart`` plus re-running the same
    cells by hand (which, in the resume pattern, also skips the finished training);
(c) the cost the journal adds to a warm trivial cell (a write-ahead entry and an
    outcome entry on local disk), vs the same cell with journal writes skipped.

An embedded 2-CPU Ray, 2 ranks, gloo, local storage.

    .venv/bin/python benchmarks/recovery_replay.py [--quick]
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SETUP = (
    "import time, torch, rtnb, torch.distributed as dist\n"
    "torch.manual_seed(0)\n"
    "net = torch.nn.Linear(64, 1)  # saved unwrapped: loads at any world size\n"
    "model = rtnb.prepare_model(net)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
    "x, y = torch.randn(256, 64), torch.randn(256, 1)"
)
TRAIN = (
    "ck = rtnb.get_checkpoint()\n"
    "if ck is not None:\n"
    "    state = ck.load_state()\n"
    "    net.load_state_dict(state['model'])\n"
    "start = state['step'] + 1 if ck is not None else 0\n"
    "for step in range(start, {end}):\n"
    "    opt.zero_grad()\n"
    "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
    "    loss.backward(); opt.step(); time.sleep(0.02)\n"
    "    rtnb.report({{'loss': loss.item()}}, checkpoint=rtnb.Checkpoint.from_state("
    "{{'model': net.state_dict(), 'step': step}}) if dist.get_rank() == 0 else None)\n"
)
CELLS_PER_RUN = 5
STEPS_PER_CELL = 30 if "--quick" in sys.argv else 60
TRIVIAL_CELLS = 100 if "--quick" in sys.argv else 300
# The checkpoint load a loop-skipping training cell pays, timed inside the cell.
LOAD = (
    "_t0 = time.perf_counter()\n"
    "_ck = rtnb.get_checkpoint()\n"
    "_state = _ck.load_state() if _ck is not None else None\n"
    "time.perf_counter() - _t0"
)


def _cells() -> list[str]:
    return [SETUP] + [TRAIN.format(end=STEPS_PER_CELL * (k + 1)) for k in range(CELLS_PER_RUN)]


def main() -> None:
    from _common import embedded_ray, emit, in_order, quiet

    import rtnb

    embedded_ray()
    storage = tempfile.mkdtemp(prefix="rtnb-bench-")
    session = rtnb.Session(
        workers=2, storage=storage, name="bench", max_failures=1, cpus_per_worker=0.5
    ).start()

    # (a) recovery
    first_run = 0.0
    for code in _cells():
        t0 = time.perf_counter()
        session.run(code, output=quiet)
        first_run += time.perf_counter() - t0

    loads = [max(session.run(LOAD, output=quiet, once=True).values()) for _ in range(5)]
    load_s = statistics.median(loads)
    recovered_s, replay = _recover(session)
    print(
        f"(a) recovery: {replay.cells} cells replayed in {replay.duration_s:.2f} s "
        f"(whole recovery incl. rebuild and the 1 s cell: {recovered_s:.2f} s); their "
        f"first run: {first_run:.2f} s → replay/first run = {replay.duration_s / first_run:.3f}×"
    )

    # (b) scale with state kept vs restart + re-run by hand
    t0 = time.perf_counter()
    session.scale(1)
    session.scale(2)
    scale_s = (time.perf_counter() - t0) / 2
    t0 = time.perf_counter()
    session.restart()
    new_group_s = time.perf_counter() - t0
    for code in _cells():
        session.run(code, output=quiet)
    restart_s = time.perf_counter() - t0
    print(
        f"(b) scale keeping state: {scale_s:.2f} s per scale; restart + re-run by hand: "
        f"{restart_s:.2f} s → {scale_s / restart_s:.2f}×"
    )

    # (c) journal cost per trivial cell
    for _ in range(30):
        session.run("1", output=quiet)
    append = session.journal.append

    def trivial_cells(journal: bool) -> list[float]:
        if not journal:
            session.journal.append = lambda kind, values=None, **kw: _Entry()  # skip the writes
        took = []
        for _ in range(TRIVIAL_CELLS):
            t0 = time.perf_counter()
            session.run("1", output=quiet)
            took.append(time.perf_counter() - t0)
        session.journal.append = append
        return took

    timed = {side: trivial_cells(side == "journal") for side in in_order("journal", "without")}
    a, b = statistics.median(timed["journal"]), statistics.median(timed["without"])
    print(
        f"(c) warm trivial cell: {a * 1e3:.2f} ms with the journal, {b * 1e3:.2f} ms "
        f"without → {a / b:.2f}×"
    )
    session.stop()

    # The set-up cell's replay alone: a run whose journal holds nothing else.
    setup_only = rtnb.Session(
        workers=2, storage=storage, name="bench-setup", max_failures=1, cpus_per_worker=0.5
    ).start()
    setup_only.run(SETUP, output=quiet)
    _, setup_replay = _recover(setup_only)
    setup_only.stop()
    per_cell_s = (replay.duration_s - setup_replay.duration_s) / CELLS_PER_RUN
    print(
        f"(a') per replayed training cell: {per_cell_s * 1e3:.0f} ms, of which its checkpoint "
        f"load {load_s * 1e3:.0f} ms (timed in a live cell) → {(per_cell_s - load_s) * 1e3:.0f} ms "
        f"besides (the set-up cell's replay alone: {setup_replay.duration_s:.2f} s)\n"
        f"(a'') the whole session's replay {replay.duration_s:.2f} s / a new group's start "
        f"(restart) {new_group_s:.2f} s = {replay.duration_s / new_group_s:.2f}×"
    )
    emit(
        replay_cell_ms=(per_cell_s - load_s) * 1e3,
        replay_vs_start=replay.duration_s / new_group_s,
        replay_ratio=replay.duration_s / first_run,
        scale_ratio=scale_s / restart_s,
        journal_ratio=a / b,
    )


def _recover(session) -> tuple[float, object]:
    """Kill rank 1 while a cell runs: the recovery's seconds (rebuild, replay, the
    cell) and its replay report."""
    from _common import quiet

    def kill_when_running():
        while session.active_cell is None:
            time.sleep(0.01)
        os.kill(session.group.ranks[1].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    t0 = time.perf_counter()
    session.run("time.sleep(1.0)\n1", output=quiet)
    recovered_s = time.perf_counter() - t0
    killer.join()
    return recovered_s, session.last_recovery.replay


class _Entry:
    seq = 0


if __name__ == "__main__":
    main()
